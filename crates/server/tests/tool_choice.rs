//! A forced tool call (`tool_choice` required or naming a tool) over the three APIs: even a
//! random model answers with calls of the offered tools whose arguments validate against their
//! schemas — in Qwen3's JSON form and, with Qwen3.5's published template, in the XML form, with
//! MTP speculation on — and a choice that names no offered tool is a 400 naming `tool_choice`.

mod common;

use common::{post, start, start_prepared};
use engine::checkpoint::{self, Architecture, MakeOptions};
use serde_json::{json, Value};
use server::worker::WorkerOptions;

/// Arguments a random model can finish quickly: a bounded integer and a choice.
fn parameters() -> Value {
    json!({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "mode": {"enum": ["fast", "slow"]}},
        "required": ["n", "mode"],
        "additionalProperties": false
    })
}

fn openai_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "count", "description": "Count.", "parameters": parameters()}},
        {"type": "function", "function": {"name": "pick", "parameters": {"type": "object",
            "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}}}
    ])
}

fn valid(name: &str, arguments: &Value) -> bool {
    match name {
        "count" => jsonschema::is_valid(&parameters(), arguments),
        "pick" => arguments["ok"].is_boolean(),
        _ => false,
    }
}

/// The chat request: thinking off (a random model need not close a think block).
fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 120,
                          "tools": openai_tools(), "reasoning_effort": "none"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The calls of a chat completion, checked: finish reason `tool_calls`, arguments valid.
fn calls(v: &Value) -> Vec<(String, Value)> {
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{v}"));
    calls
        .iter()
        .map(|c| {
            let name = c["function"]["name"].as_str().unwrap().to_string();
            let arguments: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(valid(&name, &arguments), "{name}({arguments}) in {v}");
            (name, arguments)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn forced_calls_over_the_three_apis() {
    let s = start(None).await;
    // A named function: one call of it.
    let named = json!({"type": "function", "function": {"name": "count"}});
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"tool_choice": named}))).await;
    assert_eq!(code, 200, "{v}");
    let got = calls(&v);
    assert_eq!(got.len(), 1, "{v}");
    assert_eq!(got[0].0, "count");
    // Required without parallel calls: exactly one call, of either tool.
    let (_, v) =
        post(&s, "/v1/chat/completions", &chat(json!({"tool_choice": "required", "parallel_tool_calls": false}))).await;
    assert_eq!(calls(&v).len(), 1, "{v}");
    // Sampled, the arguments still validate.
    for seed in 0..3 {
        let body = chat(json!({"tool_choice": "required", "temperature": 1.0, "seed": seed}));
        let (_, v) = post(&s, "/v1/chat/completions", &body).await;
        assert!(!calls(&v).is_empty(), "{v}");
    }
    // Anthropic: a named tool, answered as a tool_use block.
    let tools =
        json!([{"name": "count", "input_schema": parameters()}, {"name": "pick", "input_schema": {"type": "object"}}]);
    let body = json!({"model": "tiny", "max_tokens": 120, "messages": [{"role": "user", "content": "Count."}], "tools": tools,
                      "tool_choice": {"type": "tool", "name": "count"}, "thinking": {"type": "disabled"}});
    let (code, v) = post(&s, "/v1/messages", &body).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let block = v["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap();
    assert_eq!(block["name"], "count");
    assert!(valid("count", &block["input"]), "{v}");
    // The Responses API: `{"type": "function", "name": …}`.
    let tools = json!([{"type": "function", "name": "count", "parameters": parameters()}]);
    let body = json!({"model": "tiny", "input": "Count.", "tools": tools, "max_output_tokens": 120,
                      "tool_choice": {"type": "function", "name": "count"}, "reasoning": {"effort": "none"}});
    let (code, v) = post(&s, "/v1/responses", &body).await;
    assert_eq!(code, 200, "{v}");
    let call =
        v["output"].as_array().unwrap().iter().find(|i| i["type"] == "function_call").unwrap_or_else(|| panic!("{v}"));
    assert_eq!(call["name"], "count");
    assert!(valid("count", &serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap()), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_choice_the_tools_cannot_meet_is_refused() {
    let s = start(None).await;
    let named = json!({"type": "function", "function": {"name": "write"}});
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"tool_choice": named}))).await;
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "tool_choice", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("write"), "{v}");
    let mut body = chat(json!({"tool_choice": "required"}));
    body.as_object_mut().unwrap().remove("tools");
    let (code, v) = post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(code, 400, "{v}");
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"tool_choice": "always"}))).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("always"), "{v}");
    // `none` hides the tools: a plain answer.
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"tool_choice": "none", "max_tokens": 8}))).await;
    assert_eq!(code, 200, "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
}

/// Qwen3.5's template writes calls in the XML form: the grammar spells that form, and the
/// answer parses back typed by the schema, with speculation on.
#[tokio::test(flavor = "multi_thread")]
async fn forced_calls_in_the_xml_form_with_speculation() {
    let template =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../third_party/chat-templates/Qwen3.5-4B.jinja");
    if !template.exists() {
        eprintln!("skipped: {} is not there (scripts/setup.sh --tests)", template.display());
        return;
    }
    let mut o = MakeOptions::new(Architecture::Qwen35, "tiny");
    o.mtp = true;
    o.dtype = checkpoint::Dtype::Float32;
    let place = |dir: &std::path::Path| {
        std::fs::copy(&template, dir.join("chat_template.jinja")).unwrap();
    };
    let s = start_prepared(&o, place, None, WorkerOptions::default(), common::speculate).await;
    assert_eq!(s.state.loaded().worker.info.call_syntax.form, server::tool_choice::CallForm::Xml);
    for (choice, temperature) in
        [(json!({"type": "function", "function": {"name": "count"}}), 0.0), (json!("required"), 0.8)]
    {
        // One call: a random model need not stop calling.
        let body =
            chat(json!({"tool_choice": choice, "temperature": temperature, "seed": 3, "parallel_tool_calls": false}));
        let (code, v) = post(&s, "/v1/chat/completions", &body).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(calls(&v).len(), 1, "{v}");
        assert_eq!(v["timings"]["draft_depth"], 2, "{v}");
    }
    // A text parameter is raw text up to `</parameter>` (a random model does not end it: the
    // call is cut at max_tokens, and its text so far is what was written).
    let note = json!([{"type": "function", "function": {"name": "note", "parameters": {"type": "object",
        "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]);
    let body = chat(json!({"tools": note, "tool_choice": "required", "max_tokens": 12}));
    let (code, v) = post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "note", "{v}");
}
