//! The engine thread's side of the worker: it loads the model, then takes the worker's
//! messages in order — a job (alone, or starting a batch that later jobs join), a tune, an
//! unload — and looks after the model between them: the idle watchdog, a split model's
//! heartbeat, reloading a model the watchdog unloaded.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;

use engine::batch_rule::BatchRule;
use engine::distributed::Group;
use engine::{CancelToken, Engine, Profile};

use crate::job::{Job, JobError, JobEvent, Message, TuneJob};
use crate::job_run::{run_batch, run_job, start_job, Queue, Solo};
use crate::lifecycle::{IdleAction, Lifecycle, HEARTBEAT};
use crate::metrics::Metrics;
use crate::model_info::{Facts, ModelInfo};
use crate::scripted::ScriptedReplies;

/// How the engine thread loads its model (again, after the idle watchdog unloaded it).
pub(crate) struct Loading {
    pub dir: PathBuf,
    pub profile: Profile,
    /// The group a split model spans (rank 0 serving).
    pub group: Option<Arc<Group>>,
    /// The prompt cache's disk tier (a folder that cannot be used leaves memory only).
    pub prompt_disk: Option<engine::prompt_cache::DiskSettings>,
    /// Keep each request's draft depth as asked (no runtime depth controller).
    pub fixed_depth: bool,
    /// A block drafter loaded beside the model.
    pub drafter: Option<PathBuf>,
}

impl Loading {
    fn load(&self) -> engine::Result<Engine> {
        let mut options = crate::engine_options::from_env(self.profile.clone(), self.group.clone())?;
        options.drafter = self.drafter.clone();
        let mut engine = Engine::load_with(&self.dir, &options)?;
        if self.group.is_some() {
            return Ok(engine);
        }
        if let Some(settings) = &self.prompt_disk {
            if let Err(e) = engine.set_prompt_disk(settings) {
                tracing::warn!("the prompt cache stays in memory: {e}");
            }
        }
        if let Err(e) = engine.set_depth_control(!self.fixed_depth) {
            tracing::warn!("the draft depth stays as asked (no runtime controller): {e}");
        }
        Ok(engine)
    }
}

/// What the worker and its engine thread both hold.
#[derive(Clone)]
pub(crate) struct Shared {
    /// Jobs queued and not yet taken.
    pub queue_depth: Arc<AtomicUsize>,
    pub lifecycle: Arc<Lifecycle>,
    pub metrics: Arc<Metrics>,
    /// The running jobs' cancel tokens (so shutdown can stop them).
    pub running: Arc<Mutex<Vec<CancelToken>>>,
    /// Set by shutdown: a running tune stops at its next run.
    pub stopping: Arc<AtomicBool>,
    pub batch_rule: Arc<RwLock<BatchRule>>,
}

/// The watchdog's settings.
pub(crate) struct Idle {
    pub limit: Option<Duration>,
    pub action: IdleAction,
}

struct EngineThread {
    loading: Loading,
    info: ModelInfo,
    engine: Option<Engine>,
    rx: mpsc::Receiver<Message>,
    /// Messages that came while a batch ran, before the channel's.
    deferred: VecDeque<Message>,
    shared: Shared,
    idle: Idle,
    scripted: Option<Arc<ScriptedReplies>>,
}

/// The engine thread's body: loads the model and says so on `ready` (or why it could not),
/// then serves the worker's messages until the worker goes; the model goes with it.
pub(crate) fn run(
    loading: Loading,
    facts: Facts,
    idle: Idle,
    scripted: Option<Arc<ScriptedReplies>>,
    shared: Shared,
    rx: mpsc::Receiver<Message>,
    ready: mpsc::Sender<anyhow::Result<ModelInfo>>,
) {
    let engine = match loading.load() {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(anyhow::anyhow!("loading {}: {e}", loading.dir.display())));
            return;
        }
    };
    let info = ModelInfo::of(&engine, facts, loading.dir.clone(), loading.profile.clone());
    if loading.group.is_some() {
        shared.metrics.set_ranks(engine.rank_memory());
    }
    shared.lifecycle.loaded.store(true, Ordering::SeqCst);
    shared.metrics.set_prompt_cache(engine.prompt_cache_stats());
    let _ = ready.send(Ok(info.clone()));
    let mut thread =
        EngineThread { loading, info, engine: Some(engine), rx, deferred: VecDeque::new(), shared, idle, scripted };
    while let Some(message) = thread.next_message() {
        match message {
            Message::Job(job) => thread.serve(*job),
            Message::Unload => thread.unload("asked to stop"),
            Message::Tune(tune) => thread.tune(tune),
        }
    }
}

impl EngineThread {
    fn split(&self) -> bool {
        self.loading.group.is_some()
    }

    /// The next message, once there is one (`None`: the worker is gone). Meanwhile a split
    /// model checks its ranks every [`HEARTBEAT`], and a loaded model idle past the
    /// watchdog's limit is unloaded.
    fn next_message(&mut self) -> Option<Message> {
        loop {
            if let Some(message) = self.deferred.pop_front() {
                return Some(message);
            }
            let wait = match (self.split(), self.idle.limit, &self.engine) {
                (true, _, _) => Some(HEARTBEAT),
                (false, Some(limit), Some(_)) => Some(limit),
                _ => None,
            };
            let Some(wait) = wait else { return self.rx.recv().ok() };
            match self.rx.recv_timeout(wait) {
                Ok(message) => return Some(message),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) if self.split() => {
                    if let Some(engine) = &self.engine {
                        self.shared.metrics.set_ranks(engine.rank_memory());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.unload(&format!("idle for {wait:?}"));
                    if self.idle.action == IdleAction::Stop {
                        tracing::info!("idle action is `stop`: asking the server to shut down");
                        self.shared.lifecycle.stop_requested.notify_one();
                    }
                }
            }
        }
    }

    /// Drops the model and MLX's buffer cache, so the memory really returns.
    fn unload(&mut self, why: &str) {
        if self.engine.take().is_some() {
            engine::memory::clear_cache();
            self.shared.lifecycle.loaded.store(false, Ordering::SeqCst);
            self.shared.lifecycle.unloads.fetch_add(1, Ordering::SeqCst);
            tracing::info!("{why}: unloaded {} and released MLX's cache", self.info.id);
        }
    }

    /// The model, loaded again if the watchdog had unloaded it.
    fn loaded(&mut self) -> Result<&Engine, String> {
        if self.engine.is_none() {
            let engine = self.loading.load().map_err(|e| format!("reloading the model: {e}"))?;
            tracing::info!("reloaded {} for a new request", self.info.id);
            self.shared.lifecycle.loaded.store(true, Ordering::SeqCst);
            self.shared.lifecycle.reloads.fetch_add(1, Ordering::SeqCst);
            self.engine = Some(engine);
        }
        self.engine.as_ref().ok_or_else(|| "the model is not loaded".to_string())
    }

    fn tune(&mut self, mut tune: TuneJob) {
        let stopping = self.shared.stopping.clone();
        let result = self.loaded().and_then(|engine| run_tune(engine, &mut tune, &stopping));
        let _ = tune.reply.send(result);
        self.shared.lifecycle.touch();
    }

    /// Runs `job`: alone a request speculates as it asks; when it would decode plainly anyway,
    /// or with others waiting where batching them beats its tuned speed-up, it runs in a batch
    /// that later ones join (a speculating one joins it between cycles when enough others
    /// come: `run_job`).
    fn serve(&mut self, job: Job) {
        self.shared.queue_depth.fetch_sub(1, Ordering::SeqCst);
        if let Err(e) = self.loaded() {
            let _ = job.events.send(JobEvent::Failed(JobError::Internal(e)));
            return;
        }
        let split = self.split();
        let EngineThread { engine: Some(engine), info, shared, scripted, rx, deferred, .. } = self else { return };
        let (metrics, scripted, depth) = (&*shared.metrics, scripted.as_deref(), &*shared.queue_depth);
        let rule = shared.batch_rule.read().map(|r| r.clone()).unwrap_or_default();
        let waiting = depth.load(Ordering::SeqCst);
        let together = info.profile.max_sequences > 1
            && (job.request.draft_depth == 0 || (waiting > 0 && rule.batch_pays(1 + waiting, rule.tuned_speedup)));
        let first = if together {
            match start_job(engine, info, metrics, scripted, job, true) {
                Ok(started) => Some(started),
                Err(used) => {
                    engine.after_request(used);
                    None
                }
            }
        } else {
            if let Ok(mut c) = shared.running.lock() {
                *c = vec![job.cancel.clone()];
            }
            match run_job(engine, info, &rule, metrics, scripted, job, depth) {
                Solo::Ended(used) => {
                    engine.after_request(used);
                    None
                }
                Solo::Joins(started) => Some(*started),
            }
        };
        if let Some(first) = first {
            let queue = Queue { rx, waiting: depth, deferred };
            run_batch(engine, info, metrics, scripted, first, queue, &shared.running);
        }
        if let Ok(mut c) = shared.running.lock() {
            c.clear();
        }
        metrics.set_prompt_cache(engine.prompt_cache_stats());
        if split {
            metrics.set_ranks(engine.rank_memory());
        }
        shared.lifecycle.touch();
    }
}

fn run_tune(engine: &Engine, tune: &mut TuneJob, stopping: &AtomicBool) -> Result<engine::tune::Measurement, String> {
    let mut busy = telemetry::machine::BusyCheck::new(tune.busy_percent);
    let progress = |p: &engine::tune::Progress| !stopping.load(Ordering::SeqCst) && (tune.progress)(p);
    engine::tune::measure(engine, &tune.options, || busy.check(), progress).map_err(|e| e.to_string())
}
