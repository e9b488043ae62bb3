//! Concurrent requests decode together (the worker's batch): each answers what it answers
//! alone, the status shows them decoding together, and clients that disconnect mid-stream
//! leave the others to finish and nothing behind.

mod common;

use std::time::Duration;

use common::{chat, post, start};
use engine::batch_rule::{BatchGain, BatchRule};
use futures_util::StreamExt;
use serde_json::{json, Value};
use server::worker::WorkerOptions;

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

/// The content of an OpenAI chat stream, and its last chunk with timings.
fn stream_content(sse: &str) -> (String, Value) {
    let mut content = String::new();
    let mut last = Value::Null;
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(data).unwrap();
        if let Some(t) = chunk["choices"][0]["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if chunk.get("timings").is_some_and(|t| !t.is_null()) {
            last = chunk;
        }
    }
    (content, last)
}

/// A request decoding alone with speculation hands itself to a batch when another comes
/// (between its cycles): both answer what they answer alone, the status sees them decoding
/// together, and the first one's timings keep its speculative figures.
#[tokio::test(flavor = "multi_thread")]
async fn a_speculating_request_takes_in_a_newcomer() {
    let s = common::start_hybrid(common::speculate).await;
    let long = chat(json!({"max_tokens": 1200, "ignore_eos": true, "reasoning_effort": "none", "stream": true}));
    let short = prompt(1);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", s.base);
    let alone_long = stream_content(&client.post(&url).json(&long).send().await.unwrap().text().await.unwrap()).0;
    let (code, v) = post(&s, "/v1/chat/completions", &short).await;
    assert_eq!(code, 200, "{v}");
    let alone_short = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let r = client.post(&url).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    let mut sse = String::from_utf8_lossy(&stream.next().await.unwrap().unwrap()).to_string();
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["decoding_together"], 0, "alone, it speculates: {status}");
    let newcomer = {
        let s_base = s.base.clone();
        let token = s.state.guard.control_token().to_string();
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{s_base}/v1/chat/completions"))
                .header(server::guard::TOKEN_HEADER, token)
                .json(&short)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        })
    };
    let (mut seen, mut streams) = (0, 0);
    for _ in 0..400 {
        let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
        seen = seen.max(status["batching"]["decoding_together"].as_u64().unwrap_or(0));
        // Each shows as a stream of its own.
        streams = streams.max(status["streams"].as_array().unwrap().len());
        if seen >= 2 && streams >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(seen >= 2, "the newcomer never decoded with the speculating request");
    assert_eq!(streams, 2, "the live figures never showed both streams");
    let v = newcomer.await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"].as_str(), Some(alone_short.as_str()), "{v}");
    while let Some(chunk) = stream.next().await {
        sse.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    let (content, last) = stream_content(&sse);
    assert_eq!(content, alone_long, "the speculating request, handed to the batch");
    assert_eq!(last["timings"]["draft_depth"], 2, "{last}");
}

/// A worker whose tuner measured that batching 2 (1.2x) or 4 (1.5x) requests gains less than
/// speculating (1.8x), holding the model for a speculating request up to `hold_s`.
fn out_gaining_speculation(hold_s: f64) -> WorkerOptions {
    let gains = vec![BatchGain { sequences: 2, gain: 1.2 }, BatchGain { sequences: 4, gain: 1.5 }];
    let profile = engine::Profile { speculation_hold_s: hold_s, ..Default::default() };
    // A fixed depth: the tuned speed-up is what the rule weighs, not the random head's.
    WorkerOptions { fixed_depth: true, batch_rule: BatchRule::new(gains, 1.8), profile, ..Default::default() }
}

/// A speculating request and a newcomer: the newcomer's answer alone first, then a long
/// streaming answer (its first chunk read) and the newcomer sent while it runs. Gives the
/// newcomer's answer alone, and when each ended (the newcomer with its answer).
struct Race {
    alone: String,
    long_done: tokio::task::JoinHandle<std::time::Instant>,
    newcomer: tokio::task::JoinHandle<(Value, std::time::Instant)>,
}

async fn race(s: &common::Server, long_tokens: usize, short: Value) -> Race {
    let (code, v) = post(s, "/v1/chat/completions", &short).await;
    assert_eq!(code, 200, "{v}");
    let alone = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let long = chat(json!({"max_tokens": long_tokens, "ignore_eos": true, "reasoning_effort": "none", "stream": true}));
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();
    let long_done = tokio::spawn(async move {
        while let Some(chunk) = stream.next().await {
            chunk.unwrap();
        }
        std::time::Instant::now()
    });
    let base = s.base.clone();
    let newcomer = tokio::spawn(async move {
        let r = reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&short).send().await;
        let v: Value = r.unwrap().json().await.unwrap();
        (v, std::time::Instant::now())
    });
    Race { alone, long_done, newcomer }
}

/// Where the tuner measured that two requests decoding together gain less than a speculating
/// request's speed-up, the newcomer waits its turn (in the queue, as the status shows) instead
/// of slowing the speculating one to plain decoding, and answers what it answers alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_newcomer_waits_where_speculation_out_gains_the_batch() {
    // A hold longer than the test: the rule alone decides.
    let s = common::start_hybrid_with(out_gaining_speculation(600.0), common::speculate).await;
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    let rule = &status["batching"]["speculation_or_batch"];
    assert_eq!(rule["measured"], true, "{rule}");
    assert_eq!(rule["batch_from"], Value::Null, "1.5x at 4 never reaches 1.8x: {rule}");

    let race = race(&s, 800, prompt(2)).await;
    let mut waited = false;
    for _ in 0..400 {
        let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
        assert_eq!(status["batching"]["decoding_together"], 0, "the newcomer was batched: {status}");
        // Queued, and the status says whom for.
        if status["batching"]["waiting"] == 1 && status["batching"]["waiting_for_speculation"] == true {
            waited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(waited, "the newcomer never showed as waiting for the speculating request");
    let (v, newcomer_done) = race.newcomer.await.unwrap();
    let long_done = race.long_done.await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"].as_str(), Some(race.alone.as_str()), "{v}");
    assert!(newcomer_done > long_done, "the newcomer answered before the speculating request ended");
}

/// The speculating request holds the model for the profile's hold at most: then the newcomer
/// joins it anyway (no agent waits a whole long answer) and answers what it answers alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_newcomer_joins_once_the_speculation_hold_runs_out() {
    let s = common::start_hybrid_with(out_gaining_speculation(0.3), common::speculate).await;
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["batching"]["speculation_or_batch"]["hold_s"], 0.3, "{status}");
    let race = race(&s, 1200, prompt(3)).await;
    let mut seen = 0;
    for _ in 0..2000 {
        let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
        seen = seen.max(status["batching"]["decoding_together"].as_u64().unwrap_or(0));
        if seen >= 2 || race.newcomer.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(seen >= 2, "the newcomer never decoded with the speculating request");
    let (v, newcomer_done) = race.newcomer.await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"].as_str(), Some(race.alone.as_str()), "{v}");
    assert!(newcomer_done < race.long_done.await.unwrap(), "the newcomer waited for the whole long answer");
}
