//! The engine runs on one thread of its own (MLX state stays on it; the thread is reused by
//! the next engine, see `engine_threads.rs`); requests reach it as
//! jobs through a FIFO queue and answer through a channel of events. A job whose client has
//! gone is cancelled at its next token, and its cache is dropped with it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use engine::batch_rule::BatchRule;
use engine::tokenizer::ChatMessage;
use engine::{CancelToken, Engine, Event, GenerateRequest, Profile, Summary};
use tokio::sync::mpsc as tmpsc;

use crate::metrics::Metrics;
use crate::scripted::ScriptedReplies;
use crate::think::ThinkSplitter;
use crate::tool_choice::CallSyntax;
use crate::tools::{CallEvent, Parsed, ToolCallParser};

/// What the model is asked.
#[derive(Debug, Clone)]
pub enum Prompt {
    Chat {
        messages: Vec<ChatMessage>,
        template_vars: serde_json::Map<String, serde_json::Value>,
        /// Tools the answer may call that the template's `tools` leave out, in its form:
        /// deferred tools a `tool_reference` loaded (Anthropic's tool search), whose definitions
        /// the messages carry where they were loaded.
        loaded_tools: Vec<serde_json::Value>,
    },
    Text(String),
}

impl Prompt {
    /// Bytes of the text it carries (messages and tool-call arguments), before any template:
    /// what bounds its token count from below.
    fn text_bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Chat { messages, .. } => messages
                .iter()
                .map(|m| {
                    m.content.len() + m.tool_calls.iter().map(|c| c.function.arguments.to_string().len()).sum::<usize>()
                })
                .sum(),
        }
    }
}

#[derive(Debug)]
pub struct Job {
    /// Only render and count the prompt (answers `Started`, then stops).
    pub count_only: bool,
    pub prompt: Prompt,
    /// The request's sampling, stops and limits; its `prompt` is filled in by the worker.
    pub request: GenerateRequest,
    /// Unbounded: the engine never waits for a slow client (it would stall every request
    /// decoding with it); what piles up is at most one answer's deltas.
    pub events: tmpsc::UnboundedSender<JobEvent>,
    pub cancel: CancelToken,
    /// What the client has taken of the events (a client that stops reading is let go).
    pub backlog: Arc<crate::backlog::Backlog>,
}

#[derive(Debug)]
pub enum JobEvent {
    /// The prompt fit; `max_tokens` is what will be generated at most: the request's, or less
    /// when that did not fit the context left after the prompt or the server's cap.
    Started {
        prompt_tokens: usize,
        max_tokens: usize,
        clamped: Option<Clamp>,
    },
    /// The prefill has begun: how many of the prompt's tokens the prompt cache restored.
    /// Sent once, before the first delta.
    Prefilled {
        cached_tokens: usize,
    },
    Delta {
        content: String,
        reasoning: String,
        /// Tool calls as they are written: begun, arguments in fragments, ended.
        tool_calls: Vec<CallEvent>,
    },
    Finished {
        summary: Summary,
        reasoning_tokens: usize,
    },
    Failed(JobError),
}

/// The `max_tokens` a request gets when its client sent none: the server chooses (what the
/// context, the memory and `--max-output-tokens` leave), not a fixed default.
pub const NOT_ASKED: usize = usize::MAX;

/// A limit on the answer the server set: lowered from what the request asked (`asked`), or
/// chosen where it asked nothing (`None`); and what set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clamp {
    pub asked: Option<usize>,
    pub by: ClampedBy,
}

impl Clamp {
    /// For the log: " (max_tokens 160 of the 32000 asked, set by the server)".
    fn describe(&self, max_tokens: usize) -> String {
        let by = self.by.name();
        match self.asked {
            Some(asked) => format!(" (max_tokens {max_tokens} of the {asked} asked, set by the {by})"),
            None => format!(" (max_tokens {max_tokens}: none asked, set by the {by})"),
        }
    }
}

impl ClampedBy {
    /// How headers and the log name it.
    pub fn name(self) -> &'static str {
        match self {
            ClampedBy::Context => "context",
            ClampedBy::ServerCap => "server",
            ClampedBy::Memory => "memory",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClampedBy {
    /// The model's context, after the prompt.
    Context,
    /// The server's `--max-output-tokens`.
    ServerCap,
    /// The memory left beside the model: the KV cache of a longer answer would not fit.
    Memory,
}

/// Why a job could not run: the client's fault (4xx), a full queue (429), or the server's (5xx).
#[derive(Debug, Clone)]
pub enum JobError {
    BadRequest(String),
    /// The prompt (at least `prompt_tokens`) does not fit the model's `context`.
    TooLong {
        message: String,
        prompt_tokens: usize,
        context: usize,
    },
    Busy(String),
    Internal(String),
    /// The server cannot answer now (a split model's rank is gone): a 503.
    Unavailable(String),
}

impl JobError {
    /// A prompt of `tokens` (`size` says how many, in words) that the model's context cannot hold.
    fn too_long(tokens: usize, size: &str, info: &ModelInfo) -> Self {
        JobError::TooLong {
            message: format!(
                "the prompt is {size}, and the model's context is {} tokens: it does not fit",
                info.context
            ),
            prompt_tokens: tokens,
            context: info.context,
        }
    }
}

/// Facts about the loaded model that handlers need without asking the worker thread.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub id: String,
    pub dir: PathBuf,
    pub model_type: String,
    pub context: usize,
    pub backend: String,
    /// The MLX library's version.
    pub mlx_version: String,
    /// Which implementation runs the hybrids' gated delta rule, and why (`None`: the model has
    /// no Gated DeltaNet layer).
    pub delta_rule: Option<(String, String)>,
    /// The BLAS library the CPU's matmuls run on.
    pub blas: String,
    /// How the quantized weights were loaded, and why (e.g. dequantized on the CPU).
    pub weight_form: String,
    pub has_mtp: bool,
    pub profile: Profile,
    /// The server's cap on tokens generated per request (`--max-output-tokens`), if any.
    pub max_output_tokens: Option<usize>,
    /// The most memory the model and its caches may take (`--max-memory-gb`, or the
    /// machine's memory): a request whose KV cache would not fit what is left is refused or
    /// its answer shortened.
    pub memory_budget: u64,
    /// What one more token of context takes in the KV caches.
    pub kv_bytes_per_token: u64,
    /// How the model writes a tool call (what a forced call's grammar spells).
    pub call_syntax: CallSyntax,
    /// Split across ranks: each rank's host and the collectives' backend.
    pub split: Option<(Vec<String>, String)>,
}

pub struct Worker {
    /// `None` once [`Worker::shutdown`] ran.
    jobs: std::sync::Mutex<Option<mpsc::Sender<Message>>>,
    /// The running jobs' cancel tokens (so shutdown can stop them).
    current: Arc<std::sync::Mutex<Vec<CancelToken>>>,
    /// Set by shutdown: a running tune stops at its next run instead of outliving the server.
    stopping: Arc<AtomicBool>,
    /// Set when the engine's body has ended (it runs on a reused thread: `engine_threads.rs`).
    finished: crate::engine_threads::Finished,
    pub queue_depth: Arc<AtomicUsize>,
    /// See [`WorkerOptions::max_queued`].
    max_queued: usize,
    /// See [`WorkerOptions::client_stall`].
    client_stall: Duration,
    pub info: ModelInfo,
    pub lifecycle: Arc<Lifecycle>,
    pub metrics: Arc<Metrics>,
    /// See [`WorkerOptions::batch_rule`]; a new tune replaces it while the model runs.
    batch_rule: Arc<std::sync::RwLock<BatchRule>>,
}

/// What the idle watchdog does when its time is up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdleAction {
    /// Unload the model and release MLX's cache; the next request loads it again.
    #[default]
    Unload,
    /// Unload, then ask the server to shut down.
    Stop,
}

impl std::str::FromStr for IdleAction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "unload" => Ok(IdleAction::Unload),
            "stop" => Ok(IdleAction::Stop),
            other => Err(format!("unknown idle action `{other}` (expected unload or stop)")),
        }
    }
}

/// A tuner run on the engine thread (which owns the model): measures, reports progress,
/// stops when `progress` returns `false`.
pub struct TuneJob {
    pub options: engine::tune::TuneOptions,
    pub progress: Box<dyn FnMut(&engine::tune::Progress) -> bool + Send>,
    /// Percent of a core another process may use before the measurement is called busy.
    pub busy_percent: f32,
    pub reply: tokio::sync::oneshot::Sender<Result<engine::tune::Measurement, String>>,
}

fn run_tune(engine: &Engine, tune: &mut TuneJob, stopping: &AtomicBool) -> Result<engine::tune::Measurement, String> {
    let mut busy = telemetry::machine::BusyCheck::new(tune.busy_percent);
    let progress = |p: &engine::tune::Progress| !stopping.load(Ordering::SeqCst) && (tune.progress)(p);
    engine::tune::measure(engine, &tune.options, || busy.check(), progress).map_err(|e| e.to_string())
}

/// What the engine thread receives, in order.
enum Message {
    Job(Box<Job>),
    /// Measure draft depths (the app's Tune button).
    Tune(TuneJob),
    /// Drop the model now (it loads again for the next job).
    Unload,
}

/// How the worker loads and looks after its model.
#[derive(Debug, Clone, Default)]
pub struct WorkerOptions {
    /// The idle watchdog's limit (`None` = never).
    pub idle: Option<Duration>,
    pub on_idle: IdleAction,
    pub profile: Profile,
    /// Notified when the watchdog, set to [`IdleAction::Stop`], wants the server to stop
    /// (shared by every worker the server starts).
    pub stop: Arc<tokio::sync::Notify>,
    /// At most this many tokens generated per request (`None`: what the context leaves).
    pub max_output_tokens: Option<usize>,
    /// Tests only: replies fixed in advance for prompts that match (`scripted.rs`).
    pub scripted: Option<Arc<ScriptedReplies>>,
    /// At most this many jobs wait behind the running one (`None`: [`MAX_QUEUED_JOBS`]); more
    /// are refused with a 429.
    pub max_queued: Option<usize>,
    /// The most memory, in bytes, the model and its caches may take (`None`: the machine's).
    pub memory_budget: Option<u64>,
    /// The prompt cache's disk tier: its folder and byte budget (`None`: memory only).
    pub prompt_disk: Option<engine::prompt_cache::DiskSettings>,
    /// Keep each request's draft depth as asked (no runtime depth controller).
    pub fixed_depth: bool,
    /// The model is split across the ranks of this group (`ferrite serve --hosts`).
    pub split: Option<Split>,
    /// When a speculating request decodes together with the others that came (the tuner's
    /// measurement for this model; default: always).
    pub batch_rule: BatchRule,
    /// How long a client may take none of its answer's events before its request is
    /// cancelled (`None`: [`crate::backlog::STALL`]).
    pub client_stall: Option<Duration>,
}

/// A model split across the ranks of a distributed group, rank 0 serving: the others follow
/// its requests one at a time (`engine::lockstep`), so requests do not batch, the draft depth
/// stays as asked and the prompt cache stays in memory; the model is never unloaded (the
/// others would go with it): while idle, the worker checks every [`HEARTBEAT`] that every rank
/// is still there, reading their memory.
#[derive(Clone)]
pub struct Split {
    pub group: Arc<engine::distributed::Group>,
    /// Each rank's host, in rank order.
    pub hosts: Vec<String>,
    pub backend: String,
}

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Split({} ranks over {}: {:?})", self.group.size(), self.backend, self.hosts)
    }
}

/// How often an idle split model's worker checks its ranks.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

/// Jobs that may wait for the engine by default: several agents' turns, not a flood.
pub const MAX_QUEUED_JOBS: usize = 64;

/// Whether the model is in memory, and how often the idle watchdog unloaded it.
#[derive(Debug)]
pub struct Lifecycle {
    pub loaded: AtomicBool,
    pub unloads: AtomicUsize,
    pub reloads: AtomicUsize,
    /// The idle watchdog's limit (`None` = never unload).
    pub idle_limit: Option<Duration>,
    pub on_idle: IdleAction,
    /// Notified when the watchdog, set to [`IdleAction::Stop`], wants the server to stop.
    pub stop_requested: Arc<tokio::sync::Notify>,
    /// When the engine last finished a job (or started).
    last_active: std::sync::Mutex<std::time::Instant>,
}

impl Lifecycle {
    fn new(idle_limit: Option<Duration>, on_idle: IdleAction, stop: Arc<tokio::sync::Notify>) -> Self {
        Lifecycle {
            loaded: AtomicBool::new(false),
            unloads: AtomicUsize::new(0),
            reloads: AtomicUsize::new(0),
            idle_limit,
            on_idle,
            stop_requested: stop,
            last_active: std::sync::Mutex::new(std::time::Instant::now()),
        }
    }

    fn touch(&self) {
        if let Ok(mut t) = self.last_active.lock() {
            *t = std::time::Instant::now();
        }
    }

    /// Time since the engine last worked.
    pub fn idle_for(&self) -> Duration {
        self.last_active.lock().map(|t| t.elapsed()).unwrap_or_default()
    }
}

impl Worker {
    /// Loads the model on a new thread; returns once it is ready (or failed to load). With
    /// an idle limit, a model that has had no job for that long is unloaded and MLX's buffer
    /// cache released, so the memory really returns; the next job loads it again (or, with
    /// [`IdleAction::Stop`], the server is asked to stop).
    pub fn start(dir: PathBuf, id: String, options: WorkerOptions) -> anyhow::Result<Worker> {
        let WorkerOptions {
            idle,
            on_idle,
            profile,
            stop,
            max_output_tokens,
            scripted,
            max_queued,
            memory_budget,
            prompt_disk,
            fixed_depth,
            split,
            batch_rule,
            client_stall,
        } = options;
        let group = split.as_ref().map(|s| s.group.clone());
        let batch_rule = Arc::new(std::sync::RwLock::new(batch_rule));
        let rule_now = batch_rule.clone();
        let mut profile = profile;
        if split.is_some() {
            profile.max_sequences = 1;
        }
        // A split model stays loaded: its other ranks hold their parts as long as rank 0 does.
        let idle = if split.is_some() { None } else { idle };
        let (jobs, rx) = mpsc::channel::<Message>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let queue_depth = Arc::new(AtomicUsize::new(0));
        let depth = queue_depth.clone();
        let lifecycle = Arc::new(Lifecycle::new(idle, on_idle, stop));
        let life = lifecycle.clone();
        let metrics = Arc::new(Metrics::new());
        let recorder = metrics.clone();
        let current: Arc<std::sync::Mutex<Vec<CancelToken>>> = Default::default();
        let running = current.clone();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop_tune = stopping.clone();
        let finished = crate::engine_threads::run(move || {
            // The prompt cache's disk tier: a folder that cannot be used leaves memory only.
            let split_model = group.is_some();
            let with_disk = |mut engine: Engine| {
                if split_model {
                    return engine;
                }
                if let Some(settings) = &prompt_disk {
                    if let Err(e) = engine.set_prompt_disk(settings) {
                        tracing::warn!("the prompt cache stays in memory: {e}");
                    }
                }
                if let Err(e) = engine.set_depth_control(!fixed_depth) {
                    tracing::warn!("the draft depth stays as asked (no runtime controller): {e}");
                }
                engine
            };
            let load = || {
                let form = engine::weight_form::Override::from_env()?;
                Engine::load_split(&dir, profile.clone(), form, group.clone())
            };
            let engine = match load() {
                Ok(e) => with_disk(e),
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow::anyhow!("loading {}: {e}", dir.display())));
                    return;
                }
            };
            let c = engine.model().config();
            let info = ModelInfo {
                id,
                dir: dir.clone(),
                model_type: c.model_type.clone(),
                context: c.max_position_embeddings.unwrap_or(32768).max(1) as usize,
                backend: engine.backend().to_string(),
                mlx_version: engine::device::mlx_version(),
                delta_rule: c
                    .is_hybrid()
                    .then(engine::delta_path::report)
                    .flatten()
                    .map(|r| (r.path.to_string(), r.why.clone())),
                blas: engine::blas::describe(),
                weight_form: engine.weight_form().to_string(),
                has_mtp: engine.model().mtp().is_some(),
                profile: profile.clone(),
                max_output_tokens,
                memory_budget: memory_budget.unwrap_or_else(engine::device::total_memory),
                kv_bytes_per_token: engine.kv_bytes_per_token(),
                call_syntax: CallSyntax::of(engine.tokenizer()),
                split: split.as_ref().map(|s| (s.hosts.clone(), s.backend.clone())),
            };
            if split_model {
                recorder.set_ranks(engine.rank_memory());
            }
            life.loaded.store(true, Ordering::SeqCst);
            recorder.set_prompt_cache(engine.prompt_cache_stats());
            let _ = ready_tx.send(Ok(info.clone()));
            let mut engine = Some(engine);
            // Drops the model and MLX's buffer cache, so the memory really returns.
            let unload = |engine: &mut Option<Engine>, why: &str| {
                if engine.take().is_some() {
                    engine::memory::clear_cache();
                    life.loaded.store(false, Ordering::SeqCst);
                    life.unloads.fetch_add(1, Ordering::SeqCst);
                    tracing::info!("{why}: unloaded {} and released MLX's cache", info.id);
                }
            };
            // Messages that came while a batch ran, before the channel's.
            let mut deferred = std::collections::VecDeque::new();
            loop {
                let message = match deferred.pop_front() {
                    Some(message) => message,
                    None if split_model => match rx.recv_timeout(HEARTBEAT) {
                        Ok(message) => message,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            if let Some(engine) = &engine {
                                recorder.set_ranks(engine.rank_memory());
                            }
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    },
                    None => match (idle, &engine) {
                        (Some(limit), Some(_)) => match rx.recv_timeout(limit) {
                            Ok(message) => message,
                            Err(mpsc::RecvTimeoutError::Timeout) => {
                                unload(&mut engine, &format!("idle for {limit:?}"));
                                if on_idle == IdleAction::Stop {
                                    tracing::info!("idle action is `stop`: asking the server to shut down");
                                    life.stop_requested.notify_one();
                                }
                                continue;
                            }
                            Err(mpsc::RecvTimeoutError::Disconnected) => break,
                        },
                        _ => match rx.recv() {
                            Ok(message) => message,
                            Err(_) => break,
                        },
                    },
                };
                let reload = |engine: &mut Option<Engine>| -> Result<(), String> {
                    if engine.is_none() {
                        let e = load().map(with_disk).map_err(|e| format!("reloading the model: {e}"))?;
                        tracing::info!("reloaded {} for a new request", info.id);
                        life.loaded.store(true, Ordering::SeqCst);
                        life.reloads.fetch_add(1, Ordering::SeqCst);
                        *engine = Some(e);
                    }
                    Ok(())
                };
                let job = match message {
                    Message::Job(job) => *job,
                    Message::Unload => {
                        unload(&mut engine, "asked to stop");
                        continue;
                    }
                    Message::Tune(mut tune) => {
                        let result = reload(&mut engine).and_then(|()| match &engine {
                            Some(e) => run_tune(e, &mut tune, &stop_tune),
                            None => Err("the model is not loaded".into()),
                        });
                        let _ = tune.reply.send(result);
                        life.touch();
                        continue;
                    }
                };
                depth.fetch_sub(1, Ordering::SeqCst);
                if let Err(e) = reload(&mut engine) {
                    let _ = job.events.send(JobEvent::Failed(JobError::Internal(e)));
                    continue;
                }
                if let Some(engine) = &engine {
                    // Alone a request speculates as it asks; when it would decode plainly
                    // anyway, or with others waiting where batching them beats its tuned
                    // speed-up, it runs in a batch that later ones join (a speculating one
                    // joins it between cycles when enough others come: `run_job`).
                    let rule = rule_now.read().map(|r| r.clone()).unwrap_or_default();
                    let waiting = depth.load(Ordering::SeqCst);
                    let together = info.profile.max_sequences > 1
                        && (job.request.draft_depth == 0
                            || (waiting > 0 && rule.batch_pays(1 + waiting, rule.tuned_speedup)));
                    let first = if together {
                        match start_job(engine, &info, &recorder, scripted.as_deref(), job, true) {
                            Ok(started) => Some(started),
                            Err(used) => {
                                engine.after_request(used);
                                None
                            }
                        }
                    } else {
                        if let Ok(mut c) = running.lock() {
                            *c = vec![job.cancel.clone()];
                        }
                        match run_job(engine, &info, &rule, &recorder, scripted.as_deref(), job, &depth) {
                            Solo::Ended(used) => {
                                engine.after_request(used);
                                None
                            }
                            Solo::Joins(started) => Some(*started),
                        }
                    };
                    if let Some(first) = first {
                        let queue = Queue { rx: &rx, waiting: &depth, deferred: &mut deferred };
                        run_batch(engine, &info, &recorder, scripted.as_deref(), first, queue, &running);
                    }
                    if let Ok(mut c) = running.lock() {
                        c.clear();
                    }
                    recorder.set_prompt_cache(engine.prompt_cache_stats());
                    if split_model {
                        recorder.set_ranks(engine.rank_memory());
                    }
                }
                life.touch();
            }
            // The worker is gone (a model swap, a shutdown): the model goes now; the thread
            // waits for the next engine.
            drop(engine);
        })?;
        let info = ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine thread stopped while loading"))??;
        Ok(Worker {
            jobs: std::sync::Mutex::new(Some(jobs)),
            current,
            stopping,
            finished,
            queue_depth,
            max_queued: max_queued.unwrap_or(MAX_QUEUED_JOBS),
            client_stall: client_stall.unwrap_or(crate::backlog::STALL),
            info,
            lifecycle,
            metrics,
            batch_rule,
        })
    }

    /// When a speculating request decodes together with others, now.
    pub fn batch_rule(&self) -> BatchRule {
        self.batch_rule.read().map(|r| r.clone()).unwrap_or_default()
    }

    /// Replaces the rule (a tune just measured this machine).
    pub fn set_batch_rule(&self, rule: BatchRule) {
        if let Ok(mut r) = self.batch_rule.write() {
            *r = rule;
        }
    }

    /// Queues a job (FIFO).
    pub fn submit(&self, job: Job) -> Result<(), JobError> {
        let waiting = self.queue_depth.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.max_queued {
            self.queue_depth.fetch_sub(1, Ordering::SeqCst);
            return Err(JobError::Busy(format!(
                "{waiting} requests are already waiting for the model (the most this server queues): try again shortly"
            )));
        }
        let sent = match self.jobs.lock().ok().as_ref().and_then(|j| j.as_ref()) {
            Some(jobs) => jobs.send(Message::Job(Box::new(job))).is_ok(),
            None => false,
        };
        if !sent {
            self.queue_depth.fetch_sub(1, Ordering::SeqCst);
            return Err(self.stopped());
        }
        Ok(())
    }

    /// Why the engine thread ended with an internal error, if it did (`/health` reports it).
    pub fn crashed(&self) -> Option<String> {
        self.finished.panicked().map(|p| format!("the engine stopped on an internal error ({p}): load the model again"))
    }

    /// The error for a job the engine can no longer take.
    fn stopped(&self) -> JobError {
        match self.crashed() {
            Some(why) => JobError::Unavailable(why),
            None => JobError::Internal("the engine has stopped (the server is shutting down)".into()),
        }
    }

    /// Queues a tuner run (after the jobs before it); the answer comes on `job.reply`.
    pub fn tune(&self, job: TuneJob) -> Result<(), JobError> {
        match self.jobs.lock().ok().as_ref().and_then(|j| j.as_ref()) {
            Some(jobs) if jobs.send(Message::Tune(job)).is_ok() => Ok(()),
            _ => Err(self.stopped()),
        }
    }

    /// Unloads the model once the queued jobs are done (the app's Stop); the next request
    /// loads it again, as after an idle unload.
    pub fn unload(&self) {
        if let Some(jobs) = self.jobs.lock().ok().as_ref().and_then(|j| j.as_ref()) {
            let _ = jobs.send(Message::Unload);
        }
    }

    /// Stops taking jobs, cancels the running ones and waits (up to `wait`) for the engine
    /// thread to end, so the process never exits while MLX is computing on it.
    pub fn shutdown(&self, wait: Duration) {
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.take();
        }
        self.stopping.store(true, Ordering::SeqCst);
        if let Ok(running) = self.current.lock() {
            running.iter().for_each(CancelToken::cancel);
        }
        let deadline = std::time::Instant::now() + wait;
        while !self.finished.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !self.finished.is_finished() {
            tracing::warn!("the engine thread did not stop within {wait:?}");
        }
    }

    /// Queues a job and waits until its prompt is rendered and checked (errors found there
    /// are the client's: 4xx).
    pub async fn run(&self, prompt: Prompt, request: GenerateRequest, count_only: bool) -> Result<Running, JobError> {
        let (tx, mut events) = tmpsc::unbounded_channel();
        let cancel = CancelToken::default();
        let backlog = Arc::new(crate::backlog::Backlog::new(self.client_stall));
        self.submit(Job { count_only, prompt, request, events: tx, cancel: cancel.clone(), backlog: backlog.clone() })?;
        let guard = CancelOnDrop(cancel);
        match events.recv().await {
            Some(JobEvent::Started { prompt_tokens, max_tokens, clamped }) => {
                Ok(Running { events, prompt_tokens, max_tokens, clamped, guard, backlog })
            }
            Some(JobEvent::Failed(e)) => Err(e),
            _ => Err(self
                .crashed()
                .map(JobError::Unavailable)
                .unwrap_or_else(|| JobError::Internal("the engine ended the request without an answer".into()))),
        }
    }
}

/// The prompt's token ids, its text, and whether it leaves the answer in reasoning mode.
fn render(engine: &Engine, prompt: &Prompt) -> Result<(Vec<u32>, String, bool), JobError> {
    let (ids, text) = match prompt {
        Prompt::Text(t) => (engine.tokenizer().encode(t).map_err(|e| JobError::Internal(e.to_string()))?, t.clone()),
        // A special token's text in a message stays text (`encode_chat`).
        Prompt::Chat { messages, template_vars, .. } => engine
            .tokenizer()
            .encode_chat(messages, true, template_vars)
            .map_err(|e| JobError::BadRequest(e.to_string()))?,
    };
    // Templates that open the think block themselves leave the answer in reasoning mode.
    let thinking = text.trim_end().ends_with("<think>");
    Ok((ids, text, thinking))
}

/// Why a prompt does not fit the memory left: the figures a user can act on.
fn memory_says(info: &ModelInfo, room: usize) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let held = engine::memory::mlx_memory().active;
    format!(
        "the memory left beside the model ({:.2} GB of a {:.1} GB budget, {:.2} GB held) holds the KV cache of {room} tokens \
         at {} bytes a token: it does not fit (a smaller model, or a larger --max-memory-gb)",
        gb(info.memory_budget.saturating_sub(held)),
        gb(info.memory_budget),
        gb(held),
        info.kv_bytes_per_token
    )
}

/// A job whose answer is being generated: where its events go and what they go through.
struct Live<'m> {
    job: Job,
    answer: AnswerStream,
    prompt_tokens: usize,
    max_tokens: usize,
    clamped: Option<Clamp>,
    /// Whether its client has been told what the prompt cache restored.
    told_prefilled: bool,
    /// Its place in the live figures' streams (left when it is dropped).
    stream: StreamShown<'m>,
}

impl Live<'_> {
    /// Tells the client once what the prompt cache restored (known once the prefill began).
    fn tell_prefilled(&mut self, cached_tokens: usize) {
        if !std::mem::replace(&mut self.told_prefilled, true) {
            let _ = self.job.events.send(JobEvent::Prefilled { cached_tokens });
        }
    }
}

/// A request shown as a stream in the live figures while it exists.
struct StreamShown<'m> {
    metrics: &'m Metrics,
    id: u64,
}

impl<'m> StreamShown<'m> {
    fn new(metrics: &'m Metrics) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
        metrics.stream_started(id);
        StreamShown { metrics, id }
    }
}

impl Drop for StreamShown<'_> {
    fn drop(&mut self) {
        self.metrics.stream_ended(self.id);
    }
}

/// How a job run alone ended: done (with the tokens of context it used), or handed to a batch
/// because others came while it ran.
enum Solo<'e> {
    Ended(usize),
    Joins(Box<(Live<'e>, engine::generate::Generation<'e>)>),
}

/// Runs one job alone (speculation as the request asks) until it ends, or until others wait
/// (`waiting` > 0) and it can go on in a batch with them (between its speculative cycles).
fn run_job<'e>(
    engine: &'e Engine,
    info: &ModelInfo,
    rule: &BatchRule,
    metrics: &'e Metrics,
    scripted: Option<&ScriptedReplies>,
    job: Job,
    waiting: &AtomicUsize,
) -> Solo<'e> {
    let (mut live, mut generation) = match start_job(engine, info, metrics, scripted, job, false) {
        Ok(started) => started,
        Err(used) => return Solo::Ended(used),
    };
    metrics.generating.store(true, Ordering::SeqCst);
    let _done = ClearOnDrop(&metrics.generating);
    let _held = ClearOnDrop(&metrics.waiting_for_speculation);
    // Since when others have waited for it (they join it after the profile's hold at most).
    let mut others_since: Option<std::time::Instant> = None;
    let hold = Duration::from_secs_f64(info.profile.speculation_hold_s.max(0.0));
    while let Some(event) = generation.next() {
        metrics.set_depth_control(generation.depth_control());
        live.tell_prefilled(generation.cached_tokens());
        if let Some(used) = on_event(&mut live, engine, metrics, event) {
            return Solo::Ended(used);
        }
        let others = waiting.load(Ordering::SeqCst);
        let since = match others {
            0 => None,
            _ => Some(*others_since.get_or_insert_with(std::time::Instant::now)),
        };
        others_since = since;
        if let Some(since) = since.filter(|_| info.profile.max_sequences > 1 && generation.can_join_batch()) {
            // What speculation gives this request now: its depth controller's live estimate,
            // else the tuned speed-up (the batch's gain is measured against plain decoding).
            let speedup = generation.depth_control().map_or(rule.tuned_speedup, |c| c.expected_speedup);
            let together = (1 + others).min(info.profile.max_sequences);
            if rule.batch_pays(together, speedup) || since.elapsed() >= hold {
                return Solo::Joins(Box::new((live, generation)));
            }
        }
        // (With one sequence at a time they wait for the profile, not for speculation.)
        metrics.waiting_for_speculation.store(since.is_some() && info.profile.max_sequences > 1, Ordering::Relaxed);
    }
    Solo::Ended(live.prompt_tokens)
}

/// Checks a job, renders its prompt and starts its generation (`Started` sent), or says how
/// much context it used when it ends here (refused, counted only, its client gone).
fn start_job<'e>(
    engine: &'e Engine,
    info: &ModelInfo,
    metrics: &'e Metrics,
    scripted: Option<&ScriptedReplies>,
    mut job: Job,
    batched: bool,
) -> Result<(Live<'e>, engine::generate::Generation<'e>), usize> {
    let send = |e: JobEvent| job.events.send(e).is_ok();
    if job.cancel.is_cancelled() || job.events.is_closed() {
        return Err(0);
    }
    // A prompt whose text alone cannot fit is refused before the template renders it.
    let text_bytes = job.prompt.text_bytes();
    // The KV cache of prompt and answer must also fit the memory left beside the model.
    let memory_room = engine::memory::kv_room_tokens(info.memory_budget, info.kv_bytes_per_token);
    let least = engine.tokenizer().at_least_tokens(text_bytes);
    if least >= memory_room && !job.count_only {
        send(JobEvent::Failed(JobError::BadRequest(format!(
            "the prompt is at least {least} tokens ({text_bytes} bytes of text): {}",
            memory_says(info, memory_room)
        ))));
        return Err(0);
    }
    if least >= info.context {
        send(JobEvent::Failed(JobError::too_long(
            least,
            &format!("at least {least} tokens ({text_bytes} bytes of text)"),
            info,
        )));
        return Err(0);
    }
    let (ids, text, thinking) = match render(engine, &job.prompt) {
        Ok(r) => r,
        Err(e) => {
            send(JobEvent::Failed(e));
            return Err(0);
        }
    };
    if ids.is_empty() {
        send(JobEvent::Failed(JobError::BadRequest("the prompt is empty".into())));
        return Err(0);
    }
    let prompt_tokens = ids.len();
    if job.count_only {
        send(JobEvent::Started { prompt_tokens, max_tokens: 0, clamped: None });
        return Err(0);
    }
    if prompt_tokens >= info.context {
        send(JobEvent::Failed(JobError::too_long(prompt_tokens, &format!("{prompt_tokens} tokens"), info)));
        return Err(0);
    }
    if prompt_tokens >= memory_room {
        send(JobEvent::Failed(JobError::BadRequest(format!(
            "the prompt is {prompt_tokens} tokens: {}",
            memory_says(info, memory_room)
        ))));
        return Err(0);
    }
    // Agents ask for more than any context leaves (Claude Code 32K-128K): they get what fits;
    // a request that asks nothing gets all that fits.
    let asked = job.request.max_tokens;
    let (context_room, memory_room) = (info.context - prompt_tokens, memory_room - prompt_tokens);
    let cap = info.max_output_tokens.unwrap_or(usize::MAX);
    let room = context_room.min(memory_room).min(cap);
    let by = if cap == room {
        ClampedBy::ServerCap
    } else if memory_room < context_room {
        ClampedBy::Memory
    } else {
        ClampedBy::Context
    };
    let clamped = (asked > room).then_some(Clamp { asked: (asked != NOT_ASKED).then_some(asked), by });
    if clamped.is_some() {
        job.request.max_tokens = room;
    }
    if clamped.is_some_and(|c| c.asked.is_some()) {
        metrics.max_tokens_clamped.fetch_add(1, Ordering::Relaxed);
    }
    let max_tokens = job.request.max_tokens;
    job.request.prompt = ids;
    if let Some(reply) = scripted.and_then(|s| s.reply_for(&text)) {
        tracing::info!("a scripted reply answers this prompt (--scripted-replies): {reply:?}");
        match engine.tokenizer().encode(reply) {
            Ok(tokens) => job.request.forced_tokens = Some(tokens),
            Err(e) => {
                send(JobEvent::Failed(JobError::Internal(format!("tokenizing a scripted reply: {e}"))));
                return Err(0);
            }
        }
    }
    if batched {
        // A batch decodes plainly: the MTP head drafts for one sequence at a time.
        job.request.draft_depth = 0;
    }
    let generation = match engine.generate(job.request.clone(), job.cancel.clone()) {
        Ok(g) => g,
        Err(e @ engine::Error::GroupDown(_)) => {
            send(JobEvent::Failed(JobError::Unavailable(e.to_string())));
            return Err(0);
        }
        Err(e) => {
            send(JobEvent::Failed(JobError::BadRequest(e.to_string())));
            return Err(0);
        }
    };
    if !send(JobEvent::Started { prompt_tokens, max_tokens, clamped }) {
        return Err(prompt_tokens);
    }
    // With tools offered, the answer is searched for tool calls.
    let offered = crate::tool_choice::offered(&job.prompt);
    let answer = AnswerStream::new(thinking, (!offered.is_empty()).then_some(offered.as_slice()));
    let stream = StreamShown::new(metrics);
    Ok((Live { job, answer, prompt_tokens, max_tokens, clamped, told_prefilled: false, stream }, generation))
}

/// Passes one event of a live job on to its client; how much context the job used once it
/// ended.
fn on_event(live: &mut Live<'_>, engine: &Engine, metrics: &Metrics, event: engine::Result<Event>) -> Option<usize> {
    let Live { job, answer, prompt_tokens, max_tokens, clamped, stream, .. } = live;
    let (prompt_tokens, max_tokens, clamped) = (*prompt_tokens, *max_tokens, *clamped);
    let send = |e: JobEvent| job.events.send(e).is_ok();
    match event {
        Ok(Event::Text(t)) => {
            metrics.tokens.fetch_add(1, Ordering::Relaxed);
            metrics.stream_token(stream.id);
            if let Some(e) = answer.push(&t) {
                job.backlog.sent();
                if !send(e) {
                    // The client went away: stop at the next token; the cache goes with the generation.
                    job.cancel.cancel();
                } else if job.backlog.stalled() && !job.cancel.is_cancelled() {
                    tracing::warn!(
                        "a client took nothing of its answer for {:.0} s: its request is cancelled",
                        job.backlog.stall.as_secs_f64()
                    );
                    job.cancel.cancel();
                }
            }
            None
        }
        Ok(Event::Finished(summary)) => {
            if let Some(e) = answer.finish() {
                send(e);
            }
            metrics.record(&summary);
            tracing::info!(
                "{} prompt tokens ({} from the prompt cache; {:.1} s to the first token, {:.0} tok/s), {} generated ({:.1} tok/s), {:?}{}",
                prompt_tokens,
                summary.usage.cached_tokens,
                summary.timings.ttft.as_secs_f64(),
                summary.timings.prompt_tps,
                summary.usage.completion_tokens,
                summary.timings.decode_tps,
                summary.finish_reason,
                clamped.map(|c| c.describe(max_tokens)).unwrap_or_default()
            );
            let reasoning_tokens = if answer.reasoning.is_empty() {
                0
            } else {
                engine.tokenizer().encode(&answer.reasoning).map(|v| v.len()).unwrap_or(0)
            };
            let used = prompt_tokens + summary.usage.completion_tokens;
            send(JobEvent::Finished { summary, reasoning_tokens });
            Some(used)
        }
        Err(e) => {
            send(JobEvent::Failed(JobError::Internal(e.to_string())));
            Some(prompt_tokens)
        }
    }
}

/// Where a batch finds newcomers: the engine's channel, the count of jobs waiting in it, and
/// the messages other than jobs that came while the batch ran (they wait until it is over).
struct Queue<'q> {
    rx: &'q mpsc::Receiver<Message>,
    waiting: &'q AtomicUsize,
    deferred: &'q mut std::collections::VecDeque<Message>,
}

/// Runs `first` and the jobs that arrive while it runs decoded together
/// (`engine::batch::Batch`: one forward pass a step for all): a job joins between steps, its
/// prompt prefilled a chunk per step, and leaves when it ends, the others untouched. At most
/// the profile's `max_sequences` run at once, and their KV caches may reserve (prompt and
/// longest answer each) at most its `batch_memory_share` of the memory left beside the model;
/// the next job waits, first in line, until one ends.
fn run_batch<'e>(
    engine: &'e Engine,
    info: &ModelInfo,
    metrics: &'e Metrics,
    scripted: Option<&ScriptedReplies>,
    first: (Live<'e>, engine::generate::Generation<'e>),
    queue: Queue<'_>,
    running: &std::sync::Mutex<Vec<CancelToken>>,
) {
    let Queue { rx, waiting, deferred } = queue;
    let max = info.profile.max_sequences.max(1);
    let mut batch: engine::batch::Batch<'e, usize> = Default::default();
    let mut live: std::collections::HashMap<usize, Live<'e>> = Default::default();
    let mut next_id = 0;
    let mut add = |mut l: Live<'e>,
                   generation: engine::generate::Generation<'e>,
                   batch: &mut engine::batch::Batch<'e, usize>,
                   live: &mut std::collections::HashMap<usize, Live<'e>>| {
        next_id += 1;
        match batch.queue(next_id, generation) {
            Ok(()) => {
                l.tell_prefilled(batch.cached_tokens(&next_id).unwrap_or(0));
                if let Ok(mut r) = running.lock() {
                    r.push(l.job.cancel.clone());
                }
                live.insert(next_id, l);
            }
            Err(e) => {
                let _ = l.job.events.send(JobEvent::Failed(JobError::Internal(e.to_string())));
            }
        }
    };
    if let Ok(mut r) = running.lock() {
        r.clear();
    }
    let (first_live, first_generation) = first;
    add(first_live, first_generation, &mut batch, &mut live);
    // Tokens of KV cache the memory beside the model holds with nothing running.
    let room = engine::memory::kv_room_tokens(info.memory_budget, info.kv_bytes_per_token) + batch.kv_tokens().0;
    let share = (room as f64 * info.profile.batch_memory_share) as usize;
    // The next job when it waits for memory (still counted as waiting).
    let mut next: Option<Job> = None;
    metrics.generating.store(true, Ordering::SeqCst);
    let _done = ClearOnDrop(&metrics.generating);
    loop {
        while batch.len() < max && (next.is_some() || deferred.is_empty()) {
            let job = match next.take() {
                Some(job) => job,
                None => match rx.try_recv() {
                    Ok(Message::Job(job)) => *job,
                    Ok(other) => {
                        deferred.push_back(other);
                        break;
                    }
                    Err(_) => break,
                },
            };
            if !batch.is_empty() && batch.kv_tokens_with(kv_tokens_asked(engine, info, &job)) > share {
                next = Some(job);
                break;
            }
            waiting.fetch_sub(1, Ordering::SeqCst);
            // Cleared before the job starts: its client hears of its prefill inside `add`, and
            // may ask the status right then.
            metrics.waiting_for_memory.store(false, Ordering::Relaxed);
            match start_job(engine, info, metrics, scripted, job, true) {
                Ok((l, generation)) => add(l, generation, &mut batch, &mut live),
                Err(used) => engine.after_request(used),
            }
        }
        metrics.waiting_for_memory.store(next.is_some(), Ordering::Relaxed);
        if batch.is_empty() {
            break;
        }
        metrics.batch_size.store(batch.len(), Ordering::Relaxed);
        metrics.prefilling.store(batch.prefilling().0, Ordering::Relaxed);
        for (id, event) in batch.step() {
            let Some(l) = live.get_mut(&id) else { continue };
            if let Some(used) = on_event(l, engine, metrics, event) {
                if let Some(done) = live.remove(&id) {
                    if let Ok(mut r) = running.lock() {
                        r.retain(|c| !c.same_as(&done.job.cancel));
                    }
                }
                engine.after_request(used);
            }
        }
    }
    metrics.batch_size.store(0, Ordering::Relaxed);
    metrics.prefilling.store(0, Ordering::Relaxed);
}

/// The most tokens of KV cache `job` may take, as far as can be told before its prompt is
/// rendered: its prompt's least token count and the answer it asks (within the context and the
/// server's cap).
fn kv_tokens_asked(engine: &Engine, info: &ModelInfo, job: &Job) -> usize {
    let prompt = engine.tokenizer().at_least_tokens(job.prompt.text_bytes());
    let answer = job.request.max_tokens.min(info.max_output_tokens.unwrap_or(usize::MAX));
    prompt.saturating_add(answer).min(info.context)
}

/// Clears a flag when dropped (however the job ends).
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// A submitted job whose prompt was accepted: its events, and a guard that cancels it when
/// dropped (the response, or the stream a disconnected client leaves behind).
pub struct Running {
    pub events: tmpsc::UnboundedReceiver<JobEvent>,
    /// Told of each event the client takes.
    pub backlog: Arc<crate::backlog::Backlog>,
    pub prompt_tokens: usize,
    /// The most tokens it will generate, and the request's own number when that was more.
    pub max_tokens: usize,
    pub clamped: Option<Clamp>,
    pub guard: CancelOnDrop,
}

pub struct CancelOnDrop(pub CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Turns the model's text into answer deltas: reasoning split off, tool calls parsed out
/// (when tools were offered); keeps the reasoning to count its tokens at the end.
struct AnswerStream {
    splitter: ThinkSplitter,
    tools: Option<ToolCallParser>,
    reasoning: String,
}

impl AnswerStream {
    /// `tools`: the tools the prompt offered, if any (their answers are searched for calls).
    fn new(thinking: bool, tools: Option<&[serde_json::Value]>) -> Self {
        AnswerStream {
            splitter: ThinkSplitter::new(thinking),
            tools: tools.map(ToolCallParser::for_tools),
            reasoning: String::new(),
        }
    }

    /// The delta for more text, if it adds anything.
    fn push(&mut self, text: &str) -> Option<JobEvent> {
        let s = self.splitter.push(text);
        self.delta(s.content, s.reasoning, false)
    }

    /// The rest at the end of the answer.
    fn finish(&mut self) -> Option<JobEvent> {
        let s = self.splitter.finish();
        self.delta(s.content, s.reasoning, true)
    }

    fn delta(&mut self, content: String, reasoning: String, last: bool) -> Option<JobEvent> {
        self.reasoning.push_str(&reasoning);
        let Parsed { text: mut content, calls: mut tool_calls } = match &mut self.tools {
            Some(p) => p.push(&content),
            None => Parsed { text: content, calls: vec![] },
        };
        if let (true, Some(p)) = (last, &mut self.tools) {
            let rest = p.finish();
            content.push_str(&rest.text);
            tool_calls.extend(rest.calls);
        }
        let empty = content.is_empty() && reasoning.is_empty() && tool_calls.is_empty();
        (!empty).then_some(JobEvent::Delta { content, reasoning, tool_calls })
    }
}
