//! A real server on loopback with a project-made checkpoint, for the HTTP tests.
#![allow(dead_code)]

use engine::workload::WorkloadClass;
use std::time::Duration;

use engine::checkpoint::{self, Architecture, MakeOptions};
use serde_json::{json, Value};
use server::worker::{Worker, WorkerOptions};
use server::AppState;

pub struct Server {
    pub base: String,
    pub state: AppState,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    /// A test binary must not exit while an engine thread still computes (a cancelled
    /// generation finishes its step): MLX's statics would be torn down under it.
    fn drop(&mut self) {
        self.state.loaded().worker.shutdown(Duration::from_secs(20));
    }
}

pub async fn start(api_key: Option<&str>) -> Server {
    start_with(api_key, None).await
}

pub async fn start_with(api_key: Option<&str>, idle: Option<Duration>) -> Server {
    start_full(api_key, WorkerOptions { idle, ..Default::default() }).await
}

pub async fn start_opts(options: WorkerOptions) -> Server {
    start_full(None, options).await
}

async fn start_full(api_key: Option<&str>, options: WorkerOptions) -> Server {
    start_configured(api_key, options, |_| {}).await
}

/// A server without an API key whose worker runs with `options`.
pub async fn start_full_options(options: WorkerOptions) -> Server {
    start_full(None, options).await
}

/// A server whose state `configure` adjusts before it serves.
pub async fn start_configured(
    api_key: Option<&str>,
    options: WorkerOptions,
    configure: impl FnOnce(&mut AppState),
) -> Server {
    let mut o = MakeOptions::new(Architecture::Qwen3, "tiny");
    o.bits = Some(4);
    o.group_size = 32;
    start_checkpoint(&o, api_key, options, configure).await
}

/// A server on a hybrid model with an MTP head (speculative decoding, tuning).
pub async fn start_hybrid(configure: impl FnOnce(&mut AppState)) -> Server {
    start_hybrid_with(WorkerOptions::default(), configure).await
}

/// As [`start_hybrid`], its worker started with `options`.
pub async fn start_hybrid_with(options: WorkerOptions, configure: impl FnOnce(&mut AppState)) -> Server {
    let mut o = MakeOptions::new(Architecture::Qwen35, "tiny");
    o.mtp = true;
    o.dtype = checkpoint::Dtype::Float32;
    start_checkpoint(&o, None, options, configure).await
}

pub async fn start_checkpoint(
    o: &MakeOptions,
    api_key: Option<&str>,
    options: WorkerOptions,
    configure: impl FnOnce(&mut AppState),
) -> Server {
    start_edited(o, |_| {}, api_key, options, configure).await
}

/// As [`start_checkpoint`], with the made checkpoint's `config.json` changed by `edit` first.
pub async fn start_edited(
    o: &MakeOptions,
    edit: impl FnOnce(&mut Value),
    api_key: Option<&str>,
    options: WorkerOptions,
    configure: impl FnOnce(&mut AppState),
) -> Server {
    let edit_config = |dir: &std::path::Path| {
        let config_path = dir.join("config.json");
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        edit(&mut config);
        std::fs::write(&config_path, config.to_string()).unwrap();
    };
    start_prepared(o, edit_config, api_key, options, configure).await
}

/// As [`start_checkpoint`], with the made checkpoint's folder changed by `prepare` first.
pub async fn start_prepared(
    o: &MakeOptions,
    prepare: impl FnOnce(&std::path::Path),
    api_key: Option<&str>,
    options: WorkerOptions,
    configure: impl FnOnce(&mut AppState),
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::make(o, dir.path()).unwrap();
    prepare(dir.path());
    let path = dir.path().to_path_buf();
    let worker =
        tokio::task::spawn_blocking(move || Worker::start(path, "tiny".into(), options)).await.unwrap().unwrap();
    let mut state = AppState::new(worker, vec!["ferrite-tiny".into()], 0, api_key.map(str::to_string));
    configure(&mut state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = server::router_with_cors(state.clone(), &server::APP_ORIGINS.map(String::from));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server { base, state, _dir: dir }
}

/// A server on the model in `dir` (a path as given: relative ones too), its state adjusted by
/// `configure`.
pub async fn serve_dir(dir: std::path::PathBuf, configure: impl FnOnce(&mut AppState)) -> Server {
    let worker = tokio::task::spawn_blocking(move || Worker::start(dir, "tiny".into(), WorkerOptions::default()))
        .await
        .unwrap()
        .unwrap();
    let mut state = AppState::new(worker, vec![], 0, None);
    configure(&mut state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = server::router_with_cors(state.clone(), &server::APP_ORIGINS.map(String::from));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server { base, state, _dir: tempfile::tempdir().unwrap() }
}

/// Configures a server to speculate at draft depth 2 (as a tuned depth would).
pub fn speculate(state: &mut AppState) {
    serve_at_depths(state, 2, Vec::new());
}

/// Serves the loaded model at MTP depth `draft_depth`, and at `class_depths` for requests of
/// those workload classes (as tuned results would set them).
pub fn serve_at_depths(state: &mut AppState, draft_depth: usize, class_depths: Vec<(WorkloadClass, usize)>) {
    let by_class = class_depths.into_iter().map(|(c, d)| (c, engine::Speculation::mtp(d))).collect();
    serve_as(
        state,
        server::depth_plan::DepthPlan { by_class, ..server::depth_plan::DepthPlan::mtp(draft_depth, "test") },
    );
}

/// Serves the loaded model as `plan` says.
pub fn serve_as(state: &mut AppState, plan: server::depth_plan::DepthPlan) {
    let served = state.loaded();
    state.replace(server::Loaded { worker: served.worker.clone(), aliases: served.aliases.clone(), depth: plan });
}

pub fn chat(extra: Value) -> Value {
    let mut body =
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Write a function."}], "max_tokens": 12});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// POSTs `body` as the app or its page would: JSON, with the control token.
pub async fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.base))
        .header(server::guard::TOKEN_HEADER, s.state.guard.control_token())
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The `data:` payloads of an SSE response.
pub async fn sse(s: &Server, body: &Value) -> Vec<String> {
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}
