//! Whether the model is in memory, what the idle watchdog does, and how often it unloaded and
//! reloaded the model: read by the status pages, kept by the engine thread.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

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

/// How often an idle split model's worker checks its ranks.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

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
    pub(crate) fn new(idle_limit: Option<Duration>, on_idle: IdleAction, stop: Arc<tokio::sync::Notify>) -> Self {
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

    pub(crate) fn touch(&self) {
        if let Ok(mut t) = self.last_active.lock() {
            *t = std::time::Instant::now();
        }
    }

    /// Time since the engine last worked.
    pub fn idle_for(&self) -> Duration {
        self.last_active.lock().map(|t| t.elapsed()).unwrap_or_default()
    }
}
