//! The OpenAI-compatible API over a real engine on loopback, driven by an HTTP client:
//! protocol details, every bad-input case, concurrency with disconnecting clients.

mod common;

use std::time::Duration;

use common::{chat, post, sse, start};
use futures_util::StreamExt;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn chat_completion_and_its_usage() {
    let s = start(None).await;
    let (status, v) = post(&s, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(!v["choices"][0]["message"]["content"].as_str().unwrap().is_empty());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["total_tokens"].as_u64().unwrap(), prompt + 12);
    // The alias names the same model; thinking off adds the empty think block to the prompt.
    let (status, v2) =
        post(&s, "/v1/chat/completions", &chat(json!({"model": "ferrite-tiny", "reasoning_effort": "none"}))).await;
    assert_eq!(status, 200);
    assert!(v2["usage"]["prompt_tokens"].as_u64().unwrap() > prompt);
    // Text completions too.
    let (status, v) =
        post(&s, "/v1/completions", &json!({"model": "tiny", "prompt": "fn main() {", "max_tokens": 5})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert!(v["choices"][0]["text"].is_string());
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_matches_the_whole_answer() {
    let s = start(None).await;
    let (_, whole) = post(&s, "/v1/chat/completions", &chat(json!({}))).await;
    let data = sse(&s, &chat(json!({"stream": true, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, whole["choices"][0]["message"]["content"].as_str().unwrap());
    let finish = chunks.iter().find(|c| c["choices"][0]["finish_reason"].is_string()).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_strings_and_speed_headers() {
    let s = start(None).await;
    let (_, whole) = post(&s, "/v1/chat/completions", &chat(json!({"max_tokens": 30}))).await;
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let stop: String = text.chars().skip(6).take(3).collect();
    let (_, v) = post(&s, "/v1/chat/completions", &chat(json!({"max_tokens": 30, "stop": [stop.clone()]}))).await;
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), &text[..text.find(&stop).unwrap()]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-ferrite-draft-depth"], "0");
    assert_eq!(r.headers()["x-ferrite-model"], "tiny");
}

#[tokio::test(flavor = "multi_thread")]
async fn logit_bias_is_served_and_checked() {
    let s = start(None).await;
    for (bias, word) in [
        (json!({"abc": 1}), "`abc` is not a token id"),
        (json!({"5": 300}), "[-100, 100]"),
        (json!({"99999999": 1}), "outside the vocabulary"),
        (json!({"5": "up"}), "logit_bias"),
    ] {
        let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"logit_bias": bias}))).await;
        assert_eq!(code, 400, "{bias} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(word), "{bias} -> {v}");
        if word != "logit_bias" {
            assert_eq!(v["error"]["param"], "logit_bias", "{v}");
        }
    }
    // Sampled at temperature 1 with two seeds, the answers differ; with a +100 bias on one
    // token both are that token over and over, on chat and text completions alike.
    let text = |v: &Value| {
        let c = &v["choices"][0];
        c["message"]["content"].as_str().or(c["text"].as_str()).unwrap_or_default().to_string()
    };
    for (path, base) in [
        ("/v1/chat/completions", chat(json!({}))),
        ("/v1/completions", json!({"model": "tiny", "prompt": "def add(a, b):"})),
    ] {
        let mut answers = Vec::new();
        for (seed, bias) in [(1, json!({})), (2, json!({})), (1, json!({"300": 100})), (2, json!({"300": 100}))] {
            let mut body = base.clone();
            let extra = json!({"temperature": 1.0, "seed": seed, "max_tokens": 8, "logit_bias": bias});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let (code, v) = post(&s, path, &body).await;
            assert_eq!(code, 200, "{path} {v}");
            answers.push(text(&v));
        }
        assert_ne!(answers[0], answers[1], "{path}: two seeds gave one answer, so this checks nothing");
        assert_eq!(answers[2], answers[3], "{path}: the bias did not decide the answer");
        assert_ne!(answers[2], answers[0], "{path}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_openai_errors() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    let raw = |body: &'static str| {
        client
            .post(format!("{}/v1/chat/completions", s.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let r = raw("{not json").await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("not valid JSON"), "{v}");

    let cases = [
        (chat(json!({"max_tokens": "many"})), 400, "max_tokens"),
        (chat(json!({"messages": []})), 400, "messages"),
        (chat(json!({"messages": [{"role": "wizard", "content": "x"}]})), 400, "messages"),
        (chat(json!({"max_tokens": 0})), 400, "max_tokens"),
        (chat(json!({"temperature": -1})), 400, "temperature"),
        (chat(json!({"stop": [""]})), 400, "stop"),
        // Asked for and not served: refused, never silently dropped.
        (chat(json!({"n": 2})), 400, "n"),
        (chat(json!({"logprobs": true})), 400, "logprobs"),
        (chat(json!({"top_logprobs": 3})), 400, "logprobs"),
        (chat(json!({"presence_penalty": 3})), 400, "presence_penalty"),
        (chat(json!({"frequency_penalty": -2.5})), 400, "frequency_penalty"),
        (chat(json!({"repetition_penalty": 0})), 400, "repetition_penalty"),
    ];
    for (body, status, word) in cases {
        let (got, v) = post(&s, "/v1/chat/completions", &body).await;
        assert_eq!(got, status, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(word), "{v}");
        assert!(v["error"]["type"].is_string());
        if status == 400 && word != "messages" && word != "stop" {
            assert_eq!(v["error"]["param"], word, "{v}");
        }
    }
    // n = 1, logprobs off and penalties within range are served; the penalties change the text
    // (this random model repeats itself).
    let text = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    let (code, plain) =
        post(&s, "/v1/chat/completions", &chat(json!({"max_tokens": 24, "n": 1, "logprobs": false}))).await;
    assert_eq!(code, 200, "{plain}");
    let penalised =
        chat(json!({"max_tokens": 24, "presence_penalty": 2, "frequency_penalty": 1, "repetition_penalty": 1.5}));
    let (code, v) = post(&s, "/v1/chat/completions", &penalised).await;
    assert_eq!(code, 200, "{v}");
    assert_ne!(text(&v), text(&plain), "penalties changed nothing");
    let (code, completion) =
        post(&s, "/v1/completions", &json!({"model": "tiny", "prompt": "a b a b", "max_tokens": 4, "logprobs": 2}))
            .await;
    assert_eq!((code, completion["error"]["param"].as_str()), (400, Some("logprobs")), "{completion}");
    let big = "x".repeat(server::MAX_BODY_BYTES + 10);
    let r = client
        .post(format!("{}/v1/chat/completions", s.base))
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
    let r = client.get(format!("{}/v2/nothing", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    // The server still answers.
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_clients_some_disconnecting() {
    let s = start(None).await;
    let mut tasks = Vec::new();
    for i in 0..6 {
        let base = s.base.clone();
        tasks.push(tokio::spawn(async move {
            let body = chat(json!({"stream": true, "max_tokens": 200}));
            let r =
                reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
            let mut stream = r.bytes_stream();
            if i % 2 == 0 {
                // Read one chunk and hang up.
                let _ = stream.next().await;
                return None;
            }
            let mut text = String::new();
            while let Some(chunk) = stream.next().await {
                text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            }
            Some(text)
        }));
    }
    let results = tokio::time::timeout(Duration::from_secs(120), futures_util::future::join_all(tasks))
        .await
        .expect("no client hangs");
    let finished: Vec<String> = results.into_iter().filter_map(|r| r.unwrap()).collect();
    assert_eq!(finished.len(), 3);
    for text in &finished {
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(text.contains("\"finish_reason\":\"length\"") || text.contains("\"finish_reason\":\"stop\""), "{text}");
    }
    // Nothing left queued, and the server keeps serving.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(s.state.loaded().worker.queue_depth.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn api_key_is_enforced_when_set() {
    let s = start(Some("sekrit")).await;
    let client = reqwest::Client::new();
    let r = client.get(format!("{}/v1/models", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = client.get(format!("{}/v1/models", s.base)).bearer_auth("sekrit").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][1]["id"], "ferrite-tiny");
    let r = client.get(format!("{}/v1/status", s.base)).header("x-api-key", "sekrit").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["context"], 40960);
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_errors_have_anthropic_shape() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/messages", s.base);
    let check = |v: &Value, kind: &str| {
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert!(v["error"]["message"].is_string());
    };
    let r = client.post(&url).header("content-type", "application/json").body("{oops").send().await.unwrap();
    assert_eq!(r.status(), 400);
    check(&r.json().await.unwrap(), "invalid_request_error");
    let r = client
        .post(&url)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "max_tokens is required");
    check(&r.json().await.unwrap(), "invalid_request_error");
    let r = client
        .post(&url)
        .json(&json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "wizard", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    check(&r.json().await.unwrap(), "invalid_request_error");
    let r = client
        .post(&url)
        .header("content-type", "application/json")
        .body("x".repeat(server::MAX_BODY_BYTES + 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    check(&r.json().await.unwrap(), "request_too_large");
    let r = client
        .post(&url)
        .json(&json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() <= 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_what_was_served() {
    let s = start(None).await;
    for _ in 0..2 {
        assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
    }
    let r = reqwest::get(format!("{}/metrics", s.base)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = r.text().await.unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
    };
    assert_eq!(value("ferrite_requests_total"), 2.0);
    assert_eq!(value("ferrite_completion_tokens_total"), 24.0);
    assert_eq!(value("ferrite_ttft_seconds_count"), 2.0);
    assert!(value("ferrite_decode_tokens_per_second") > 0.0);
    assert_eq!(value("ferrite_queue_depth"), 0.0);
    assert_eq!(value("ferrite_model_loaded"), 1.0);
    assert!(value("ferrite_mlx_memory_bytes{kind=\"active\"}") > 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn response_format_is_enforced_and_checked() {
    let s = start(None).await;
    // The grammar holds even a random model to the schema: a whole, valid document that ends
    // the answer, with the check beside it.
    let schema = json!({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": false
    });
    let format = json!({"type": "json_schema", "json_schema": {"name": "count", "schema": schema}});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&chat(json!({"response_format": format, "max_tokens": 40})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ferrite-response-format"], "valid");
    let v: Value = r.json().await.unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let doc: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
    assert!(doc["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)), "{doc}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["response_format_check"]["valid"], true, "{v}");
    // Streaming: the check arrives with the finishing chunk.
    let data = sse(&s, &chat(json!({"stream": true, "response_format": format, "max_tokens": 40}))).await;
    let finish: Value = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|c| c["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_eq!(finish["response_format_check"]["valid"], true, "{finish}");
    // An answer cut short by max_tokens is kept, and reported as not a whole document.
    let (code, v) =
        post(&s, "/v1/chat/completions", &chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 1})))
            .await;
    assert_eq!(code, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().starts_with('{'), "{v}");
    assert_eq!(v["response_format_check"]["valid"], false, "{v}");
    assert!(v["response_format_check"]["error"].as_str().unwrap().contains("not a JSON document"));
    // A schema that is not one, or an unknown type, is refused before generating.
    let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}});
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"response_format": bad}))).await;
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format.json_schema");
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"response_format": {"type": "yaml"}}))).await;
    assert_eq!(code, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("yaml"));
}

#[tokio::test(flavor = "multi_thread")]
async fn cors_only_for_the_apps_origin() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    let preflight = |origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, format!("{}/v1/chat/completions", s.base))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type,authorization")
            .send()
    };
    let app = preflight("tauri://localhost").await.unwrap();
    assert_eq!(app.headers()["access-control-allow-origin"], "tauri://localhost");
    let other = preflight("https://evil.example").await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
    let r = client.get(format!("{}/v1/status", s.base)).header("origin", "tauri://localhost").send().await.unwrap();
    assert_eq!(r.headers()["access-control-allow-origin"], "tauri://localhost");
}

#[tokio::test(flavor = "multi_thread")]
async fn profile_is_shown_in_status_and_headers() {
    let s = start(None).await;
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["profile"], "sustained");
    assert_eq!(status["profile_knobs"]["prefill_chunk"], 2048);
    assert_eq!(status["idle_action"], "unload");
    // What the CPU's matmuls run on, and the form the weights were loaded in.
    let (blas, weights) = (status["blas"].as_str().unwrap(), status["weights"].as_str().unwrap());
    assert!(blas.contains("BLAS") || blas == "Accelerate", "{blas}");
    if status["device"] == "cpu" {
        assert!(weights.starts_with("dequantized to f32 at load") || weights.starts_with("as stored"), "{weights}");
    }
    // The MLX it runs on; a dense model has no gated delta rule.
    assert_eq!(status["mlx_version"], engine::device::mlx_version());
    assert!(status["delta_rule"].is_null(), "{status}");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-ferrite-profile"], "sustained");
}

/// A hybrid's status names the path its gated delta rule runs on and why (on the CPU: the
/// operations, there being no kernel path there).
#[tokio::test(flavor = "multi_thread")]
async fn a_hybrids_status_names_its_delta_path() {
    let s = common::start_hybrid(|_| {}).await;
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    let path = status["delta_rule"]["path"].as_str().unwrap_or_default();
    assert!(["ops", "mlx-native", "cuda-kernel", "cuda-fused"].contains(&path), "{status}");
    assert!(!status["delta_rule"]["why"].as_str().unwrap_or_default().is_empty(), "{status}");
    if status["device"] == "cpu" {
        assert_eq!(path, "ops", "{status}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_action_stop_asks_the_server_to_stop() {
    let s = common::start_opts(server::worker::WorkerOptions {
        idle: Some(Duration::from_millis(300)),
        on_idle: server::worker::IdleAction::Stop,
        ..Default::default()
    })
    .await;
    let stop = s.state.loaded().worker.lifecycle.clone();
    tokio::time::timeout(Duration::from_secs(10), stop.stop_requested.notified())
        .await
        .expect("the watchdog asked for a stop");
    assert_eq!(stop.unloads.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ui_telemetry_and_live_events() {
    let s = start(None).await;
    let page = reqwest::get(format!("{}/", s.base)).await.unwrap();
    assert_eq!(page.headers()["content-type"], "text/html; charset=utf-8");
    assert!(page.text().await.unwrap().contains("<title>Ferrite</title>"));
    for script in ["/app.js", "/charts.js", "/vendor/uplot/uPlot.iife.min.js"] {
        let r = reqwest::get(format!("{}{script}", s.base)).await.unwrap();
        assert_eq!(r.status(), 200, "{script}");
        assert_eq!(r.headers()["content-type"], "text/javascript; charset=utf-8", "{script}");
    }
    assert_eq!(reqwest::get(format!("{}/vendor/uplot/uPlot.min.css", s.base)).await.unwrap().status(), 200);
    let t: Value = reqwest::get(format!("{}/v1/telemetry", s.base)).await.unwrap().json().await.unwrap();
    assert!(t["memory"]["system_total_bytes"].as_u64().unwrap() > 0, "{t}");
    assert!(t["thermal"]["fans"].is_array());

    // A long generation (cancelled at the end) streams while the event stream is read: its
    // tok/s must show up there.
    let body = chat(json!({"max_tokens": 20000, "ignore_eos": true, "stream": true}));
    let url = format!("{}/v1/chat/completions", s.base);
    let generation = tokio::spawn(async move {
        reqwest::Client::new().post(url).json(&body).send().await.unwrap().text().await.unwrap()
    });
    let started = async {
        while !s.state.loaded().worker.metrics.generating.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), started).await.expect("the generation started");
    let events = reqwest::get(format!("{}/v1/events", s.base)).await.unwrap();
    assert_eq!(events.headers()["content-type"], "text/event-stream");
    let mut stream = events.bytes_stream();
    let mut buffer = String::new();
    let mut seen = None;
    let mut history = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while seen.is_none() && tokio::time::Instant::now() < deadline {
        let Ok(Some(Ok(chunk))) = tokio::time::timeout(Duration::from_secs(5), stream.next()).await else { break };
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        for event in buffer.split("\n\n").filter(|e| e.contains("data: ")) {
            let kind = event.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or("");
            let line = event.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            let Ok(u) = serde_json::from_str::<Value>(line) else { continue }; // cut mid-event
                                                                               // First the history the server kept (a sample a second, at most 15 minutes).
            if kind == "history" {
                assert!(seen.is_none() && history.is_none(), "the history comes first, once");
                history = Some(u);
                continue;
            }
            assert!(history.is_some(), "an update came before the history");
            assert_eq!(u["model"], "tiny");
            assert!(u["telemetry"]["memory"]["system_total_bytes"].as_u64().unwrap() > 0);
            if u["generating"] == true && u["tokens_per_s_now"].as_f64().unwrap() > 0.0 {
                seen = Some(u);
            }
        }
        buffer = buffer.rsplit_once("\n\n").map(|(_, rest)| rest.to_string()).unwrap_or(buffer);
    }
    let seen = seen.expect("an event showed the running generation's tok/s");
    assert_eq!(seen["profile"], "sustained");
    assert!(seen["sample"]["t_ms"].as_u64().unwrap() > 0, "each update carries the latest sample: {}", seen["sample"]);
    let history = history.unwrap();
    let samples = history["samples"].as_array().unwrap();
    assert!(samples.len() <= history["keep"].as_u64().unwrap() as usize);
    let times: Vec<u64> = samples.iter().map(|s| s["t_ms"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
    generation.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_click_starts_another_model() {
    // Without a resolver the server serves its one model and says so.
    let single = start(None).await;
    let (code, v) = post(&single, "/v1/models/load", &json!({"model": "other"})).await;
    assert_eq!(code, 409, "{v}");

    let second = tempfile::tempdir().unwrap();
    let mut o = engine::checkpoint::MakeOptions::new(engine::checkpoint::Architecture::Qwen35, "tiny");
    o.mtp = true;
    engine::checkpoint::make(&o, second.path()).unwrap();
    let dir = second.path().to_path_buf();
    let resolver: server::Resolver = std::sync::Arc::new(move |name: &str, _profile: engine::ProfileName| {
        anyhow::ensure!(name == "hybrid", "`{name}` is not a model here");
        Ok(server::ModelSpec {
            dir: dir.clone(),
            id: "hybrid".into(),
            aliases: vec!["h".into()],
            depth: server::depth_plan::DepthPlan::mtp(2, "test"),
            batch_rule: Default::default(),
            drafter: None,
        })
    });
    // The embedding program is told of each model started, with the name it was asked for;
    // its notice (the app's "could not start …") stays until another model starts.
    let told: std::sync::Arc<std::sync::Mutex<Vec<(String, String, String)>>> = Default::default();
    let on_load: server::OnLoad = {
        let told = told.clone();
        std::sync::Arc::new(move |name: &str, spec: &server::ModelSpec, profile: engine::ProfileName| {
            told.lock().unwrap().push((name.to_string(), spec.id.clone(), profile.to_string()));
        })
    };
    let s = common::start_configured(None, Default::default(), move |state| {
        state.resolver = Some(resolver);
        state.on_load = Some(on_load);
        state.set_notice(Some("could not start `gone`".into()));
    })
    .await;
    let (code, v) = post(&s, "/v1/models/load", &json!({"model": "nope"})).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("`nope` is not a model here"), "{v}");
    assert_eq!(v["error"]["param"], "model");
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["notice"], "could not start `gone`", "a failed load keeps the notice");
    assert!(told.lock().unwrap().is_empty(), "a failed load is not told");
    let (code, v) = post(&s, "/v1/models/load", &json!({"model": "hybrid"})).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["model"], "hybrid");
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["model"], "hybrid");
    assert_eq!(status["notice"], Value::Null);
    assert_eq!(
        told.lock().unwrap().as_slice(),
        [("hybrid".to_string(), "hybrid".to_string(), "sustained".to_string())]
    );
    assert_eq!(status["draft_depth"], 2);
    assert_eq!(status["mtp_head"], true);
    // The old names are gone (answered by the new model, which the response names), the new
    // ones answer (with speculation, as configured).
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!((code, v["model"].as_str()), (200, Some("hybrid")), "{v}");
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"model": "h"}))).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["timings"]["draft_depth"], 2);
    // Penalties keep speculation (drafts and verification are penalised alike).
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"model": "h", "presence_penalty": 0.5}))).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["timings"]["draft_depth"], 2, "{v}");

    // The same model with the other profile: status, knobs and headers all say so.
    let (code, v) = post(&s, "/v1/models/load", &json!({"profile": "turbo"})).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["profile"], "turbo");
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!((status["model"].as_str(), status["profile"].as_str()), (Some("hybrid"), Some("turbo")));
    assert_eq!(status["profile_knobs"]["prefill_chunk"], 8192);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&chat(json!({"model": "h"})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-ferrite-profile"], "turbo");
    assert_eq!(told.lock().unwrap().last().unwrap().2, "turbo");
    let (code, v) = post(&s, "/v1/models/load", &json!({"profile": "fast"})).await;
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "profile");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lark_grammar_or_regex_holds_the_answer() {
    let s = start(None).await;
    // Ferrite's extension, in the shape OpenAI gives a custom tool's grammar.
    let regex = json!({"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[a-z]{2}"});
    let lark = json!({"type": "grammar", "syntax": "lark", "definition": "start: \"yes\" | \"no\""});
    for (format, holds) in [
        (
            regex,
            (|t: &str| {
                let (digits, letters) = t.split_once('-').unwrap_or_default();
                digits.len() == 3
                    && digits.bytes().all(|b| b.is_ascii_digit())
                    && letters.len() == 2
                    && letters.bytes().all(|b| b.is_ascii_lowercase())
            }) as fn(&str) -> bool,
        ),
        (lark, |t: &str| t == "yes" || t == "no"),
    ] {
        let body = chat(json!({"response_format": format, "max_tokens": 20, "reasoning_effort": "none"}));
        let (code, v) = post(&s, "/v1/chat/completions", &body).await;
        assert_eq!(code, 200, "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(holds(content), "{format}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        // The Responses API takes the same format as `text.format`.
        let body = json!({"model": "tiny", "input": "Answer.", "max_output_tokens": 20, "reasoning": {"effort": "none"},
                          "text": {"format": format}});
        let (code, v) = post(&s, "/v1/responses", &body).await;
        assert_eq!(code, 200, "{v}");
        assert!(holds(v["output"][0]["content"][0]["text"].as_str().unwrap()), "{format}: {v}");
    }
    // What is missing or cannot be built is a 400 that says what.
    let cases = [
        (json!({"type": "grammar", "syntax": "ebnf", "definition": "x"}), "response_format.syntax"),
        (json!({"type": "grammar", "syntax": "lark"}), "response_format.definition"),
        (json!({"type": "grammar", "syntax": "lark", "definition": "start: undefined_rule"}), "grammar"),
        // A valid JSON Schema with a feature the grammar engine does not take: where it is.
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                "properties": {"a": {"if": {"type": "string"}, "then": {"minLength": 2}}}}}}),
            "`/properties/a`",
        ),
    ];
    for (format, says) in cases {
        let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"response_format": format}))).await;
        assert_eq!(code, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{says}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ids_never_repeat_across_restarts() {
    // Two servers stand for one before and one after a restart: an agent's history holds the
    // ids of both, so none may be handed out twice (Claude Code takes a repeated `msg_` or
    // `toolu_` id for an interrupted tool call and runs it again).
    let mut seen = std::collections::HashSet::new();
    for _ in 0..2 {
        let s = common::start(None).await;
        for _ in 0..2 {
            let (_, v) = common::post(&s, "/v1/chat/completions", &common::chat(json!({}))).await;
            assert!(seen.insert(v["id"].as_str().unwrap().to_string()), "{v}");
            let anthropic = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
            let (_, v) = common::post(&s, "/v1/messages", &anthropic).await;
            assert!(seen.insert(v["id"].as_str().unwrap().to_string()), "{v}");
            let (_, v) =
                common::post(&s, "/v1/responses", &json!({"model": "tiny", "input": "hi", "max_output_tokens": 4}))
                    .await;
            assert!(seen.insert(v["id"].as_str().unwrap().to_string()), "{v}");
        }
    }
    assert_eq!(seen.len(), 12);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_context_overflow_is_said_in_each_protocols_own_words() {
    // Clients compact a conversation only when they recognise the overflow: Claude Code by
    // Anthropic's wording, OpenAI clients (Codex) by `context_length_exceeded`.
    let s = common::start(None).await;
    let (_, models) = {
        let r = reqwest::get(format!("{}/v1/models", s.base)).await.unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    };
    let context = models["data"][0]["context_length"].as_u64().unwrap();
    assert!(context > 0 && models["data"][0]["max_model_len"] == context, "{models}");
    assert_eq!(models["data"][0]["input_modalities"], json!(["text"]), "a model that reads text only");
    for huge in ["fn main() {} ".repeat(300_000), "fn f() {} ".repeat(context as usize)] {
        let (status, v) = common::post(
            &s,
            "/v1/chat/completions",
            &common::chat(json!({"messages": [{"role": "user", "content": huge}]})),
        )
        .await;
        assert_eq!((status, v["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{v}");
        let (status, v) =
            common::post(&s, "/v1/responses", &json!({"model": "tiny", "input": huge, "max_output_tokens": 4})).await;
        assert_eq!((status, v["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{v}");
        let anthropic = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": huge}]});
        let (status, v) = common::post(&s, "/v1/messages", &anthropic).await;
        assert_eq!(status, 400, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        let (tokens, maximum) = message
            .strip_prefix("prompt is too long: ")
            .and_then(|m| m.strip_suffix(" maximum"))
            .and_then(|m| m.split_once(" tokens > "))
            .unwrap_or_else(|| panic!("not Anthropic's wording: {message}"));
        assert!(tokens.parse::<u64>().unwrap() >= context && maximum.parse::<u64>().unwrap() == context, "{message}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_inside_a_tool_result_is_refused_by_its_path_not_dropped() {
    // Claude Code's Read of a PNG answers with an image inside the tool_result: answering as
    // if the tool had returned nothing would mislead the model.
    let s = common::start(None).await;
    let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}});
    let body = json!({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Read the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "Read", "input": {"file_path": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": [
            {"type": "text", "text": "a.png"}, image.clone()
        ]}]}
    ]});
    let (status, v) = common::post(&s, "/v1/messages", &body).await;
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("messages.2.content.0.content.1: `image`"), "{message}");
    // Text and tool references (ToolSearch) in a tool result still reach the model.
    let grep = json!({"name": "Grep", "input_schema": {"type": "object"}, "defer_loading": true});
    let body = json!({"model": "tiny", "max_tokens": 4, "tools": [grep], "messages": [
        {"role": "user", "content": "Find a tool."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_b", "name": "ToolSearch", "input": {"query": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_b", "content": [
            {"type": "text", "text": "found"}, {"type": "tool_reference", "tool_name": "Grep"}
        ]}]}
    ]});
    assert_eq!(common::post(&s, "/v1/messages", &body).await.0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_echoes_parallel_tool_calls_and_says_it_is_not_stored() {
    let s = common::start(None).await;
    for parallel in [false, true] {
        let body = json!({"model": "tiny", "input": "hi", "max_output_tokens": 4, "store": true, "parallel_tool_calls": parallel});
        let (status, v) = common::post(&s, "/v1/responses", &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["parallel_tool_calls"], parallel, "{v}");
        assert_eq!(v["store"], false, "Ferrite keeps no responses: {v}");
    }
}

/// A DFlash drafter served beside a dense model (`ferrite serve --drafter`): status names it,
/// and a request whose plan says block drafting drafts with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_block_drafter_is_served_and_shown() {
    use engine::checkpoint::drafter::{make_drafter, DrafterOptions};
    let mut o = engine::checkpoint::MakeOptions::new(engine::checkpoint::Architecture::Qwen3, "tiny");
    o.dtype = engine::checkpoint::Dtype::Float32;
    // The drafter is made for a twin of the served checkpoint (the maker is deterministic).
    let twin = tempfile::tempdir().unwrap();
    engine::checkpoint::make(&o, twin.path()).unwrap();
    let config = engine::ModelConfig::load(twin.path()).unwrap();
    let drafter = tempfile::tempdir().unwrap();
    make_drafter(&config, &DrafterOptions::new(&config, o.clone()), drafter.path()).unwrap();
    let options = server::worker::WorkerOptions { drafter: Some(drafter.path().to_path_buf()), ..Default::default() };
    let s = common::start_checkpoint(&o, None, options, |state| {
        let worker = state.loaded().worker.clone();
        let depth = server::depth_plan::DepthPlan::fixed(engine::Speculation::block(3), "test");
        *state = server::AppState::serving(server::Loaded { worker, aliases: vec![], depth }, None);
    })
    .await;
    let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(status["drafter"]["block_size"], 8, "{status}");
    assert_eq!(status["drafter"]["dir"], json!(drafter.path()), "{status}");
    assert_eq!((status["mtp_head"].clone(), status["draft_with"].clone()), (json!(false), json!("block")));
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({"max_tokens": 12}))).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["timings"]["draft_depth"], 3, "{v}");
    assert!(v["timings"]["tokens_per_cycle"].as_f64().unwrap() >= 1.0, "{v}");
}
