//! What real agent clients send that plain SDK calls do not: their own model names, max_tokens
//! far beyond a local model's context, Anthropic system-role messages among the turns,
//! adaptive thinking, output_config, context_management, metadata and cache_control.

mod common;

use common::{chat, post, start_configured, start_edited};
use engine::checkpoint::{Architecture, MakeOptions};
use serde_json::{json, Value};
use server::worker::WorkerOptions;

#[tokio::test(flavor = "multi_thread")]
async fn any_model_name_is_answered_by_the_loaded_model_unless_strict() {
    let s = start_configured(None, WorkerOptions::default(), |_| {}).await;
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"model": "gpt-5.5-codex"}))).await;
    assert_eq!((code, v["model"].as_str()), (200, Some("tiny")), "{v}");
    let body = json!({"model": "claude-opus-5-5", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (code, v) = post(&s, "/v1/messages", &body).await;
    assert_eq!((code, v["model"].as_str()), (200, Some("tiny")), "{v}");
    // /v1/models still lists the truth.
    let models: Value = reqwest::get(format!("{}/v1/models", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");

    let strict = start_configured(None, WorkerOptions::default(), |state| state.strict_model_names = true).await;
    let (code, v) = post(&strict, "/v1/chat/completions", &chat(json!({"model": "gpt-5.5-codex"}))).await;
    assert_eq!((code, v["error"]["param"].as_str()), (404, Some("model")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("gpt-5.5-codex"), "{v}");
    let (code, _) = post(&strict, "/v1/chat/completions", &chat(json!({"model": "ferrite-tiny"}))).await;
    assert_eq!(code, 200, "an alias is the loaded model's name");
}

#[tokio::test(flavor = "multi_thread")]
async fn max_tokens_beyond_the_context_is_clamped_and_a_prompt_that_does_not_fit_is_refused() {
    // A 64-token context, so that both limits are reached in a few tokens.
    let o = MakeOptions::new(Architecture::Qwen3, "tiny");
    let s =
        start_edited(&o, |c| c["max_position_embeddings"] = json!(64), None, WorkerOptions::default(), |_| {}).await;
    let body = json!({"model": "tiny", "prompt": "a b", "max_tokens": 128_000, "ignore_eos": true});
    let r = reqwest::Client::new().post(format!("{}/v1/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (room, asked) =
        (r.headers()["x-ferrite-max-tokens"].clone(), r.headers()["x-ferrite-max-tokens-clamped-from"].clone());
    assert_eq!(asked, "128000");
    let v: Value = r.json().await.unwrap();
    let (prompt, completion) =
        (v["usage"]["prompt_tokens"].as_u64().unwrap(), v["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(room.to_str().unwrap().parse::<u64>().unwrap(), 64 - prompt, "{v}");
    assert_eq!(completion, 64 - prompt, "ignore_eos: it writes all the room there is: {v}");
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["max_tokens_clamped"], 1, "{status}");

    // A prompt beyond the context: 400, naming both numbers.
    let long = "a b c d e f g h ".repeat(20);
    let (code, v) = post(&s, "/v1/completions", &json!({"model": "tiny", "prompt": long, "max_tokens": 1})).await;
    assert_eq!(code, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("context is 64 tokens") && message.contains("the prompt is"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_servers_output_cap_clamps_every_request() {
    let options = WorkerOptions { max_output_tokens: Some(3), ..Default::default() };
    let s = start_configured(None, options, |_| {}).await;
    let body = json!({"model": "tiny", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]});
    let r = reqwest::Client::new().post(format!("{}/v1/messages", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ferrite-max-tokens"], "3");
    assert_eq!(r.headers()["x-ferrite-max-tokens-clamped-from"], "32000");
    let v: Value = r.json().await.unwrap();
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() <= 3, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn claude_codes_request_shape_is_accepted() {
    let s = start_configured(None, WorkerOptions::default(), |_| {}).await;
    // The fields Claude Code 2.1 sends on its first turn, in miniature.
    let body = json!({
        "model": "claude-opus-5-5",
        "max_tokens": 6,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Easy.", "signature": "x"}, {"type": "text", "text": "Sure."}]},
            {"role": "user", "content": "Go on."}
        ],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc"},
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
        "stream": true
    });
    let r = reqwest::Client::new().post(format!("{}/v1/messages", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let text = r.text().await.unwrap();
    assert!(text.contains("message_stop"), "{text}");
    // The system-role message is rendered as a system turn, in its place.
    let count = json!({"model": "x", "messages": body["messages"], "system": body["system"]});
    let (code, with) = post(&s, "/v1/messages/count_tokens", &count).await;
    assert_eq!(code, 200, "{with}");
    let mut without = count.clone();
    without["messages"].as_array_mut().unwrap().remove(1);
    let (_, fewer) = post(&s, "/v1/messages/count_tokens", &without).await;
    assert!(with["input_tokens"].as_u64() > fewer["input_tokens"].as_u64(), "{with} {fewer}");

    // Thinking that is neither on nor off by name, and content the model cannot see, are
    // refused naming the field.
    let mut bad = body.clone();
    bad["thinking"] = json!({"type": "sometimes"});
    let (code, v) = post(&s, "/v1/messages", &bad).await;
    assert_eq!((code, v["error"]["message"].as_str().map(|m| m.contains("thinking.type"))), (400, Some(true)), "{v}");
    let mut image = body.clone();
    image["messages"][0]["content"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}));
    let (code, v) = post(&s, "/v1/messages", &image).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("messages.0.content.1: `image` blocks"), "{v}");
}
