use std::path::PathBuf;

use anyhow::{bail, Result};
use engine::checkpoint::{self, Arch, Dtype, Layout, MakeOptions};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Write a random-initialised checkpoint in the MLX layout, with a trained tokenizer.
    MakeCheckpoint(MakeArgs),
}

#[derive(clap::Args)]
pub struct MakeArgs {
    /// qwen3, qwen3_moe, qwen3_next, qwen3_5 or qwen3_5_moe.
    #[arg(long, default_value = "qwen3")]
    arch: String,
    /// tiny, small, 0.6b, 8b, 32b (qwen3); tiny, small, 30b-a3b (qwen3_moe); tiny, small (hybrids).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Quantize matrices to this many bits (2, 3, 4, 5, 6, 8); omit for floating point.
    #[arg(long)]
    bits: Option<i32>,
    #[arg(long, default_value_t = 64)]
    group_size: i32,
    /// Floating-point type of unquantized weights and of scales: f32, bf16, f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Tie (true) or untie (false) input and output embeddings, overriding the preset.
    #[arg(long)]
    tie: Option<bool>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hybrid models: also write a multi-token-prediction head (mtp.*).
    #[arg(long)]
    mtp: bool,
    /// `mlx` (as mlx-community publishes) or `transformers` (as Qwen publishes hybrids).
    #[arg(long, default_value = "mlx")]
    layout: String,
    /// Start a new safetensors shard after this many MiB.
    #[arg(long, default_value_t = 4096)]
    shard_mib: usize,
    #[arg(long)]
    out: PathBuf,
}

pub fn run(cmd: Command) -> Result<()> {
    let Command::MakeCheckpoint(a) = cmd;
    let dtype = match a.dtype.as_str() {
        "f32" | "float32" => Dtype::Float32,
        "bf16" | "bfloat16" => Dtype::Bfloat16,
        "f16" | "float16" => Dtype::Float16,
        other => bail!("--dtype: unknown type `{other}` (f32, bf16, f16)"),
    };
    let mut opts = MakeOptions::new(Arch::parse(&a.arch)?, &a.preset);
    opts.bits = a.bits;
    opts.group_size = a.group_size;
    opts.dtype = dtype;
    opts.tie_embeddings = a.tie;
    opts.seed = a.seed;
    opts.shard_bytes = a.shard_mib.max(1) << 20;
    opts.mtp = a.mtp;
    opts.layout = match a.layout.as_str() {
        "mlx" => Layout::Mlx,
        "transformers" | "hf" => Layout::Transformers,
        other => bail!("--layout: unknown layout `{other}` (mlx, transformers)"),
    };
    let made = checkpoint::make(&opts, &a.out)?;
    println!(
        "wrote {}: {} parameters, {:.1} MB of weights in {} file(s)",
        made.dir.display(),
        made.parameters,
        made.bytes as f64 / 1e6,
        made.files.len()
    );
    Ok(())
}

