//! What kind of machine this is (for the tuner's key), and whether other programs are busy
//! on it (a tuner measuring while another job runs would store a wrong answer).

use std::collections::HashMap;
use std::time::Instant;

use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

/// The facts that decide how fast a model runs here, besides the model and the software.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineFacts {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub os: String,
}

pub fn facts() -> MachineFacts {
    let (cpu, cores, memory_gib) = match System::new() {
        Ok(mut sys) => {
            sys.refresh_cpu_all();
            sys.refresh_memory();
            let cpu = sys.cpus().first().map(|c| c.brand().trim().to_string()).unwrap_or_else(|| "unknown cpu".into());
            (cpu, sys.cpus().len(), (sys.total_memory() as f64 / (1u64 << 30) as f64).round())
        }
        Err(_) => ("unknown cpu".into(), 0, 0.0),
    };
    let os = System::long_os_version().unwrap_or_else(|_| std::env::consts::OS.into());
    MachineFacts { cpu, cores, memory_gib, os }
}

/// Another process using more than this share of one core (percent) makes the machine too
/// busy to measure on (the tuner's default, for the CLI and the app alike).
pub const DEFAULT_BUSY_PERCENT: f32 = 50.0;

/// Watches for other programs using the CPU: each look compares every process's CPU time
/// with the previous look's (sysinfo's own per-process percentage reads 0 on Linux unless
/// the machine-wide counters were refreshed in step with it; the difference of CPU times
/// needs nothing else).
pub struct BusyCheck {
    /// `None` where sysinfo cannot read processes (then nothing is reported busy).
    sys: Option<System>,
    me: Pid,
    /// Percent of one core.
    threshold: f32,
    /// CPU milliseconds of each process at the last look, and when that was.
    last: HashMap<Pid, u64>,
    last_at: Instant,
}

impl BusyCheck {
    /// `threshold`: percent of one core another process may use before the machine is busy.
    pub fn new(threshold: f32) -> Self {
        let sys = System::new().ok();
        if sys.is_none() {
            tracing::warn!("cannot read the process list: other programs' load goes unchecked");
        }
        let mut check = BusyCheck {
            sys,
            me: Pid::from_u32(std::process::id()),
            threshold,
            last: HashMap::new(),
            last_at: Instant::now(),
        };
        check.look();
        check
    }

    /// Reads every process's CPU time; returns (pid, name, percent of a core since the last look).
    fn look(&mut self) -> Vec<(Pid, String, f32)> {
        let Some(sys) = self.sys.as_mut() else { return vec![] };
        sys.refresh_processes_specifics(ProcessesToUpdate::All, true, ProcessRefreshKind::nothing().with_cpu());
        let elapsed_ms = self.last_at.elapsed().as_secs_f64() * 1e3;
        self.last_at = Instant::now();
        let mut usage = Vec::new();
        let mut now = HashMap::new();
        for (pid, p) in sys.processes() {
            // Threads are listed as tasks too: ours would count as "another program".
            if *pid == self.me || p.thread_kind().is_some() {
                continue;
            }
            let cpu_ms = p.accumulated_cpu_time();
            if let Some(before) = self.last.get(pid) {
                let percent = (cpu_ms.saturating_sub(*before) as f64 / elapsed_ms.max(1.0) * 100.0) as f32;
                usage.push((*pid, p.name().to_string_lossy().into_owned(), percent));
            }
            now.insert(*pid, cpu_ms);
        }
        self.last = now;
        usage
    }

    /// The busiest other process, if it used more than the threshold since the last look.
    pub fn check(&mut self) -> Option<String> {
        let threshold = self.threshold;
        self.look()
            .into_iter()
            .filter(|(_, _, cpu)| *cpu > threshold)
            .max_by(|a, b| a.2.total_cmp(&b.2))
            .map(|(pid, name, cpu)| format!("process `{name}` (pid {pid}) used {cpu:.0}% of a core"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_name_this_machine() {
        let f = facts();
        assert!(f.cores > 0 && f.memory_gib > 0.0, "{f:?}");
        assert!(!f.os.is_empty());
    }

    #[test]
    fn a_spinning_process_makes_the_machine_busy() {
        let mut child = std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().expect("sh");
        std::thread::sleep(std::time::Duration::from_millis(100));
        let mut busy = BusyCheck::new(50.0);
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let seen = busy.check();
        let _ = child.kill();
        let _ = child.wait();
        // The busiest other process is named: the spinning shell, or one busier still on a
        // machine that is busy anyway (tests run beside other work).
        assert!(seen.as_deref().is_some_and(|s| s.contains("used") && s.contains("% of a core")), "{seen:?}");
    }

    #[test]
    fn an_idle_machine_is_not_busy_at_a_high_threshold() {
        let mut busy = BusyCheck::new(10_000.0);
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(busy.check(), None);
    }
}
