//! Reads the figures on a thread of its own at a fixed interval, so that readers (the status
//! page, the app's live stream) get the latest snapshot without touching the system.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::memory::{self, Memory};
use crate::thermal::{self, Thermal};

/// Everything at one moment.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    /// Milliseconds since the Unix epoch.
    pub taken_at_ms: u64,
    pub memory: Memory,
    pub thermal: Thermal,
}

pub struct Sampler {
    latest: Arc<Mutex<Snapshot>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Sampler {
    /// Starts sampling every `interval` (the first snapshot is taken before this returns).
    pub fn start(interval: Duration) -> Sampler {
        let latest = Arc::new(Mutex::new(Snapshot::default()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut sys = sysinfo::System::new().ok();
        *latest.lock().unwrap_or_else(|e| e.into_inner()) = take(&mut sys);
        let (out, quit) = (latest.clone(), stop.clone());
        let spawned = std::thread::Builder::new().name("ferrite-telemetry".into()).spawn(move || {
            while !quit.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(interval);
                let snap = take(&mut sys);
                *out.lock().unwrap_or_else(|e| e.into_inner()) = snap;
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("telemetry sampling thread did not start: {e}; figures stay at their first reading");
        }
        Sampler { latest, stop }
    }

    pub fn latest(&self) -> Snapshot {
        self.latest.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

fn take(sys: &mut Option<sysinfo::System>) -> Snapshot {
    let memory = match sys {
        Some(s) => memory::read(s),
        None => memory::Memory::default(),
    };
    Snapshot {
        taken_at_ms: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
        memory,
        thermal: thermal::read(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_refresh_and_cost_little() {
        let started = std::time::Instant::now();
        let cpu = cpu_seconds();
        let s = Sampler::start(Duration::from_millis(50));
        let first = s.latest();
        assert!(first.memory.system_total_bytes > 0);
        std::thread::sleep(Duration::from_millis(1000));
        assert!(s.latest().taken_at_ms > first.taken_at_ms);
        drop(s);
        // 20 samples a second here; the app takes one: the cost per sample must be well under
        // 1% of a core at one a second (10 ms).
        let per_sample = (cpu_seconds() - cpu) / 20.0;
        assert!(per_sample < 0.01, "{per_sample} s of CPU per sample ({:?} elapsed)", started.elapsed());
    }

    fn cpu_seconds() -> f64 {
        // /proc/self/stat fields 14 and 15: user and system time in clock ticks (100 Hz).
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        // After the command name: state is field 3, so utime (14) and stime (15) sit at 11, 12.
        let tick = |i: usize| fields.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
        (tick(11) + tick(12)) / 100.0
    }
}
