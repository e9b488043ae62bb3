//! The runtime depth controller through the server: on by default, a speculating request
//! whose drafts fail (a random MTP head) goes to plain decoding; `/v1/status` shows its state
//! and `/metrics` counts its changes; the answer is plain decoding's. With `fixed_depth` the
//! depth stays as asked.

mod common;

use common::{chat, post};
use engine::checkpoint::{self, Architecture, MakeOptions};
use serde_json::{json, Value};
use server::worker::WorkerOptions;

fn hybrid() -> MakeOptions {
    let mut o = MakeOptions::new(Architecture::Qwen35, "tiny");
    o.mtp = true;
    o.dtype = checkpoint::Dtype::Float32;
    o
}

async fn answer(s: &common::Server) -> (String, Value) {
    let body = chat(json!({"max_tokens": 80, "ignore_eos": true, "reasoning_effort": "none"}));
    let (code, v) = post(s, "/v1/chat/completions", &body).await;
    assert_eq!(code, 200, "{v}");
    (v["choices"][0]["message"]["content"].as_str().unwrap().to_string(), v)
}

#[tokio::test(flavor = "multi_thread")]
async fn failing_drafts_go_plain_and_the_server_shows_it() {
    let plain = common::start_checkpoint(&hybrid(), None, WorkerOptions::default(), |_| {}).await;
    let (expected, _) = answer(&plain).await;

    let s = common::start_checkpoint(&hybrid(), None, WorkerOptions::default(), common::speculate).await;
    let (text, v) = answer(&s).await;
    assert_eq!(text, expected, "the controller changes how much is drafted, never the answer");
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    let control = &status["depth_control"];
    assert_eq!(control["depth_now"], 0, "{status}");
    assert!(control["changes"]["to_plain"].as_u64().unwrap() >= 1, "{status}");
    assert!(control["expected_speedup"].as_f64().is_some() && control["measured_speedup"].as_f64().is_some());
    let metrics = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
    let to_plain = metrics
        .lines()
        .find(|l| l.starts_with("ferrite_draft_depth_changes_total{change=\"to_plain\"}"))
        .unwrap_or_else(|| panic!("no to_plain counter in\n{metrics}"));
    assert!(!to_plain.ends_with(" 0"), "{to_plain}");
    assert!(metrics.contains("ferrite_draft_depth 0"), "{metrics}");
    // The timings say so too.
    assert_eq!(v["timings"]["depth_control"]["depth_now"], 0, "{v}");

    let fixed = WorkerOptions { fixed_depth: true, ..Default::default() };
    let s = common::start_checkpoint(&hybrid(), None, fixed, common::speculate).await;
    let (text, _) = answer(&s).await;
    assert_eq!(text, expected);
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert!(status["depth_control"].is_null(), "fixed depth: no controller: {status}");
}
