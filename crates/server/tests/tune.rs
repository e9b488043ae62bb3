//! The app's Tune button over HTTP: progress while it measures, the table and verdict at the
//! end, the stored depth used at once; cancel stores nothing; bad requests named.

mod common;

use std::time::Duration;

use common::{post, start_hybrid, Server};
use serde_json::{json, Value};

async fn get(s: &Server, path: &str) -> Value {
    reqwest::get(format!("{}{path}", s.base)).await.unwrap().json().await.unwrap()
}

/// Polls `/v1/tune` until the run ends; returns every state seen.
async fn wait_for_end(s: &Server) -> Vec<Value> {
    let mut seen = Vec::new();
    for _ in 0..1200 {
        let t = get(s, "/v1/tune").await;
        let running = t["running"] == true;
        seen.push(t);
        if !running {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the tune did not end: {:?}", seen.last());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tune_reports_progress_stores_and_takes_effect() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().to_path_buf();
    let s = start_hybrid(move |state| state.store.config_dir = Some(dir)).await;
    assert_eq!(get(&s, "/v1/tune").await["running"], false);

    // Small, so the rounds are quick; random weights accept no drafts, so plain decoding wins
    // clearly and a verdict comes well within the budget.
    let body = json!({"tokens": 6, "rounds": 2, "prompts": 1, "budget_s": 30, "busy_percent": 100000});
    let (code, started) = post(&s, "/v1/tune", &body).await;
    assert_eq!(code, 202, "{started}");
    let (again, busy) = post(&s, "/v1/tune", &body).await;
    assert!(again == 409 || again == 202, "{busy}");

    let seen = wait_for_end(&s).await;
    assert!(
        seen.iter().any(|t| t["progress"]["steps"].as_u64() == Some(10) && t["progress"]["budget_s"] == 30.0),
        "5 depths x 2 temperatures warmed up, then rounds within a 30 s budget: {:?}",
        seen.last()
    );
    let done = seen.last().unwrap();
    assert!(done["error"].is_null(), "{done}");
    assert_eq!(done["candidates"].as_array().unwrap().len(), 10, "{done}");
    // Each depth measured as it is: the server's depth controller stays out of a tune's runs.
    for c in done["candidates"].as_array().unwrap() {
        assert_eq!(c["acceptance"].as_array().unwrap().len() as u64, c["depth"].as_u64().unwrap(), "{c}");
        assert_eq!(c["drafter"], "mtp", "no block drafter beside this model: {c}");
    }
    // Each depth's speed-up with its interval, the verdict's too.
    let speedups = done["speedups"].as_array().unwrap();
    assert_eq!(speedups.len(), 4, "{done}");
    assert!(speedups.iter().all(|s| s["interval"][0].as_f64() <= s["speedup"].as_f64()), "{done}");
    assert!(done["rounds"].as_u64().unwrap() >= 2, "{done}");
    assert_eq!(done["verdict"]["verdict"], "store", "{done}");
    let depth = done["verdict"]["depth"].as_u64().unwrap();

    // Stored in the tuning file and used by the served model now.
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(config.path().join("tuning.json")).unwrap()).unwrap();
    assert!(file.to_string().contains(&format!("\"depth\":{depth}")), "{file}");
    let status = get(&s, "/v1/status").await;
    assert_eq!(status["draft_depth"].as_u64(), Some(depth));
    assert_eq!(status["draft_with"], done["verdict"]["drafter"], "{status}");
    assert!(status["draft_depth_source"].as_str().unwrap().starts_with("tuned just now"), "{status}");
}

/// A server with its own config folder, a tune of minutes started on it a moment ago.
async fn a_long_tune_running() -> (tempfile::TempDir, Server) {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().to_path_buf();
    let s = start_hybrid(move |state| state.store.config_dir = Some(dir)).await;
    let (code, _) = post(&s, "/v1/tune", &json!({"tokens": 64, "reps": 20})).await;
    assert_eq!(code, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    (config, s)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_tune_stores_nothing() {
    let (config, s) = a_long_tune_running().await;
    let (code, v) = post(&s, "/v1/tune/cancel", &json!({})).await;
    assert_eq!((code, &v["cancelled"]), (200, &json!(true)), "{v}");
    let done = wait_for_end(&s).await.pop().unwrap();
    assert!(done["error"].as_str().unwrap().contains("cancelled"), "{done}");
    assert!(done["verdict"].is_null());
    assert!(!config.path().join("tuning.json").exists(), "nothing stored");
    assert_eq!(get(&s, "/v1/status").await["draft_depth"], 0);
    // Nothing to cancel now; bad fields are named.
    assert_eq!(post(&s, "/v1/tune/cancel", &json!({})).await.1["cancelled"], false);
    let (code, v) = post(&s, "/v1/tune", &json!({"repetitions": 3})).await;
    assert_eq!(code, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("repetitions"), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopping_server_stops_its_tune() {
    let (config, s) = a_long_tune_running().await;
    // The engine thread must end soon (a tune of minutes must not keep MLX busy while the
    // process exits).
    let worker = s.state.loaded().worker.clone();
    let started = std::time::Instant::now();
    tokio::task::spawn_blocking(move || worker.shutdown(Duration::from_secs(30))).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(10), "shutdown took {:?}", started.elapsed());
    let done = wait_for_end(&s).await.pop().unwrap();
    assert!(done["error"].as_str().unwrap().contains("cancelled"), "{done}");
    assert!(!config.path().join("tuning.json").exists());
}

/// A tune for one workload class measures that class's suite at its temperature only, stores
/// the depth under the class and the server uses it for requests of that class (the model's
/// own depth stays for the others); an unknown class is refused, named.
#[tokio::test(flavor = "multi_thread")]
async fn a_class_tune_stores_a_depth_for_that_class_only() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().to_path_buf();
    let s = start_hybrid(move |state| state.store.config_dir = Some(dir)).await;
    let (code, v) = post(&s, "/v1/tune", &json!({"class": "poetry/greedy"})).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("poetry/greedy"), "{v}");
    assert_eq!(v["error"]["param"], "class", "{v}");

    let body = json!({"class": "prose/sampled", "tokens": 6, "rounds": 2, "prompts": 1, "budget_s": 30, "busy_percent": 100000});
    let (code, started) = post(&s, "/v1/tune", &body).await;
    assert_eq!(code, 202, "{started}");
    let done = wait_for_end(&s).await.pop().unwrap();
    assert!(done["error"].is_null(), "{done}");
    assert_eq!(done["class"], "prose/sampled", "{done}");
    let candidates = done["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 5, "one temperature: {done}");
    assert!(candidates.iter().all(|c| c["temperature"] == 0.7), "{done}");
    assert_eq!(done["verdict"]["verdict"], "store", "{done}");
    let depth = done["verdict"]["depth"].as_u64().unwrap();

    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(config.path().join("tuning.json")).unwrap()).unwrap();
    assert_eq!(file["results"][0]["key"]["class"], "prose/sampled", "{file}");
    let status = get(&s, "/v1/status").await;
    assert_eq!(status["class_depths"]["prose/sampled"].as_u64(), Some(depth), "{status}");
    assert_eq!(status["draft_depth"], 0, "the model's own depth is untouched: {status}");
}

/// Each request runs at the depth tuned for its class: an agent's turn, code and prose,
/// greedy or sampled, each told apart; a class without a result takes the model's depth.
#[tokio::test(flavor = "multi_thread")]
async fn each_request_runs_at_its_class_depth() {
    use engine::workload::WorkloadClass;
    let class = |name: &str| WorkloadClass::parse(name).unwrap();
    let by_class = vec![(class("code/greedy"), 3), (class("prose/greedy"), 1), (class("agent/greedy"), 2)];
    let s = start_hybrid(move |state| common::serve_at_depths(state, 0, by_class)).await;
    let depth_of = |v: &Value| v["timings"]["draft_depth"].as_u64().unwrap_or(0);
    let ask = |text: &str, extra: Value| {
        let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "reasoning_effort": "none"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let tool = json!([{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object",
        "properties": {"path": {"type": "string"}}}}}]);
    for (text, extra, want) in [
        ("Write a Python function that sorts a list.", json!({"temperature": 0}), 3),
        ("Describe the sea at night.", json!({"temperature": 0}), 1),
        ("Read main.rs.", json!({"temperature": 0, "tools": tool}), 2),
        ("Describe the sea at night.", json!({"temperature": 0.7}), 0),
    ] {
        let (code, v) = post(&s, "/v1/chat/completions", &ask(text, extra.clone())).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(depth_of(&v), want, "{text} {extra}: {v}");
    }
}
