//! Ferrite's HTTP server: the OpenAI-compatible API over one loaded model. The engine runs
//! on its own thread ([`worker`]); handlers only translate between HTTP and engine events.
//! It knows nothing of the app that may embed it.

mod admit;
mod answer;
pub mod anthropic;
mod backlog;
pub mod connections;
pub mod depth_plan;
pub mod engine_options;
mod engine_thread;
mod engine_threads;
pub mod error;
#[cfg(test)]
mod fuzz;
pub mod guard;
pub mod history;
mod images;
pub mod job;
mod job_run;
pub mod launch;
mod lifecycle;
pub mod live;
pub mod metrics;
pub mod model_info;
pub mod models;
pub mod openai;
pub mod response_format;
pub mod responses;
mod responses_output;
pub mod scripted;
pub mod think;
pub mod tool_choice;
pub mod tools;
pub mod tuning;
pub mod ui;
pub mod worker;

use crate::depth_plan::DepthPlan;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::worker::{Worker, WorkerOptions};

/// Request bodies above this are refused (413): a 256K-token conversation is ~1 MB of JSON.
pub const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(Clone)]
pub struct ServerConfig {
    pub model_dir: PathBuf,
    /// The name clients use; defaults to the folder name.
    pub model_id: Option<String>,
    /// Other names accepted for the model.
    pub aliases: Vec<String>,
    pub addr: SocketAddr,
    /// Required when binding anything but loopback.
    pub api_key: Option<String>,
    /// The draft depths to serve with.
    pub depth: DepthPlan,
    /// The idle watchdog: its limit (`None` = never), what it does, and the runtime profile.
    pub worker: WorkerOptions,
    /// Browser origins allowed to call the API (the app's own; see [`APP_ORIGINS`]).
    pub cors_origins: Vec<String>,
    /// Host names the server answers besides loopback and its address (`--allow-host`).
    pub allowed_hosts: Vec<String>,
    /// Lets `/v1/models/load` start other models (`None`: only this one is served).
    pub resolver: Option<Resolver>,
    /// Refuse (404) requests that name another model than the loaded one, instead of
    /// answering them with it.
    pub strict_model_names: bool,
}

/// The origin the Tauri app's web view uses: `tauri://localhost` on macOS and Linux. The UI
/// served at `/` needs none: same origin.
#[cfg(not(windows))]
pub const APP_ORIGINS: [&str; 1] = ["tauri://localhost"];
/// On Windows the web view's origin is `http(s)://tauri.localhost`; elsewhere that name is an
/// ordinary local page's (any port-80 or 443 server on `*.localhost`), so only Windows trusts it.
#[cfg(windows)]
pub const APP_ORIGINS: [&str; 3] = ["tauri://localhost", "http://tauri.localhost", "https://tauri.localhost"];

/// The model being served: its worker and the names and draft depth it is served with.
pub struct Loaded {
    /// Shared so that a new draft depth (after tuning) can be set without restarting it.
    pub worker: Arc<Worker>,
    pub aliases: Vec<String>,
    /// The draft depths it is served with (`ferrite tune --class` adds a class's).
    pub depth: DepthPlan,
}

/// What `/v1/models/load` needs to start another model: a folder, its names, its draft depth.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub dir: PathBuf,
    pub id: String,
    pub aliases: Vec<String>,
    pub depth: DepthPlan,
    /// When a speculating request decodes together with others (the tuner's measurement).
    pub batch_rule: engine::batch_rule::BatchRule,
    /// A DFlash block drafter to load beside it (`ferrite serve --drafter`).
    pub drafter: Option<PathBuf>,
}

/// Turns a model name (catalog id, alias, folder…) and the runtime profile it will run with
/// into a [`ModelSpec`] (the tuned draft depth depends on both); given by the program that
/// embeds the server (the CLI and the app resolve names through the store).
pub type Resolver = Arc<dyn Fn(&str, engine::ProfileName) -> anyhow::Result<ModelSpec> + Send + Sync>;

/// Told after `/v1/models/load` (the UI's Start buttons, the app's tray) has started a model:
/// the name it was asked for, what that name resolved to, and the profile. The app remembers
/// it for its next launch. Runs on a blocking thread: it may write a file.
pub type OnLoad = Arc<dyn Fn(&str, &ModelSpec, engine::ProfileName) + Send + Sync>;

#[derive(Clone)]
pub struct AppState {
    model: Arc<std::sync::RwLock<Arc<Loaded>>>,
    /// How new models are found and started (`None`: this server serves one model only).
    pub resolver: Option<Resolver>,
    pub worker_options: WorkerOptions,
    /// The model being loaded by `/v1/models/load`, if one is.
    pub loading: Arc<std::sync::Mutex<Option<String>>>,
    /// See [`OnLoad`] (`None`: nobody is told).
    pub on_load: Option<OnLoad>,
    /// Something the person at the UI should read, from the program that started the server
    /// (the app's "could not start X, so it started Y"); shown in `/v1/status` and the page
    /// until another model starts.
    pub notice: Arc<std::sync::Mutex<Option<String>>>,
    /// The model store the UI acts on, and its downloads.
    pub store: models::StoreAccess,
    /// Who may call: Host, Origin, content type, the control token and the API key.
    pub guard: Arc<guard::Guard>,
    /// See [`ServerConfig::strict_model_names`].
    pub strict_model_names: bool,
    /// Memory, fans and thermal state, sampled once a second.
    pub telemetry: Arc<telemetry::Sampler>,
    /// The app's Tune button: the run in progress or the last one's outcome.
    pub tuning: tuning::Shared,
    /// The live window's last 15 minutes, a sample a second (sampled once a router serves).
    pub history: Arc<history::History>,
    pub started: Instant,
    pub started_unix: u64,
    next_id: Arc<AtomicU64>,
    /// 64 random bits, hex, before every id this server hands out: ids stay unique across
    /// restarts (an agent's history holds the ids of earlier processes).
    id_prefix: Arc<str>,
}

impl AppState {
    /// Serves `worker`'s model with MTP drafts of `draft_depth` for every request.
    pub fn new(worker: Worker, aliases: Vec<String>, draft_depth: usize, api_key: Option<String>) -> Self {
        Self::serving(
            Loaded {
                worker: Arc::new(worker),
                aliases,
                depth: DepthPlan::mtp(draft_depth, "set by the embedding program"),
            },
            api_key,
        )
    }

    pub fn serving(loaded: Loaded, api_key: Option<String>) -> Self {
        AppState {
            model: Arc::new(std::sync::RwLock::new(Arc::new(loaded))),
            resolver: None,
            worker_options: WorkerOptions::default(),
            loading: Default::default(),
            on_load: None,
            notice: Default::default(),
            store: Default::default(),
            guard: Arc::new(guard::Guard::loopback(api_key)),
            strict_model_names: false,
            telemetry: Arc::new(telemetry::Sampler::start(std::time::Duration::from_secs(1))),
            tuning: Default::default(),
            history: Default::default(),
            started: Instant::now(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            next_id: Arc::new(AtomicU64::new(1)),
            id_prefix: random_hex(8).into(),
        }
    }

    /// The model served now (requests keep the one they started with).
    pub fn loaded(&self) -> Arc<Loaded> {
        self.model.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Serves `loaded` from now on; the previous model goes once its last request ends.
    pub fn replace(&self, loaded: Loaded) {
        *self.model.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
    }

    pub fn set_notice(&self, notice: Option<String>) {
        *self.notice.lock().unwrap_or_else(|e| e.into_inner()) = notice;
    }

    pub fn notice(&self) -> Option<String> {
        self.notice.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A fresh id for a message, response, item or tool call: this server's random prefix
    /// and a counter (never the same twice, in this process or any other).
    pub fn next_id(&self) -> String {
        format!("{}{:08}", self.id_prefix, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The loaded model, if `name` is its id or one of its aliases.
    pub fn resolve_model(&self, name: &str) -> Result<Arc<Loaded>, ApiError> {
        let loaded = self.loaded();
        if name == loaded.worker.info.id || loaded.aliases.iter().any(|a| a == name) || !self.strict_model_names {
            // Agents send their own default names (claude-…, gpt-…): with one model loaded,
            // it answers them, and the response names it.
            Ok(loaded)
        } else {
            Err(ApiError::not_found(format!("model `{name}` is not loaded (loaded: `{}`)", loaded.worker.info.id))
                .with_param("model"))
        }
    }

    /// The defaults that change speed, on every generation response, and the most tokens the
    /// answer may have (with the request's own number when it was more than the context left).
    pub fn speed_headers(&self, loaded: &Loaded, max_tokens: usize, clamped: Option<job::Clamp>) -> HeaderMap {
        let mut h = HeaderMap::new();
        let mut put = |k: &'static str, v: String| {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(k, v);
            }
        };
        put("x-ferrite-model", loaded.worker.info.id.clone());
        put("x-ferrite-device", loaded.worker.info.backend.clone());
        put("x-ferrite-draft-depth", loaded.depth.depth().to_string());
        put("x-ferrite-profile", loaded.worker.info.profile.name.to_string());
        put("x-ferrite-max-tokens", max_tokens.to_string());
        // Who set the limit: the request's own number, or the server (lowered from the
        // request's, or chosen where the request asked none).
        put("x-ferrite-max-tokens-set-by", clamped.map_or("request", |c| c.by.name()).into());
        if let Some(c @ job::Clamp { asked: Some(asked), .. }) = clamped {
            put("x-ferrite-max-tokens-clamped-from", asked.to_string());
            put("x-ferrite-max-tokens-clamped-by", c.by.name().into());
        }
        h
    }
}

/// The API, with CORS for `cors_origins` only.
pub fn router_with_cors(state: AppState, cors_origins: &[String]) -> Router {
    let origins: Vec<HeaderValue> = cors_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()).collect();
    let cors = tower_http::cors::CorsLayer::new()
        .allow_origin(origins)
        .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
        .allow_headers([
            axum::http::header::CONTENT_TYPE,
            axum::http::header::AUTHORIZATION,
            axum::http::HeaderName::from_static("x-api-key"),
            axum::http::HeaderName::from_static("anthropic-version"),
            axum::http::HeaderName::from_static(guard::TOKEN_HEADER),
        ])
        .expose_headers(tower_http::cors::Any);
    router(state).layer(cors)
}

pub fn router(state: AppState) -> Router {
    history::start(history::Sources {
        model: Arc::downgrade(&state.model),
        telemetry: Arc::downgrade(&state.telemetry),
        history: Arc::downgrade(&state.history),
    });
    Router::new()
        .route("/", get(ui::index))
        .route("/app.js", get(ui::script))
        .route("/style.css", get(ui::style))
        .route("/charts.js", get(ui::charts))
        .route("/vendor/uplot/uPlot.iife.min.js", get(ui::uplot_script))
        .route("/vendor/uplot/uPlot.min.css", get(ui::uplot_style))
        .route("/health", get(health))
        // Claude Code warms its connection with `HEAD /api/hello` (and ignores the answer).
        .route("/api/hello", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/v1/telemetry", get(live::telemetry))
        .route("/v1/events", get(live::events))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models::list))
        .route("/v1/models/load", post(models::load))
        .route("/v1/store", get(models::store_listing))
        .route("/v1/store/pull", post(models::pull))
        .route("/v1/store/cancel", post(models::cancel))
        .route("/v1/store/delete", post(models::delete))
        .route("/v1/store/folder", post(models::folder))
        .route("/v1/tune", get(tuning::status).post(tuning::start))
        .route("/v1/tune/cancel", post(tuning::cancel))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), guard::check))
        .layer(middleware::from_fn(json_errors))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(log_request))
        .with_state(state)
}

/// One log line per API request: method, path, status and time to the response's head (a
/// refused request is a warning, so a client's 4xx is visible in the log).
async fn log_request(request: axum::extract::Request, next: middleware::Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let started = Instant::now();
    let response = next.run(request).await;
    let (status, ms) = (response.status(), started.elapsed().as_millis());
    if status.is_client_error() || status.is_server_error() {
        tracing::warn!("{method} {path} -> {} in {ms} ms", status.as_u16());
    } else if path.starts_with("/v1/") && path != "/v1/events" && path != "/v1/status" && path != "/v1/telemetry" {
        tracing::info!("{method} {path} -> {} in {ms} ms", status.as_u16());
    }
    response
}

async fn metrics(State(s): State<AppState>) -> Response {
    let loaded = s.loaded();
    let w = &loaded.worker;
    let text = w.metrics.render(w.queue_depth.load(Ordering::SeqCst), w.lifecycle.loaded.load(Ordering::SeqCst));
    ([("content-type", "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// `ok`, or a 503 saying why the model cannot answer (its engine stopped on an internal
/// error, a split model's rank is gone).
async fn health(State(s): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let worker = &s.loaded().worker;
    match worker.crashed().or_else(|| worker.metrics.ranks().down) {
        Some(why) => {
            (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "down", "error": why}))).into_response()
        }
        None => Json(json!({"status": "ok"})).into_response(),
    }
}

async fn status(State(s): State<AppState>) -> Json<serde_json::Value> {
    Json(status_json(&s))
}

/// `/v1/status`: the model served and every default that changes its speed (also the base of
/// each `/v1/events` update).
pub fn status_json(s: &AppState) -> serde_json::Value {
    let loaded = s.loaded();
    let w = &loaded.worker;
    let i = &w.info;
    let mlx = engine::memory::mlx_memory();
    let mut status = json!({
        "model": i.id, "model_type": i.model_type, "dir": i.dir, "device": i.backend,
        "blas": i.blas, "weights": i.weight_form, "mlx_version": i.mlx_version,
        // The hybrids' recurrence: ops, mlx-native (Metal), cuda-fused or cuda-kernel, after its self-check.
        "delta_rule": i.delta_rule.as_ref().map(|(path, why)| json!({"path": path, "why": why})),
        "context": i.context, "mtp_head": i.has_mtp, "draft_depth": loaded.depth.depth(), "draft_depth_source": loaded.depth.source,
        // Depths tuned per workload class (a request of the class runs at it; others at
        // `draft_depth`), and what drafts at each.
        "class_depths": loaded.depth.by_class.iter().map(|(c, s)| (c.to_string(), json!(s.depth))).collect::<serde_json::Map<_, _>>(),
        // The runtime depth controller's state for the speculating request now (or the last).
        "depth_control": w.metrics.live().depth_control,
        "loading": s.loading.lock().ok().and_then(|l| l.clone()),
        "notice": s.notice(),
        "queue_depth": w.queue_depth.load(Ordering::SeqCst),
        "decoding_together": w.metrics.batch_size.load(Ordering::Relaxed),
        "max_sequences": i.profile.max_sequences,
        // Each request generating now: tokens so far and its rate over its last tokens.
        "streams": w.metrics.streams(),
        "batching": {
            "decoding_together": w.metrics.batch_size.load(Ordering::Relaxed),
            "prefilling": w.metrics.prefilling.load(Ordering::Relaxed),
            "waiting": w.queue_depth.load(Ordering::SeqCst),
            "waiting_for_memory": w.metrics.waiting_for_memory.load(Ordering::Relaxed),
            "waiting_for_speculation": w.metrics.waiting_for_speculation.load(Ordering::Relaxed),
            "max_sequences": i.profile.max_sequences,
            "memory_share": i.profile.batch_memory_share,
            "prefill_interleave_tokens": i.profile.prefill_interleave,
            "rule": "a request alone decodes with speculation (its draft depth); when others come it joins them between \
                     its cycles once batching them beats its speed-up or they have waited the profile's hold \
                     (speculation_or_batch; until then they wait their turn), and requests decoding together decode plainly, one pass a step for all; a newcomer's \
                     prompt is prefilled prefill_interleave_tokens a step while the others decode",
            "speculation_or_batch": speculation_or_batch(&w.batch_rule(), &i.profile),
        },
        "uptime_s": s.started.elapsed().as_secs(),
        "loaded": w.lifecycle.loaded.load(Ordering::SeqCst),
        "idle_s": w.lifecycle.idle_for().as_secs(),
        "idle_unload_after_s": w.lifecycle.idle_limit.map(|d| d.as_secs()),
        "reasoning_default": "the chat template's (thinking unless a request turns it off)",
        "profile": i.profile.name,
        "profile_knobs": i.profile.knobs(),
        "idle_action": format!("{:?}", w.lifecycle.on_idle).to_lowercase(),
        "idle_unloads": w.lifecycle.unloads.load(Ordering::SeqCst),
        "reloads": w.lifecycle.reloads.load(Ordering::SeqCst),
        "max_tokens_clamped": w.metrics.max_tokens_clamped.load(Ordering::Relaxed),
        "max_output_tokens": i.max_output_tokens,
        "memory_budget_bytes": i.memory_budget,
        "kv_bytes_per_token": i.kv_bytes_per_token,
        "strict_model_names": s.strict_model_names,
        "prompt_cache": w.metrics.prompt_cache(),
        "mlx_active_memory_bytes": mlx.active,
        "mlx_cache_memory_bytes": mlx.cache,
        "mlx_cache_limit_bytes": i.profile.cache_limit_bytes(),
        // Split across ranks (`--hosts`): each rank's host and memory, and whether all are there.
        "ranks": ranks_json(i, &w.metrics),
    });
    // Whether requests may carry images (the window says so).
    status["sees"] = json!(i.sees);
    // The block drafter beside the model (its folder, block size, the layers it reads), or
    // null: the MTP head drafts, if there is one. Its acceptance by position and tokens per
    // cycle are the speculation figures' (`/metrics`).
    status["drafter"] = json!(i.drafter);
    // What drafts at `draft_depth` ("mtp": the model's head, "block": the drafter above), and
    // at each class's depth.
    status["draft_with"] = json!(loaded.depth.speculation.drafter);
    status["class_drafters"] = loaded
        .depth
        .by_class
        .iter()
        .map(|(c, s)| (c.to_string(), json!(s.drafter)))
        .collect::<serde_json::Map<_, _>>()
        .into();
    status
}

/// The rule that decides whether a speculating request takes in the others or they wait: the
/// tuner's measured gains of batching, the tuned speed-up, and from how many requests they
/// decode together at that speed-up.
fn speculation_or_batch(rule: &engine::batch_rule::BatchRule, profile: &engine::Profile) -> serde_json::Value {
    json!({
        "measured": !rule.gains.is_empty(),
        "batch_gains": rule.gains,
        "tuned_speedup": rule.tuned_speedup,
        "batch_from": rule.batch_from(rule.tuned_speedup, profile.max_sequences),
        "hold_s": profile.speculation_hold_s,
        "why": if rule.gains.is_empty() {
            "untuned: requests decode together as soon as others come (`ferrite tune` measures batching's gains)"
        } else {
            "tuned: a speculating request takes in the others once their number's gain reaches its speed-up \
             (its live estimate from the depth controller, else tuned_speedup), or once they have waited hold_s"
        },
    })
}

/// A split model's ranks for `/v1/status` (`None`: the model is whole here).
fn ranks_json(info: &model_info::ModelInfo, metrics: &metrics::Metrics) -> Option<serde_json::Value> {
    let (hosts, backend) = info.split.as_ref()?;
    let seen = metrics.ranks();
    Some(json!({
        "count": hosts.len(),
        "backend": backend,
        "hosts": hosts,
        "memory_bytes": seen.memory_bytes,
        "state": if seen.down.is_some() { "down" } else { "up" },
        "error": seen.down,
        "checked_s_ago": seen.checked.map(|t| t.elapsed().as_secs()),
    }))
}

/// Turns axum's plain-text rejections (body too large, wrong method…) into JSON errors, in
/// the shape of the API the path belongs to.
async fn json_errors(req: Request, next: Next) -> Response {
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let res = next.run(req).await;
    let is_json = res.headers().get("content-type").is_some_and(|v| {
        v.as_bytes().starts_with(b"application/json") || v.as_bytes().starts_with(b"text/event-stream")
    });
    if res.status().is_success() || is_json {
        return res;
    }
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 64 * 1024).await.unwrap_or_default();
    let mut message = String::from_utf8_lossy(&bytes).trim().to_string();
    if status == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        message = format!("the request body is larger than this server accepts ({} MiB)", MAX_BODY_BYTES >> 20);
    }
    let e = ApiError::new(status, if message.is_empty() { status.to_string() } else { message });
    if anthropic {
        error::AnthropicError(e).into_response()
    } else {
        e.into_response()
    }
}

/// Loads the model and serves until Ctrl-C.
/// Loads the configured model on its engine thread and builds the server's state (the CLI's
/// `serve` and the app both start here).
pub async fn start(config: &ServerConfig) -> anyhow::Result<AppState> {
    if !config.addr.ip().is_loopback() && config.api_key.is_none() {
        anyhow::bail!("binding {} exposes the model beyond this machine: pass an API key (--api-key)", config.addr);
    }
    let id = config.model_id.clone().unwrap_or_else(|| {
        config.model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let dir = config.model_dir.clone();
    let options = config.worker.clone();
    let worker = tokio::task::spawn_blocking(move || Worker::start(dir, id, options)).await??;
    let loaded = Loaded { worker: Arc::new(worker), aliases: config.aliases.clone(), depth: config.depth.clone() };
    let mut state = AppState::serving(loaded, None);
    state.guard = Arc::new(guard::Guard::new(
        Some(config.addr),
        config.allowed_hosts.clone(),
        config.cors_origins.clone(),
        config.api_key.clone(),
    ));
    state.worker_options = config.worker.clone();
    state.strict_model_names = config.strict_model_names;
    state.resolver = config.resolver.clone();
    Ok(state)
}

/// How long a stopping server waits for open connections.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// Serves `state` on `listener` until `shutdown` completes, then lets the engine finish (or
/// cancel) its step before the caller's process — and MLX's statics — go away.
pub async fn serve_until(
    listener: tokio::net::TcpListener,
    state: AppState,
    cors_origins: &[String],
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let info = state.loaded().worker.info.clone();
    tracing::info!(
        "serving `{}` on http://{} (OpenAI API at /v1, Anthropic at /v1/messages, web UI at /; {} profile){}",
        info.id,
        listener.local_addr()?,
        info.profile.name,
        if state.guard.api_key_required() { ", API key required" } else { "" }
    );
    let state_for_shutdown = state.clone();
    let app = router_with_cors(state, cors_origins);
    // Graceful: requests in flight finish. Event streams (an open web UI) never end on
    // their own, so after a short grace the server stops waiting for them.
    let (begun, grace) = tokio::sync::oneshot::channel::<()>();
    let graceful = connections::serve(listener, app, async move {
        shutdown.await;
        let _ = begun.send(());
    });
    tokio::select! {
        _ = graceful => {},
        _ = async {
            if grace.await.is_ok() {
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => tracing::info!("connections still open {SHUTDOWN_GRACE:?} after the stop (event streams): closing them"),
    }
    let loaded = state_for_shutdown.loaded();
    tokio::task::spawn_blocking(move || loaded.worker.shutdown(std::time::Duration::from_secs(10))).await?;
    Ok(())
}

/// Completes when the process is asked to stop: Ctrl-C (SIGINT), or SIGTERM (`kill`, a service
/// manager, logout). Both mean the same: stop serving, let the engine finish or cancel its
/// step, unload, exit.
pub async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => tracing::info!("interrupted (SIGINT): stopping"),
                    _ = term.recv() => tracing::info!("terminated (SIGTERM): stopping"),
                }
                return;
            }
            Err(e) => tracing::warn!("cannot listen for SIGTERM ({e}); Ctrl-C still stops"),
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("interrupted: stopping");
}

/// `ferrite serve`: start, listen, serve until Ctrl-C, SIGTERM or the idle watchdog's stop.
pub async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    let state = start(&config).await?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.addr))?;
    let stop = state.worker_options.stop.clone();
    serve_until(listener, state, &config.cors_origins, async move {
        tokio::select! {
            _ = interrupted() => {}
            _ = stop.notified() => tracing::info!("stopping after the idle limit"),
        }
    })
    .await
}

/// `bytes` random bytes, hex (the clock's nanoseconds and the process id if the OS has no
/// randomness: ids must still differ from a previous process's).
fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if getrandom::fill(&mut buf).is_err() {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
                ^ ((std::process::id() as u128) << 64);
        buf.iter_mut().enumerate().for_each(|(i, b)| *b = (seed >> ((i % 16) * 8)) as u8);
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}
