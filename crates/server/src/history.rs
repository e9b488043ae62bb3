//! The live window's history: one sample a second of what the window charts — speed (all
//! requests and each one), a finished request's prefill speed, memory, pressure, thermal
//! state, fans and temperatures — for the last 15 minutes, kept by the server so that a page
//! that reloads (or a window opened later) sees what happened before it came. `/v1/events`
//! sends it all on connect, then each new sample with the status.
//!
//! The sampler is a task on the server's runtime, not a thread of its own: it reads MLX's
//! allocator counters, which must not be touched while MLX's statics are torn down at exit.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::Loaded;

/// Samples kept: 15 minutes at one a second.
pub const KEEP: usize = 900;

/// What the window charts at one moment.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    /// Milliseconds since the Unix epoch.
    pub t_ms: u64,
    /// Tokens a second since the last sample, all requests together.
    pub tokens_per_s: f64,
    /// Each request generating now: its rate over its last tokens.
    pub streams: Vec<f64>,
    /// The prompt tokens a second of the request that finished since the last sample, if one did.
    pub prefill_tps: Option<f64>,
    pub mlx_active_bytes: u64,
    pub mlx_cache_bytes: u64,
    /// What the prompt cache holds in memory.
    pub prompt_cache_bytes: u64,
    pub process_bytes: Option<u64>,
    pub system_used_bytes: u64,
    /// As in the telemetry: PSI stall percent (Linux) or the kernel's level (macOS).
    pub pressure: Option<f64>,
    pub thermal_state: Option<String>,
    /// Each fan's speed, in the order the telemetry lists the fans.
    pub fans_rpm: Vec<u64>,
    /// Each sensor's temperature, in the telemetry's order.
    pub temperatures_c: Vec<f64>,
}

#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
    started: AtomicBool,
}

impl History {
    /// Adds a sample, dropping the oldest beyond [`KEEP`].
    pub fn push(&self, sample: Sample) {
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.push_back(sample);
        while samples.len() > KEEP {
            samples.pop_front();
        }
    }

    /// Every sample kept, oldest first.
    pub fn all(&self) -> Vec<Sample> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }

    pub fn latest(&self) -> Option<Sample> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner()).back().cloned()
    }
}

/// What the sampler needs of the server's state, held weakly: it stops once the server is gone.
pub struct Sources {
    pub model: Weak<RwLock<Arc<Loaded>>>,
    pub telemetry: Weak<telemetry::Sampler>,
    pub history: Weak<History>,
}

/// Starts sampling once a second on the current tokio runtime (once per history; without a
/// runtime nothing is sampled).
pub fn start(sources: Sources) {
    let Some(history) = sources.history.upgrade() else { return };
    if history.started.swap(true, Ordering::SeqCst) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        history.started.store(false, Ordering::SeqCst);
        return;
    };
    drop(history);
    runtime.spawn(async move {
        let mut counter = Counter::default();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (Some(model), Some(telemetry), Some(history)) =
                (sources.model.upgrade(), sources.telemetry.upgrade(), sources.history.upgrade())
            else {
                return;
            };
            let loaded = model.read().unwrap_or_else(|e| e.into_inner()).clone();
            history.push(counter.sample(&loaded.worker.metrics, &telemetry));
        }
    });
}

/// The counters the last sample saw, for rates since then.
#[derive(Default)]
struct Counter {
    /// The metrics it read (a model switch brings new ones), its token count and finished
    /// requests then, and when.
    last: Option<(usize, u64, u64, Instant)>,
}

impl Counter {
    fn sample(&mut self, metrics: &Arc<crate::metrics::Metrics>, telemetry: &telemetry::Sampler) -> Sample {
        let which = Arc::as_ptr(metrics) as usize;
        let tokens = metrics.tokens.load(Ordering::Relaxed);
        let finished = metrics.finished.load(Ordering::Relaxed);
        let now = Instant::now();
        let (tokens_per_s, prefill_tps) = match self.last {
            Some((seen, before, done, at)) if seen == which && tokens >= before => {
                let rate = (tokens - before) as f64 / now.duration_since(at).as_secs_f64().max(1e-3);
                (rate, (finished > done).then(|| metrics.live().last_prompt_tps))
            }
            _ => (0.0, None),
        };
        self.last = Some((which, tokens, finished, now));
        let snap = telemetry.latest();
        let mlx = engine::memory::mlx_memory();
        let round = |x: f64| (x * 10.0).round() / 10.0;
        Sample {
            t_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            tokens_per_s: round(tokens_per_s),
            streams: metrics.streams().iter().map(|s| s.tokens_per_s).collect(),
            prefill_tps: prefill_tps.map(round),
            mlx_active_bytes: mlx.active,
            mlx_cache_bytes: mlx.cache,
            prompt_cache_bytes: metrics.prompt_cache().bytes as u64,
            process_bytes: snap.memory.process_resident_bytes,
            system_used_bytes: snap.memory.system_used_bytes,
            pressure: snap.memory.pressure,
            thermal_state: snap.thermal.state.clone(),
            fans_rpm: snap.thermal.fans.iter().map(|f| f.rpm).collect(),
            temperatures_c: snap.thermal.temperatures.iter().map(|t| round(t.celsius)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU seconds this thread has used (`/proc/thread-self/stat`: utime and stime, in ticks of
    /// 1/100 s), so other tests' threads do not count.
    fn thread_cpu_seconds() -> f64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        let tick = |i: usize| fields.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
        (tick(11) + tick(12)) / 100.0
    }

    #[test]
    fn a_sample_costs_well_under_ten_milliseconds_of_cpu() {
        let metrics = Arc::new(crate::metrics::Metrics::new());
        for id in 0..8 {
            metrics.stream_started(id);
            metrics.stream_token(id);
        }
        let telemetry = telemetry::Sampler::start(Duration::from_secs(3600));
        let mut counter = Counter::default();
        let cpu = thread_cpu_seconds();
        for _ in 0..500 {
            metrics.tokens.fetch_add(3, Ordering::Relaxed);
            let s = counter.sample(&metrics, &telemetry);
            assert_eq!(s.streams.len(), 8);
        }
        let per_sample = (thread_cpu_seconds() - cpu) / 500.0;
        // The sampler takes one a second: 10 ms would be 1% of a core.
        assert!(per_sample < 0.002, "{per_sample} s of CPU per sample");
    }

    #[test]
    fn the_history_keeps_the_last_fifteen_minutes_and_stays_small() {
        let h = History::default();
        for i in 0..2 * KEEP as u64 {
            h.push(Sample {
                t_ms: i * 1000,
                tokens_per_s: 123.4,
                streams: vec![41.1; 8],
                prefill_tps: Some(1234.5),
                mlx_active_bytes: u64::MAX,
                mlx_cache_bytes: u64::MAX,
                prompt_cache_bytes: u64::MAX,
                process_bytes: Some(u64::MAX),
                system_used_bytes: u64::MAX,
                pressure: Some(12.5),
                thermal_state: Some("serious".into()),
                fans_rpm: vec![6000; 2],
                temperatures_c: vec![88.8; 4],
            });
        }
        let all = h.all();
        assert_eq!(all.len(), KEEP);
        assert_eq!(all[0].t_ms, KEEP as u64 * 1000, "the oldest go first");
        // What a page receives on connect, at its largest: under half a megabyte.
        let bytes = serde_json::to_string(&all).unwrap().len();
        assert!(bytes < 512 * 1024, "{bytes} bytes");
    }
}
