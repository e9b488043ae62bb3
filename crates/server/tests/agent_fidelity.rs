//! What agent sessions rely on beyond a well-formed answer: tool search that keeps the prompt
//! cache hitting, usage that agrees with itself within a stream, thinking shown only as asked,
//! and one truthful reason for every way an answer runs out of tokens.

mod common;

use std::sync::Arc;

use common::{post, start_configured, start_edited, Server};
use engine::checkpoint::{Architecture, MakeOptions};
use serde_json::{json, Value};
use server::scripted::{Rule, ScriptedReplies};
use server::worker::WorkerOptions;

fn tool(name: &str, deferred: bool) -> Value {
    let mut t = json!({"name": name, "description": format!("The {name} tool."),
                       "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}});
    if deferred {
        t["defer_loading"] = json!(true);
    }
    t
}

/// The `data:` payloads of an Anthropic stream, parsed.
async fn anthropic_events(s: &Server, body: &Value) -> Vec<Value> {
    let r = reqwest::Client::new().post(format!("{}/v1/messages", s.base)).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect()
}

async fn count_tokens(s: &Server, body: Value) -> u64 {
    let (code, v) = post(s, "/v1/messages/count_tokens", &body).await;
    assert_eq!(code, 200, "{v}");
    v["input_tokens"].as_u64().unwrap()
}

fn of_type<'e>(events: &'e [Value], kind: &str) -> Vec<&'e Value> {
    events.iter().filter(|e| e["type"] == kind).collect()
}

/// A Claude Code session with tool search, in miniature: the first turn offers a deferred
/// placeholder and ToolSearch; the client runs ToolSearch and answers with a `tool_reference`,
/// and from then on lists the loaded tool too, deferred.
#[tokio::test(flavor = "multi_thread")]
async fn tool_search_keeps_the_prompt_cached_and_renders_the_loaded_tool_where_it_was_loaded() {
    let s = start_configured(None, WorkerOptions::default(), |_| {}).await;
    let first_tools = json!([tool("Bash", false), tool("ToolSearch", false), tool("DeferredToolPlaceholder", true)]);
    let ask = json!({"role": "user", "content": "Fetch the page."});
    let first = json!({"model": "x", "max_tokens": 2, "tools": first_tools, "messages": [ask]});
    let (code, v) = post(&s, "/v1/messages", &first).await;
    assert_eq!(code, 200, "{v}");
    let first_prompt =
        v["usage"]["input_tokens"].as_u64().unwrap() + v["usage"]["cache_read_input_tokens"].as_u64().unwrap();

    let mut tools = first_tools.as_array().unwrap().clone();
    tools.push(tool("WebFetch", true));
    let turns = json!([ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "select:WebFetch"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}]}]);
    let second = json!({"model": "x", "max_tokens": 2, "tools": tools, "messages": turns, "stream": true});
    let events = anthropic_events(&s, &second).await;
    let start = &of_type(&events, "message_start")[0]["message"]["usage"];
    let delta = &of_type(&events, "message_delta")[0]["usage"];
    // The first prompt came from the cache (the tool list did not change), all but its
    // generation prompt (the assistant's header and empty think block, rendered otherwise once
    // the turn is in the history).
    let cached = start["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached + 8 >= first_prompt, "{cached} of the first turn's {first_prompt} tokens were cached: {start}");
    // message_start and message_delta count the prompt alike.
    for field in ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"] {
        assert_eq!(start[field], delta[field], "{field}: {start} vs {delta}");
    }

    // The deferred tools are not in the list; the loaded one is rendered in the tool result.
    let count =
        |tools: Value, messages: Value| count_tokens(&s, json!({"model": "x", "tools": tools, "messages": messages}));
    let listed_only = json!([tool("Bash", false), tool("ToolSearch", false)]);
    assert_eq!(count(Value::Array(tools.clone()), json!([ask])).await, count(listed_only.clone(), json!([ask])).await);
    let mut unloaded = turns.clone();
    unloaded[2]["content"][0]["content"] = json!("");
    let with_reference = count(Value::Array(tools.clone()), turns.clone()).await;
    let without = count(Value::Array(tools.clone()), unloaded).await;
    assert!(with_reference > without + 10, "the loaded tool's definition is rendered: {with_reference} vs {without}");

    // A reference to a tool the request does not carry is refused, naming where it is.
    let mut unknown = second.clone();
    unknown["messages"][2]["content"][0]["content"][0]["tool_name"] = json!("Nope");
    unknown["stream"] = json!(false);
    let (code, v) = post(&s, "/v1/messages", &unknown).await;
    assert_eq!(code, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("messages.2.content.0.content.0.tool_name") && message.contains("Nope"), "{message}");
}

fn scripted(rules: Vec<Rule>, max_output_tokens: Option<usize>) -> WorkerOptions {
    WorkerOptions { scripted: Some(Arc::new(ScriptedReplies::new(rules))), max_output_tokens, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread")]
async fn thinking_comes_back_only_when_asked_and_as_asked() {
    let rule = Rule { when: vec!["Think first.".into()], reply: "<think>\nPlanning.\n</think>\n\nDone.".into() };
    let s = start_configured(None, scripted(vec![rule], None), |_| {}).await;
    let ask = |thinking: Value| {
        let mut body =
            json!({"model": "x", "max_tokens": 40, "messages": [{"role": "user", "content": "Think first."}]});
        if !thinking.is_null() {
            body["thinking"] = thinking;
        }
        body
    };
    let blocks = |v: &Value| -> Vec<(String, String)> {
        v["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                let text = b["thinking"].as_str().or(b["text"].as_str()).unwrap_or("");
                (b["type"].as_str().unwrap().to_string(), text.trim().to_string())
            })
            .collect()
    };
    let (_, full) = post(&s, "/v1/messages", &ask(json!({"type": "adaptive"}))).await;
    assert_eq!(blocks(&full)[0], ("thinking".into(), "Planning.".into()), "{full}");
    let (_, omitted) = post(&s, "/v1/messages", &ask(json!({"type": "adaptive", "display": "omitted"}))).await;
    assert_eq!(blocks(&omitted)[0], ("thinking".into(), "".into()), "{omitted}");
    for not_asked in [Value::Null, json!({"type": "disabled"})] {
        let (_, v) = post(&s, "/v1/messages", &ask(not_asked)).await;
        assert!(blocks(&v).iter().all(|(kind, _)| kind != "thinking"), "{v}");
        assert!(v["content"][0]["text"].as_str().unwrap().contains("Done."), "{v}");
    }
    // Streamed, an omitted thinking block opens and closes with no text in it.
    let mut streamed = ask(json!({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}));
    streamed["stream"] = json!(true);
    let events = anthropic_events(&s, &streamed).await;
    assert_eq!(of_type(&events, "content_block_start")[0]["content_block"]["type"], "thinking", "{events:?}");
    assert!(
        of_type(&events, "content_block_delta").iter().all(|e| e["delta"]["type"] != "thinking_delta"),
        "{events:?}"
    );
    // Rendered as asked: not asking is thinking off.
    assert_eq!(count_tokens(&s, ask(Value::Null)).await, count_tokens(&s, ask(json!({"type": "disabled"}))).await);
    assert_ne!(count_tokens(&s, ask(Value::Null)).await, count_tokens(&s, ask(json!({"type": "adaptive"}))).await);
    let (code, v) = post(&s, "/v1/messages", &ask(json!({"type": "enabled", "display": "loud"}))).await;
    assert_eq!(
        (code, v["error"]["message"].as_str().map(|m| m.contains("thinking.display"))),
        (400, Some(true)),
        "{v}"
    );
}

/// Each protocol says the answer ran out of tokens when the server's cap stopped it, as it
/// does at the request's own limit; the headers say who set the limit.
#[tokio::test(flavor = "multi_thread")]
async fn the_servers_cap_ends_an_answer_as_out_of_tokens_in_every_protocol() {
    let rule = Rule { when: vec!["Count.".into()], reply: "one two three four five six seven eight nine ten".into() };
    let s = start_configured(None, scripted(vec![rule], Some(3)), |_| {}).await;
    let client = reqwest::Client::new();
    let anthropic = json!({"model": "x", "max_tokens": 100, "messages": [{"role": "user", "content": "Count."}]});
    let r = client.post(format!("{}/v1/messages", s.base)).json(&anthropic).send().await.unwrap();
    assert_eq!(
        (
            r.headers()["x-ferrite-max-tokens-set-by"].to_str().unwrap(),
            r.headers()["x-ferrite-max-tokens-clamped-from"].to_str().unwrap()
        ),
        ("server", "100")
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");

    let chat = json!({"model": "x", "max_tokens": 100, "messages": [{"role": "user", "content": "Count."}]});
    let (_, v) = post(&s, "/v1/chat/completions", &chat).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    let responses = json!({"model": "x", "input": "Count.", "stream": true});
    let r = client.post(format!("{}/v1/responses", s.base)).json(&responses).send().await.unwrap();
    assert_eq!(r.headers()["x-ferrite-max-tokens-set-by"], "server", "none asked: the server chose");
    assert!(r.headers().get("x-ferrite-max-tokens-clamped-from").is_none());
    let text = r.text().await.unwrap();
    let last: Value =
        serde_json::from_str(text.lines().filter_map(|l| l.strip_prefix("data: ")).next_back().unwrap()).unwrap();
    assert_eq!(last["type"], "response.incomplete", "{text}");
    assert_eq!(last["response"]["incomplete_details"]["reason"], "max_output_tokens", "{last}");
}

/// A request that sets no limit gets all the room the context leaves (not a fixed default),
/// reported as the server's choice.
#[tokio::test(flavor = "multi_thread")]
async fn no_limit_asked_is_the_room_the_context_leaves() {
    let o = MakeOptions::new(Architecture::Qwen3, "tiny");
    let s =
        start_edited(&o, |c| c["max_position_embeddings"] = json!(64), None, WorkerOptions::default(), |_| {}).await;
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]});
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ferrite-max-tokens-set-by"], "context");
    assert!(r.headers().get("x-ferrite-max-tokens-clamped-from").is_none());
    let room: u64 = r.headers()["x-ferrite-max-tokens"].to_str().unwrap().parse().unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(room, 64 - v["usage"]["prompt_tokens"].as_u64().unwrap(), "{v}");
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["max_tokens_clamped"], 0, "nothing the client asked was lowered: {status}");
}
