//! The idle watchdog, alone in its process so MLX's memory counters are this server's only.

mod common;

use std::time::Duration;

use common::{chat, post, start_with};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn idle_watchdog_unloads_and_memory_returns() {
    let s = start_with(None, Some(Duration::from_millis(400))).await;
    let client = reqwest::Client::new();
    let status =
        || async { client.get(format!("{}/v1/status", s.base)).send().await.unwrap().json::<Value>().await.unwrap() };
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
    let loaded = status().await;
    assert_eq!(loaded["loaded"], true);
    let active = loaded["mlx_active_memory_bytes"].as_u64().unwrap();
    assert!(active > 0);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let idle = status().await;
    assert_eq!(idle["loaded"], false, "{idle}");
    assert_eq!(idle["idle_unload_after_s"], 0);
    assert!(idle["idle_s"].as_u64().is_some());
    assert_eq!(idle["idle_unloads"], 1);
    assert!(idle["mlx_active_memory_bytes"].as_u64().unwrap() < active, "{idle} vs {active}");
    assert_eq!(idle["mlx_cache_memory_bytes"], 0);
    // The next request loads the model again.
    let (code, v) = post(&s, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(code, 200, "{v}");
    let back = status().await;
    assert_eq!(back["reloads"], 1);
    // The app's Stop: unloaded at once, not after the idle limit; loaded again on demand.
    s.state.loaded().worker.unload();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stopped = status().await;
    assert_eq!(stopped["loaded"], false, "{stopped}");
    assert_eq!(stopped["idle_unloads"], 2);
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
    assert_eq!(status().await["reloads"], 2);
}
