//! `ferrite tune`: measures plain decoding, each MTP draft depth and (with the catalog's block
//! drafter installed) the drafter's block depths on this machine, and stores the winner for
//! (machine, model, profile) only when the measurement can be trusted.
//! `--draft-depth auto` (serve, generate) reads what was stored, the same way everywhere.

use anyhow::Result;
use engine::tune::{self, TuneOptions, Verdict};
use engine::workload::WorkloadClass;
use engine::{Engine, Profile, ProfileName};
use store::tuning::TuningFile;

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
    /// Paired rounds before any verdict (each: every depth once, plain decoding before and
    /// after it; more follow until the best depth is separated, or the budget ends).
    #[arg(long, alias = "reps", default_value_t = 3)]
    rounds: usize,
    /// Seconds the measuring may take (after one discarded pass) before it gives up undecided.
    #[arg(long, default_value_t = 120.0)]
    budget: f64,
    /// A DFlash block drafter's folder to measure beside the MTP head (default: the catalog's
    /// drafter for the model, when installed; a folder given by path has none).
    #[arg(long)]
    drafter: Option<std::path::PathBuf>,
    /// Prompts of the suite to use (1 to 4).
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Another process using more than this share of a core (percent) makes the machine busy.
    #[arg(long, default_value_t = telemetry::machine::DEFAULT_BUSY_PERCENT)]
    busy_percent: f32,
    /// Tune for one workload class (`code/greedy`, `code/sampled`, `prose/…`, `agent/…`: its
    /// own prompt suite at its temperature; the server then uses that depth for requests of the
    /// class), or `all` of them one after the other (each with the budget). Without it: one
    /// depth for every request, from the code suite at temperatures 0 and 0.7.
    #[arg(long)]
    class: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let config_dir = store::config::config_dir();
    let (file, warning) = TuningFile::load(&config_dir);
    if let Some(w) = warning {
        eprintln!("warning: {w}");
    }
    if args.show {
        if file.results.is_empty() {
            println!("no tuning results in {}", file.path.display());
        }
        for r in &file.results {
            let class = r.key.class.as_deref().unwrap_or("every request");
            let (model, profile, machine) = (&r.key.model, &r.key.profile, &r.key.machine);
            let choice = server::launch::stored_choice(r);
            println!("{model} | {profile} | {class} | {machine}: {choice} ({})", r.why);
        }
        return Ok(());
    }
    let classes: Vec<Option<WorkloadClass>> = match args.class.as_deref() {
        None => vec![None],
        Some("all") => WorkloadClass::ALL.into_iter().map(Some).collect(),
        Some(name) => vec![Some(WorkloadClass::parse(name).map_err(|e| anyhow::anyhow!("--class: {e}"))?)],
    };
    let model = server::launch::resolve(&args.model)?;
    let mut engine_options = server::engine_options::from_env(Profile::named(args.profile), None)?;
    // The catalog's block drafter, when installed, competes with the MTP head.
    engine_options.drafter = args.drafter.clone().or(model.drafter.clone());
    let engine = Engine::load_with(&model.dir, &engine_options)?;
    let mut refused = Vec::new();
    for class in classes {
        let options = TuneOptions {
            gen_tokens: args.tokens,
            min_rounds: args.rounds.max(2),
            budget: std::time::Duration::from_secs_f64(args.budget.clamp(1.0, 86_400.0)),
            prompts: args.prompts,
            ..TuneOptions::default()
        };
        let (options, key) = match class {
            Some(c) => (options.for_class(c), server::launch::class_tuning_key(&model.dir, args.profile, c)),
            None => (options, server::launch::tuning_key(&model.dir, args.profile)),
        };
        if let Err(why) = tune_one(&engine, &model.id, &config_dir, key, &options, &args) {
            refused.push(format!("{}: {why}", class.map_or("every request".into(), |c| c.to_string())));
        }
    }
    if !refused.is_empty() {
        eprintln!("not stored: {}", refused.join("; "));
        std::process::exit(2);
    }
    Ok(())
}

/// Measures one suite and stores its verdict; `Err` says why nothing was stored.
fn tune_one(
    engine: &Engine,
    id: &str,
    config_dir: &std::path::Path,
    key: store::tuning::TuningKey,
    options: &TuneOptions,
    args: &Args,
) -> Result<(), String> {
    let class = key.class.clone().map_or("every request".to_string(), |c| format!("the {c} class"));
    eprintln!(
        "tuning {id} ({}) for {class} with the {} profile on {}: a warm-up pass, then paired rounds for up to {:.0} s",
        key.model,
        args.profile,
        key.machine,
        options.budget.as_secs_f64()
    );
    let mut busy = telemetry::machine::BusyCheck::new(args.busy_percent);
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    // When each phase began: a fresh GPU machine compiles its kernels in the warm-up, which
    // the budget does not count; the summary line says where the time went.
    let began = std::time::Instant::now();
    let mut phases: Vec<(&'static str, f64)> = Vec::new();
    let measurement = tune::measure(
        engine,
        options,
        || busy.check(),
        |p| {
            if phases.last().map(|(phase, _)| *phase) != Some(p.phase) {
                phases.push((p.phase, began.elapsed().as_secs_f64()));
            }
            // The warm-up counts its runs; the rounds count seconds of the budget.
            if p.phase == "measuring" {
                bar.set_length(p.budget_s as u64);
                bar.set_position(p.elapsed_s as u64);
            } else {
                bar.set_length(p.steps as u64);
                bar.set_position(p.step as u64);
            }
            bar.set_prefix(p.phase);
            let rep = if p.repetition > 0 { format!(", round {}", p.repetition) } else { String::new() };
            let last = p.last_tps.map(|t| format!(" (last: {t:.1} tok/s)")).unwrap_or_default();
            bar.set_message(format!("{}, temperature {}{rep}{last}", p.choice, p.temperature));
            true
        },
    )
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    let total = began.elapsed().as_secs_f64();
    let ends = phases.iter().skip(1).map(|(_, at)| *at).chain([total]);
    let took: Vec<String> =
        phases.iter().zip(ends).map(|((phase, from), to)| format!("{phase} {:.1} s", to - from)).collect();
    println!("{:.1} s in all: {}", total, took.join(", "));
    println!(
        "{:>16} {:>5} {:>10} {:>8} {:>32} {:>10} {:>8}",
        "", "temp", "tok/s", "spread", "acceptance by position", "tok/cycle", "vs plain"
    );
    for c in &measurement.candidates {
        let acc: Vec<String> = c.acceptance.iter().map(|a| format!("{:.0}%", a * 100.0)).collect();
        let plain =
            measurement.get(engine::Speculation::PLAIN, c.temperature).map(|p| p.median_tps).unwrap_or(c.median_tps);
        println!(
            "{:>16} {:>5} {:>10.1} {:>7.1}% {:>32} {:>10.2} {:>7.2}x",
            c.choice.to_string(),
            c.temperature,
            c.median_tps,
            c.spread * 100.0,
            acc.join(" "),
            c.tokens_per_cycle,
            c.median_tps / plain.max(1e-9)
        );
    }
    println!(
        "speed-up over plain decoding, paired rounds ({} in {:.0} s), 95% interval:",
        measurement.rounds, measurement.elapsed_s
    );
    for s in &measurement.speedups {
        println!("  {}: {:.2}x [{:.2}-{:.2}]", s.choice, s.speedup, s.interval[0], s.interval[1]);
    }
    if !measurement.batch_gains.is_empty() {
        let gains: Vec<String> =
            measurement.batch_gains.iter().map(|g| format!("{} together {:.2}x", g.sequences, g.gain)).collect();
        println!("plain decoding of several requests together, total over one alone: {}", gains.join(", "));
    }
    match server::launch::judge_and_store(config_dir, key, &measurement, options).map_err(|e| e.to_string())? {
        (Verdict::Refuse { why }, _) => Err(why),
        (Verdict::Store { choice, why, speedup, .. }, path) => {
            println!("stored {choice} for {class} in {}: {why}", path.display());
            if !choice.is_plain() && !measurement.batch_gains.is_empty() {
                let rule = engine::batch_rule::BatchRule::new(measurement.batch_gains.clone(), speedup);
                let max = engine.profile().max_sequences;
                match rule.batch_from(speedup, max) {
                    Some(n) => println!(
                        "the server batches a speculating request with others from {n} requests (below, they wait their turn)"
                    ),
                    None => println!(
                        "speculating alone beats batching up to {max} requests: the others wait their turn"
                    ),
                }
            }
            Ok(())
        }
    }
}
