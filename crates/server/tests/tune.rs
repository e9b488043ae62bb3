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
