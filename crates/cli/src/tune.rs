//! `ferrite tune`: measures plain decoding and each MTP draft depth on this machine, and
//! stores the winner for (machine, model, profile) only when the measurement can be trusted.
//! `--draft-depth auto` (serve, generate) reads what was stored, the same way everywhere.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use engine::tune::{self, TuneOptions, Verdict};
use engine::{Engine, Profile, ProfileName};
use store::tuning::{TunedResult, TuningFile};

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
    let model = server::launch::resolve(&args.model)?;
    let engine = Engine::load_with(&model.dir, Profile::named(args.profile))?;
    let options = TuneOptions { gen_tokens: args.tokens, reps: args.reps, prompts: args.prompts, max_spread: args.max_spread / 100.0, ..TuneOptions::default() };
    let key = server::launch::tuning_key(&model.dir, args.profile);
    eprintln!("tuning {} ({}) with the {} profile on {}", model.id, key.model, args.profile, key.machine);
    let mut busy = telemetry::machine::BusyCheck::new(args.busy_percent);
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
