//! The engine runs on one thread of its own (MLX state stays on it; the thread is reused by
//! the next engine, see `engine_threads.rs`); requests reach it as
//! jobs through a FIFO queue and answer through a channel of events. A job whose client has
//! gone is cancelled at its next token, and its cache is dropped with it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use engine::batch_rule::BatchRule;
use engine::{CancelToken, Engine, GenerateRequest, Profile};
use tokio::sync::mpsc as tmpsc;

use crate::job::{CancelOnDrop, Job, JobError, JobEvent, Message, Prompt, Running, TuneJob};
use crate::job_run::{run_batch, run_job, start_job, Queue, Solo};
use crate::metrics::Metrics;
use crate::model_info::ModelInfo;
use crate::scripted::ScriptedReplies;
use crate::tool_choice::CallSyntax;

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

fn run_tune(engine: &Engine, tune: &mut TuneJob, stopping: &AtomicBool) -> Result<engine::tune::Measurement, String> {
    let mut busy = telemetry::machine::BusyCheck::new(tune.busy_percent);
    let progress = |p: &engine::tune::Progress| !stopping.load(Ordering::SeqCst) && (tune.progress)(p);
    engine::tune::measure(engine, &tune.options, || busy.check(), progress).map_err(|e| e.to_string())
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
                let options = crate::engine_options::from_env(profile.clone(), group.clone())?;
                Engine::load_with(&dir, &options)
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
