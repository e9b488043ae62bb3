//! The engine runs on one thread of its own (MLX state stays on it; the thread is reused by
//! the next engine, see `engine_threads.rs`); requests reach it as
//! jobs through a FIFO queue and answer through a channel of events. A job whose client has
//! gone is cancelled at its next token, and its cache is dropped with it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use engine::batch_rule::BatchRule;
use engine::{CancelToken, GenerateRequest, Profile};
use tokio::sync::mpsc as tmpsc;

use crate::engine_thread::{self, Idle, Loading, Shared};
use crate::job::{CancelOnDrop, Job, JobError, JobEvent, Message, Prompt, Running, TuneJob};
pub use crate::lifecycle::{IdleAction, Lifecycle, HEARTBEAT};
use crate::metrics::Metrics;
use crate::model_info::{Facts, ModelInfo};
use crate::scripted::ScriptedReplies;

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
    /// A DFlash block drafter's folder, loaded beside the model (`EngineOptions::drafter`).
    pub drafter: Option<PathBuf>,
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

/// Jobs that may wait for the engine by default: several agents' turns, not a flood.
pub const MAX_QUEUED_JOBS: usize = 64;

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
            drafter,
        } = options;
        let mut profile = profile;
        if split.is_some() {
            profile.max_sequences = 1;
        }
        let group = split.as_ref().map(|s| s.group.clone());
        let loading = Loading { dir, profile, group, prompt_disk, fixed_depth, drafter };
        let facts = Facts {
            id,
            max_output_tokens,
            memory_budget,
            split: split.as_ref().map(|s| (s.hosts.clone(), s.backend.clone())),
        };
        // A split model stays loaded: its other ranks hold their parts as long as rank 0 does.
        let idle = Idle { limit: if split.is_some() { None } else { idle }, action: on_idle };
        let shared = Shared {
            queue_depth: Arc::new(AtomicUsize::new(0)),
            lifecycle: Arc::new(Lifecycle::new(idle.limit, on_idle, stop)),
            metrics: Arc::new(Metrics::new()),
            running: Default::default(),
            stopping: Arc::new(AtomicBool::new(false)),
            batch_rule: Arc::new(std::sync::RwLock::new(batch_rule)),
        };
        let (jobs, rx) = mpsc::channel::<Message>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread_shared = shared.clone();
        let finished = crate::engine_threads::run(move || {
            engine_thread::run(loading, facts, idle, scripted, thread_shared, rx, ready_tx)
        })?;
        let info = ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine thread stopped while loading"))??;
        Ok(Worker {
            jobs: std::sync::Mutex::new(Some(jobs)),
            current: shared.running,
            stopping: shared.stopping,
            finished,
            queue_depth: shared.queue_depth,
            max_queued: max_queued.unwrap_or(MAX_QUEUED_JOBS),
            client_stall: client_stall.unwrap_or(crate::backlog::STALL),
            info,
            lifecycle: shared.lifecycle,
            metrics: shared.metrics,
            batch_rule: shared.batch_rule,
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
