//! `ferrite`: the command-line face of the engine.

mod bench;
mod dev;
mod generate;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Run local LLMs fast: Qwen3-family MLX models, exact and measured")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt and print speed figures.
    Generate(generate::Args),
    /// Measure decode speed on a model (machine-readable output for bench/ scripts).
    Bench(bench::Args),
    /// Developer tools: make test checkpoints.
    #[command(subcommand)]
    Dev(dev::Command),
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Dev(cmd) => dev::run(cmd),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
