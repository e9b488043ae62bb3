//! A soak: for a while (`FERRITE_SOAK_SECONDS`, 60 by default; longer on demand), streaming
//! clients that finish and clients that hang up midway, model swaps, pulls and deletes from
//! the local test hub, and tunes started and cancelled, all at once. Every kept client must
//! get whole answers; afterwards the process's threads, open files, MLX active memory and
//! resident memory must come back to what they were when idle before.

mod common;
#[path = "../../store/tests/hub/mod.rs"]
mod hub;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::post;
use serde_json::{json, Value};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// The names of the process's threads (what a leak would be).
fn thread_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .map(|n| n.trim().to_string())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

#[derive(Debug)]
struct Idle {
    threads: usize,
    files: usize,
    mlx_active: usize,
    resident: usize,
}

async fn settle(s: &common::Server) -> Idle {
    // Nothing queued, loading or tuning; then a moment for connections and tasks to end.
    for _ in 0..600 {
        let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
        let tune: Value = reqwest::get(format!("{}/v1/tune", s.base)).await.unwrap().json().await.unwrap();
        if status["queue_depth"] == 0 && status["loading"].is_null() && tune["running"] != true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Tokio's blocking pool keeps an idle thread for 10 s: wait for the count to stop falling.
    let mut count = threads();
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = threads();
        if now >= count && now <= 20 {
            break;
        }
        count = now;
    }
    Idle {
        threads: threads(),
        files: open_files(),
        mlx_active: engine::memory::mlx_memory().active as usize,
        resident: resident_bytes(),
    }
}

/// A streamed chat answer read to its end: whether it was whole (status 200, ends with [DONE]).
async fn whole_answer(base: &str, max_tokens: u32) -> bool {
    let body = json!({"model": "tiny", "stream": true, "max_tokens": max_tokens, "ignore_eos": true,
                      "messages": [{"role": "user", "content": "Write a function."}]});
    let Ok(r) = reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await else {
        return false;
    };
    r.status() == 200 && r.text().await.is_ok_and(|t| t.trim_end().ends_with("data: [DONE]"))
}

/// A streamed answer its client leaves after the first bytes.
async fn hang_up(base: &str) {
    let body = json!({"model": "tiny", "stream": true, "max_tokens": 400, "ignore_eos": true,
                      "messages": [{"role": "user", "content": "Write a long function."}]});
    if let Ok(mut r) = reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await {
        let _ = r.chunk().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn everything_at_once_then_back_to_idle() {
    let seconds: u64 = std::env::var("FERRITE_SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let tmp = tempfile::tempdir().unwrap();
    // A second model to swap to, and the hub's model to pull.
    let hybrid = tmp.path().join("hybrid");
    let mut o = engine::checkpoint::MakeOptions::new(engine::checkpoint::Architecture::Qwen35, "tiny");
    o.mtp = true;
    engine::checkpoint::make(&o, &hybrid).unwrap();
    let hub = hub::start().await;
    hub::checkpoint(&tmp.path().join("src"), true, 5);
    hub.hub.publish("test/hybrid", &tmp.path().join("src"));
    let options = store::download::Options { endpoint: hub.endpoint.clone(), retries: 0, ..Default::default() };
    let access = server::models::StoreAccess::new(Some(tmp.path().join("config")), Some(options));
    let first_dir: Arc<std::sync::Mutex<Option<std::path::PathBuf>>> = Default::default();
    let first = first_dir.clone();
    let resolver: server::Resolver = Arc::new(move |name: &str, _profile: engine::ProfileName| {
        let dir = match name {
            "hybrid" => hybrid.clone(),
            "tiny" => first.lock().unwrap().clone().expect("the first model's folder"),
            other => anyhow::bail!("`{other}` is not a model here"),
        };
        Ok(server::ModelSpec {
            dir,
            id: name.into(),
            aliases: vec![],
            depth: server::depth_plan::DepthPlan::mtp(0, "test"),
            batch_rule: Default::default(),
            drafter: None,
        })
    });
    let s = common::start_configured(None, Default::default(), move |state| {
        state.store = access;
        state.resolver = Some(resolver);
    })
    .await;
    *first_dir.lock().unwrap() = Some(s.state.loaded().worker.info.dir.clone());
    assert_eq!(post(&s, "/v1/store/folder", &json!({"dir": tmp.path().join("models")})).await.0, 200);

    // Everything once, so that what is made once (thread pools, kernels, the hub client) is
    // there before the idle figures are taken.
    assert!(whole_answer(&s.base, 8).await);
    assert_eq!(post(&s, "/v1/models/load", &json!({"model": "hybrid"})).await.0, 200);
    assert_eq!(post(&s, "/v1/models/load", &json!({"model": "tiny"})).await.0, 200);
    let idle = settle(&s).await;

    let stop = Arc::new(AtomicBool::new(false));
    let (answers, broken, swaps, pulls, tunes) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (base, stop, answers, broken) = (s.base.clone(), stop.clone(), answers.clone(), broken.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if whole_answer(&base, 24).await {
                    answers.fetch_add(1, Ordering::SeqCst);
                } else {
                    broken.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for _ in 0..2 {
        let (base, stop) = (s.base.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                hang_up(&base).await;
            }
        }));
    }
    let token = s.state.guard.control_token().to_string();
    let control = move |base: String, path: &'static str, body: Value| {
        let token = token.clone();
        async move {
            let r = reqwest::Client::new()
                .post(format!("{base}{path}"))
                .header(server::guard::TOKEN_HEADER, token)
                .json(&body)
                .send()
                .await;
            r.map(|r| r.status().as_u16()).unwrap_or(0)
        }
    };
    {
        let (base, stop, swaps, control) = (s.base.clone(), stop.clone(), swaps.clone(), control.clone());
        tasks.push(tokio::spawn(async move {
            let mut next = "hybrid";
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_secs(3)).await;
                if control(base.clone(), "/v1/models/load", json!({"model": next})).await == 200 {
                    swaps.fetch_add(1, Ordering::SeqCst);
                    next = if next == "hybrid" { "tiny" } else { "hybrid" };
                }
            }
            // End on the model the idle figures were taken with.
            while control(base.clone(), "/v1/models/load", json!({"model": "tiny"})).await == 409 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }));
    }
    {
        let (base, stop, pulls, control) = (s.base.clone(), stop.clone(), pulls.clone(), control.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if control(base.clone(), "/v1/store/pull", json!({"model": "test/hybrid"})).await == 202 {
                    for _ in 0..300 {
                        let v: Value = reqwest::get(format!("{base}/v1/store")).await.unwrap().json().await.unwrap();
                        if v["downloads"].as_array().is_some_and(|d| {
                            d.iter().all(|d| d["state"]["state"] != "downloading" && d["state"]["state"] != "starting")
                        }) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    if control(base.clone(), "/v1/store/delete", json!({"model": "test/hybrid"})).await == 200 {
                        pulls.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }));
    }
    {
        let (base, stop, tunes, control) = (s.base.clone(), stop.clone(), tunes.clone(), control.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_secs(4)).await;
                let started = control(base.clone(), "/v1/tune", json!({"tokens": 16, "reps": 1, "prompts": 1})).await;
                tokio::time::sleep(Duration::from_millis(700)).await;
                control(base.clone(), "/v1/tune/cancel", json!({})).await;
                if started == 202 || started == 200 {
                    tunes.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t).await.expect("a client hung").unwrap();
    }
    let after = settle(&s).await;
    let counts = format!(
        "{:.0} s: {} whole answers, {} broken, {} swaps, {} pulls, {} tunes; idle {idle:?}, after {after:?}",
        started.elapsed().as_secs_f64(),
        answers.load(Ordering::SeqCst),
        broken.load(Ordering::SeqCst),
        swaps.load(Ordering::SeqCst),
        pulls.load(Ordering::SeqCst),
        tunes.load(Ordering::SeqCst)
    );
    eprintln!("soak: {counts}; threads now {:?}", thread_names());
    assert_eq!(broken.load(Ordering::SeqCst), 0, "every kept client got whole answers: {counts}");
    assert!(answers.load(Ordering::SeqCst) > 0 && swaps.load(Ordering::SeqCst) > 0, "{counts}");
    assert!(after.threads <= idle.threads + 4, "threads: {counts}; now {:?}", thread_names());
    assert!(after.files <= idle.files + 8, "open files: {counts}");
    // What the prompt cache holds on purpose is not a leak.
    let cache = s.state.loaded().worker.metrics.prompt_cache().bytes;
    assert!(after.mlx_active <= idle.mlx_active + cache + (16 << 20), "MLX active memory: {counts}, cache {cache}");
    assert!(after.resident <= idle.resident + idle.resident / 4 + cache + (64 << 20), "resident memory: {counts}");
}
