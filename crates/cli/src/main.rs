//! `ferrite`: the command-line face of the engine.

mod batch;
mod bench;
mod cache;
mod collectives;
mod depth;
mod dev;
mod generate;
mod models;
mod ranks;
mod serve;
mod tune;
mod vision;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Run local LLMs fast: Qwen3-family MLX models, exact and measured")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Which implementation runs the hybrids' gated delta rule: `auto` (the GPU's kernel path
    /// after its self-check at load: MLX's own op on Metal, Ferrite's kernels on CUDA: the fused step, else the recurrence alone; the
    /// operations on the CPU), `ops`, `mlx-native`, `cuda-kernel` or `cuda-fused` (still self-checked).
    #[arg(long, global = true, default_value = "auto", value_parser = delta_path)]
    delta_path: DeltaPathArg,
    /// Which implementation multiplies a few rows (decode steps, verify passes) by quantized
    /// weights: `auto` (MLX's, as `mlx`), `cuda-rows` (Ferrite's few-rows CUDA kernel),
    /// `cuda-mma` (its tensor-core kernel) or `mlx-pad8` (MLX's, fewer than 8 rows padded to 8);
    /// a path asked for runs after its self-check at load.
    #[arg(long, global = true, default_value = "auto", value_parser = matmul_path)]
    matmul_path: MatmulPathArg,
}

/// `--matmul-path`: `None` for auto.
#[derive(Clone, Copy)]
struct MatmulPathArg(Option<engine::matmul_path::MatmulPath>);

fn matmul_path(name: &str) -> Result<MatmulPathArg, String> {
    if name == "auto" {
        return Ok(MatmulPathArg(None));
    }
    engine::matmul_path::MatmulPath::parse(name)
        .map(|p| MatmulPathArg(Some(p)))
        .ok_or_else(|| format!("`{name}` is not one of auto, mlx, cuda-rows, cuda-mma, mlx-pad8"))
}

/// `--delta-path`: `None` for auto.
#[derive(Clone, Copy)]
struct DeltaPathArg(Option<engine::delta_path::DeltaPath>);

fn delta_path(name: &str) -> Result<DeltaPathArg, String> {
    if name == "auto" {
        return Ok(DeltaPathArg(None));
    }
    engine::delta_path::DeltaPath::parse(name)
        .map(|p| DeltaPathArg(Some(p)))
        .ok_or_else(|| format!("`{name}` is not one of auto, ops, mlx-native, cuda-kernel, cuda-fused"))
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt and print speed figures.
    Generate(generate::Args),
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(serve::Args),
    /// Measure decode speed on a model (machine-readable output for bench/ scripts).
    Bench(bench::Args),
    /// Describe a model folder: architecture, parameters, quantization, MTP head, size.
    Inspect {
        /// Model folder.
        dir: std::path::PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Download a model (catalog id, alias or repository) into the models folder.
    Pull { model: String },
    /// List installed models (size, location, MTP head) and the catalog.
    Ls,
    /// Delete a downloaded model (or forget a registered folder) and report the space freed.
    Rm { model: String },
    /// The models folder: show it, choose another, register a folder in place.
    #[command(subcommand)]
    Store(models::StoreCommand),
    /// Find the fastest MTP draft depth for a model on this machine, and store it when the
    /// measurement can be trusted (`--draft-depth auto` uses it).
    Tune(tune::Args),
    /// List the runtime profiles and every knob each sets.
    Profiles,
    /// The prompt cache's disk tier: show its folder and blocks, or clear it.
    #[command(subcommand)]
    Cache(cache::CacheCommand),
    /// Developer tools: make test checkpoints.
    #[command(subcommand)]
    Dev(dev::Command),
    /// A rank other than 0 of a model split across processes (`--hosts`): started by rank 0.
    #[command(hide = true)]
    Follow(ranks::FollowArgs),
}

fn inspect(dir: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let options = server::engine_options::from_env(engine::Profile::default(), None)?;
    let report = engine::inspect::inspect(dir, &options)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}

fn profiles() -> anyhow::Result<()> {
    for name in engine::ProfileName::ALL {
        let knobs = engine::Profile::named(name).knobs();
        println!("{name}{}", if name == engine::ProfileName::default() { " (default)" } else { "" });
        for (knob, value) in knobs.as_object().into_iter().flatten().filter(|(k, _)| *k != "name") {
            println!("  {knob:<24} {value}");
        }
    }
    Ok(())
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_target(false)
        .init();
    let cli = Cli::parse();
    if let DeltaPathArg(Some(path)) = cli.delta_path {
        engine::delta_path::choose(Some(path));
    }
    if let MatmulPathArg(Some(path)) = cli.matmul_path {
        engine::matmul_path::choose(Some(path));
    }
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Dev(cmd) => dev::run(cmd),
        Command::Follow(args) => ranks::follow(args),
        Command::Inspect { dir, json } => inspect(&dir, json),
        Command::Profiles => profiles(),
        Command::Cache(cmd) => cache::run(cmd),
        Command::Tune(args) => tune::run(args),
        Command::Pull { model } => models::pull(&model),
        Command::Ls => models::ls(),
        Command::Rm { model } => models::rm(&model),
        Command::Store(cmd) => models::store_command(cmd),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
