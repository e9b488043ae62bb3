//! Concurrent requests decode together (the worker's batch): each answers what it answers
//! alone, the status shows them decoding together, and clients that disconnect mid-stream
//! leave the others to finish and nothing behind.

mod common;

use std::time::Duration;

use common::{chat, post, start};
use futures_util::StreamExt;
use serde_json::{json, Value};

fn prompt(i: usize) -> Value {
    let texts = ["Write a function.", "Sort a list in Rust.", "Parse a TOML file.", "Explain a mutex."];
    chat(json!({"messages": [{"role": "user", "content": texts[i % texts.len()]}], "max_tokens": 24,
                "reasoning_effort": "none"}))
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_answer_as_they_do_alone() {
    let s = start(None).await;
    let mut alone = vec![];
    for i in 0..4 {
        let (code, v) = post(&s, "/v1/chat/completions", &prompt(i)).await;
        assert_eq!(code, 200, "{v}");
        alone.push(v["choices"][0]["message"]["content"].as_str().unwrap().to_string());
    }
    // Long answers alongside, so the batch is seen running.
    let base = s.base.clone();
    let long = tokio::spawn(async move {
        let body = chat(json!({"max_tokens": 600, "ignore_eos": true}));
        let client = reqwest::Client::new();
        let runs = (0..2).map(|_| client.post(format!("{base}/v1/chat/completions")).json(&body).send());
        futures_util::future::join_all(runs).await
    });
    let mut seen = 0;
    for _ in 0..500 {
        let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
        seen = seen.max(status["decoding_together"].as_u64().unwrap_or(0));
        if seen >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(seen >= 2, "two long requests never decoded together");
    let together = futures_util::future::join_all((0..4).map(|i| {
        let body = prompt(i);
        let s = &s;
        async move { post(s, "/v1/chat/completions", &body).await }
    }))
    .await;
    for (i, (code, v)) in together.into_iter().enumerate() {
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), alone[i], "request {i} in a batch");
    }
    for r in long.await.unwrap() {
        assert_eq!(r.unwrap().status(), 200);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn half_of_many_streaming_clients_disconnect_and_the_rest_finish() {
    let s = start(None).await;
    let clients = (0..32).map(|i| {
        let base = s.base.clone();
        async move {
            let body = chat(json!({"stream": true, "max_tokens": 40, "ignore_eos": true,
                                   "messages": [{"role": "user", "content": format!("Task {i}.")}]}));
            let r =
                reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let mut stream = r.bytes_stream();
            let mut text = String::new();
            while let Some(chunk) = stream.next().await {
                text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
                if i % 2 == 1 {
                    return None; // gone after the first chunk
                }
            }
            Some(text)
        }
    });
    let results = tokio::time::timeout(Duration::from_secs(120), futures_util::future::join_all(clients))
        .await
        .expect("the streams ended");
    for text in results.into_iter().flatten() {
        assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    // Nothing left running or queued; the server still answers.
    for _ in 0..200 {
        let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
        if status["queue_depth"] == 0 && status["decoding_together"] == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!((status["queue_depth"].as_u64(), status["decoding_together"].as_u64()), (Some(0), Some(0)), "{status}");
    let (code, _) = post(&s, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(code, 200);
}
