//! Many streaming clients, half of which go mid-stream, leave nothing behind: once they are
//! done MLX's active memory is back to its idle value (the prompt cache is off, so nothing is
//! kept on purpose). A file of its own: MLX's counters are the process's, which other tests
//! would move.

mod common;

use std::time::Duration;

use common::{chat, start};
use futures_util::StreamExt;
use serde_json::{json, Value};

async fn status(base: &str) -> Value {
    reqwest::get(format!("{base}/v1/status")).await.unwrap().json().await.unwrap()
}

/// 32 clients at once, the odd ones gone after their first chunk.
async fn clients(base: &str) {
    let clients = (0..32).map(|i| {
        let base = base.to_string();
        async move {
            let body = chat(json!({"stream": true, "max_tokens": 48, "ignore_eos": true,
                                   "messages": [{"role": "user", "content": format!("Task {i}: {}", "x ".repeat(i * 7))}]}));
            let r =
                reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let mut stream = r.bytes_stream();
            while let Some(chunk) = stream.next().await {
                chunk.unwrap();
                if i % 2 == 1 {
                    return;
                }
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(120), futures_util::future::join_all(clients))
        .await
        .expect("the streams ended");
}

/// MLX's active memory once nothing runs or waits.
async fn idle_memory(base: &str) -> u64 {
    for _ in 0..400 {
        let s = status(base).await;
        if s["queue_depth"] == 0 && s["batching"]["decoding_together"] == 0 && s["streams"] == json!([]) {
            return s["mlx_active_memory_bytes"].as_u64().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("still busy: {}", status(base).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_go_mid_stream_leave_no_memory_behind() {
    std::env::set_var("FERRITE_PROMPT_CACHE_MB", "0");
    let s = start(None).await;
    // One round first: whatever the first requests set up once is in the idle value.
    clients(&s.base).await;
    let idle = idle_memory(&s.base).await;
    for _ in 0..2 {
        clients(&s.base).await;
        let after = idle_memory(&s.base).await;
        assert_eq!(after, idle, "MLX holds {after} bytes after the clients, {idle} before");
    }
}
