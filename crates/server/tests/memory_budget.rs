//! A request whose KV cache would not fit the memory left beside the model is refused (a 400
//! naming the memory) or its answer shortened (`x-ferrite-max-tokens-clamped-by: memory`),
//! before anything is allocated. Its own test process: it reads MLX's process-wide counters.

mod common;

use engine::checkpoint::{Architecture, MakeOptions};
use serde_json::{json, Value};
use server::worker::WorkerOptions;

fn tiny() -> MakeOptions {
    let mut o = MakeOptions::new(Architecture::Qwen3, "tiny");
    o.bits = Some(4);
    o.group_size = 32;
    o
}

/// A context far beyond the memory budget, so memory is what limits.
fn long_context(config: &mut Value) {
    config["max_position_embeddings"] = json!(1_000_000);
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_beyond_the_memory_left_are_refused_or_shortened() {
    // What the loaded model holds, and a token's KV cache, read from a first server.
    let first = common::start_edited(&tiny(), long_context, None, WorkerOptions::default(), |_| {}).await;
    let status: Value = reqwest::get(format!("{}/v1/status", first.base)).await.unwrap().json().await.unwrap();
    let (held, per_token) =
        (status["mlx_active_memory_bytes"].as_u64().unwrap(), status["kv_bytes_per_token"].as_u64().unwrap());
    assert!(per_token > 0, "{status}");
    drop(first);

    // The same model with room for about 4,000 tokens of KV cache beside it.
    let room = 4_000u64;
    let options = WorkerOptions { memory_budget: Some(held + room * per_token), ..Default::default() };
    let s = common::start_edited(&tiny(), long_context, None, options, |_| {}).await;

    // A prompt far beyond that room: refused before it is read into the cache.
    let long = "def f(x):\n    return x + 1\n".repeat(4_000);
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": long}], "max_tokens": 8});
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let error: Value = r.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("KV cache") && message.contains("--max-memory-gb"), "{message}");

    // A short prompt asking for far more than fits: shortened, and said so.
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500_000,
                      "stream": true});
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ferrite-max-tokens-clamped-by"], "memory");
    let granted: u64 = r.headers()["x-ferrite-max-tokens"].to_str().unwrap().parse().unwrap();
    // (Other allocations of this process move the room a little.)
    assert!((room / 2..room * 2).contains(&granted), "{granted} tokens granted for a room of about {room}");
    drop(r); // the client leaves: the generation is cancelled

    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["memory_budget_bytes"].as_u64(), Some(held + room * per_token));
}
