//! The batch's KV memory limit (the profile's `batch_memory_share`): a request whose prompt and
//! longest answer would not fit beside the running ones' (each row reserved as long as the
//! longest: the batch's caches are padded to it) waits, first in line and shown in
//! `/v1/status`, until one ends; one that fits joins at once. (A file of its own: the limit
//! is read from MLX's active memory, which other tests in one process would move.)

mod common;

use std::time::Duration;

use common::{chat, start, start_opts};
use futures_util::StreamExt;
use serde_json::{json, Value};
use server::worker::WorkerOptions;

async fn status(base: &str) -> Value {
    reqwest::get(format!("{base}/v1/status")).await.unwrap().json().await.unwrap()
}

/// Polls the status until `check` holds (or fails after a while, saying what it saw).
async fn wait_for(base: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..1000 {
        last = status(base).await;
        if check(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{what} never happened: {last}");
}

/// A streaming request; its response once the first chunk came.
async fn open(base: &str, token: &str, max_tokens: usize) -> reqwest::Response {
    let body = chat(json!({"max_tokens": max_tokens, "ignore_eos": true, "stream": true, "reasoning_effort": "none"}));
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .header(server::guard::TOKEN_HEADER, token)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_beyond_the_batch_memory_waits_for_room() {
    // What the model holds, and what a token of context takes, on a server of its own.
    let (held, per_token) = {
        let s = start(None).await;
        let st = status(&s.base).await;
        (st["mlx_active_memory_bytes"].as_u64().unwrap(), st["kv_bytes_per_token"].as_u64().unwrap())
    };
    // Room for 40,000 tokens of context beside the model: a batch may reserve half of it.
    let budget = held + 40_000 * per_token;
    let s = start_opts(WorkerOptions { memory_budget: Some(budget), ..Default::default() }).await;
    let token = s.state.guard.control_token().to_string();
    let st = status(&s.base).await;
    assert_eq!(st["batching"]["memory_share"], 0.5, "{st}");

    // 8,000 answer tokens reserved; the batch's rows are as long as its longest, so a request
    // for 3,000 joins it (2 rows of 8,000 and a prompt are within the 20,000-token share).
    let first = open(&s.base, &token, 8_000).await;
    let mut first = first.bytes_stream();
    first.next().await.unwrap().unwrap();
    let small = open(&s.base, &token, 3000).await;
    wait_for(&s.base, "two requests decoding together", |st| st["batching"]["decoding_together"] == 2).await;
    drop(small);
    wait_for(&s.base, "the small one leaving", |st| st["batching"]["decoding_together"] == 1).await;

    // One for 14,000 would pass the share (2 rows of 14,000): it waits, shown as waiting for
    // memory.
    let base = s.base.clone();
    let big = tokio::spawn(async move {
        let r = open(&base, &token, 14_000).await;
        let mut stream = r.bytes_stream();
        String::from_utf8_lossy(&stream.next().await.unwrap().unwrap()).to_string()
    });
    let st = wait_for(&s.base, "the big one waiting", |st| st["batching"]["waiting_for_memory"] == true).await;
    assert_eq!(st["batching"]["waiting"], 1, "{st}");
    assert_eq!(st["batching"]["decoding_together"], 1, "{st}");
    // The first one's client goes: the waiting one runs, its answer whole.
    drop(first);
    let started = tokio::time::timeout(Duration::from_secs(60), big).await.expect("the big one started").unwrap();
    assert!(started.contains("data: "), "{started}");
    let st = status(&s.base).await;
    assert_eq!(st["batching"]["waiting_for_memory"], false, "{st}");
}
