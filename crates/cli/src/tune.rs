//! `ferrite tune`: measures plain decoding and each MTP draft depth on this machine, and
//! stores the winner for (machine, model, profile) only when the measurement can be trusted.
//! `--draft-depth auto` (serve, generate) reads what was stored, the same way everywhere.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use engine::tune::{self, TuneOptions, Verdict};
use engine::{Engine, Profile, ProfileName};
use store::tuning::{model_identity, TunedResult, TuningFile, TuningKey};

#[derive(clap::Args)]
pub struct Args {
    /// Model: a folder, a catalog id or alias, a registered id, or a repository.
    #[arg(long, short, default_value = "default")]
    model: String,
    #[arg(long, env = "FERRITE_PROFILE", default_value = "sustained")]
    profile: ProfileName,
    /// List the stored results instead.
    #[arg(long)]
    show: bool,
    /// New tokens per generation.
    #[arg(long, default_value_t = 96)]
    tokens: usize,
    /// Timed repetitions of the prompt suite per candidate (after one discarded pass).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Prompts of the suite to use (1 to 4).
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Largest spread between repetitions (percent of the median) that is still trusted.
    #[arg(long, default_value_t = 15.0)]
    max_spread: f64,
    /// Another process using more than this share of a core (percent) makes the machine busy.
    #[arg(long, default_value_t = 50.0)]
    busy_percent: f32,
}

/// This machine as the tuning file keys it.
pub fn machine_fingerprint() -> String {
    let (cpu, cores, gib) = match sysinfo::System::new() {
        Ok(mut sys) => {
            sys.refresh_cpu_all();
            sys.refresh_memory();
            let cpu = sys.cpus().first().map(|c| c.brand().trim().to_string()).unwrap_or_else(|| "unknown cpu".into());
            (cpu, sys.cpus().len(), (sys.total_memory() as f64 / (1u64 << 30) as f64).round())
        }
        Err(_) => ("unknown cpu".into(), 0, 0.0),
    };
    let os = sysinfo::System::long_os_version().unwrap_or_else(|_| std::env::consts::OS.into());
    format!(
        "{cpu} ({cores} cores), {gib} GiB, {os}, MLX {} on {}, ferrite {}",
        engine::device::mlx_version(),
        engine::device::backend(),
        env!("CARGO_PKG_VERSION")
    )
}

fn key(dir: &Path, profile: ProfileName) -> TuningKey {
    TuningKey { machine: machine_fingerprint(), model: model_identity(dir), profile: profile.to_string() }
}

/// The stored depth for this machine, model folder and profile, with where it came from.
pub fn stored_depth(dir: &Path, profile: ProfileName) -> (usize, String) {
    let (file, warning) = TuningFile::load(&store::config::config_dir());
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    match file.find(&key(dir, profile)) {
        Some(r) => (r.depth, format!("tuned ({}; `ferrite tune --show`)", r.why)),
        None => (0, "untuned: plain decoding (`ferrite tune` measures this machine)".into()),
    }
}

/// `--draft-depth`: a number, or `auto` for the stored result.
pub fn draft_depth(arg: &str, dir: &Path, profile: ProfileName) -> Result<(usize, String)> {
    if arg == "auto" {
        return Ok(stored_depth(dir, profile));
    }
    let depth: usize = arg.parse().map_err(|_| anyhow::anyhow!("--draft-depth: `{arg}` is neither a number nor `auto`"))?;
    anyhow::ensure!(depth <= engine::speculative::MAX_DRAFT_DEPTH, "--draft-depth: at most {}", engine::speculative::MAX_DRAFT_DEPTH);
    Ok((depth, "given on the command line".into()))
}

/// Watches for other programs using the CPU while the tuner measures.
struct BusyCheck {
    /// `None` where sysinfo cannot read processes (then nothing is reported busy).
    sys: Option<sysinfo::System>,
    me: sysinfo::Pid,
    threshold: f32,
}

impl BusyCheck {
    fn new(threshold: f32) -> Self {
        let mut sys = sysinfo::System::new().ok();
        if let Some(s) = &mut sys {
            s.refresh_processes(sysinfo::ProcessesToUpdate::All, true);
        } else {
            eprintln!("warning: cannot read the process list: other programs' load goes unchecked");
        }
        BusyCheck { sys, me: sysinfo::Pid::from_u32(std::process::id()), threshold }
    }

    /// The busiest other process, if it used more than the threshold since the last look.
    fn check(&mut self) -> Option<String> {
        let sys = self.sys.as_mut()?;
        sys.refresh_processes(sysinfo::ProcessesToUpdate::All, true);
        sys
            .processes()
            .iter()
            // Threads are listed as tasks too: ours would count as "another program".
            .filter(|(pid, p)| **pid != self.me && p.thread_kind().is_none())
            .map(|(pid, p)| (pid, p.name().to_string_lossy().into_owned(), p.cpu_usage()))
            .filter(|(_, _, cpu)| *cpu > self.threshold)
            .max_by(|a, b| a.2.total_cmp(&b.2))
            .map(|(pid, name, cpu)| format!("process `{name}` (pid {pid}) used {cpu:.0}% of a core"))
    }
}

pub fn run(args: Args) -> Result<()> {
    let config_dir = store::config::config_dir();
    let (mut file, warning) = TuningFile::load(&config_dir);
    if let Some(w) = warning {
        eprintln!("warning: {w}");
    }
    if args.show {
        if file.results.is_empty() {
            println!("no tuning results in {}", file.path.display());
        }
        for r in &file.results {
            println!("{} | {} | {}: depth {} ({})", r.key.model, r.key.profile, r.key.machine, r.depth, r.why);
        }
        return Ok(());
    }
    let model = crate::models::resolve(&args.model)?;
    let engine = Engine::load_with(&model.dir, Profile::named(args.profile))?;
    let options = TuneOptions { gen_tokens: args.tokens, reps: args.reps, prompts: args.prompts, max_spread: args.max_spread / 100.0, ..TuneOptions::default() };
    let key = key(&model.dir, args.profile);
    eprintln!("tuning {} ({}) with the {} profile on {}", model.id, key.model, args.profile, key.machine);
    let mut busy = BusyCheck::new(args.busy_percent);
    let measurement = tune::measure(&engine, &options, || busy.check(), |what| eprintln!("  {what}"))?;
    println!("{:>5} {:>5} {:>10} {:>8} {:>24} {:>10} {:>8}", "depth", "temp", "tok/s", "spread", "acceptance by position", "tok/cycle", "vs plain");
    for c in &measurement.candidates {
        let acc: Vec<String> = c.acceptance.iter().map(|a| format!("{:.0}%", a * 100.0)).collect();
        let plain = measurement.get(0, c.temperature).map(|p| p.median_tps).unwrap_or(c.median_tps);
        println!("{:>5} {:>5} {:>10.1} {:>7.1}% {:>24} {:>10.2} {:>7.2}x", c.depth, c.temperature, c.median_tps, c.spread * 100.0, acc.join(" "), c.tokens_per_cycle, c.median_tps / plain.max(1e-9));
    }
    let previous = file.find(&key).map(|r| r.first_acceptance.clone());
    match tune::decide(&measurement, previous.as_deref(), &options) {
        Verdict::Refuse { why } => {
            eprintln!("not stored: {why}");
            std::process::exit(2);
        }
        Verdict::Store { depth, speedup, why } => {
            let result = TunedResult {
                key,
                depth,
                speedup,
                why: why.clone(),
                measured_at: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
                first_acceptance: measurement.first_acceptance(),
                measurement: serde_json::to_value(&measurement)?,
            };
            file.replace(result).map_err(|e| anyhow::anyhow!("{}: {e}", file.path.display()))?;
            println!("stored draft depth {depth} in {}: {why}", file.path.display());
        }
    }
    Ok(())
}
