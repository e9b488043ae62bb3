//! `ferrite bench`: decode and prefill speed of one model on fixed prompt ids, as JSON, for
//! bench/ scripts that run mlx-lm on the same checkpoint and ids in the same run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::{Engine, GenerateRequest};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, short)]
    model: PathBuf,
    /// JSON array of prompt token ids (the same file the peer reads).
    #[arg(long)]
    prompt_ids: PathBuf,
    /// Tokens to generate per run (end-of-sequence is ignored).
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

pub fn run(args: Args) -> Result<()> {
    let text = std::fs::read_to_string(&args.prompt_ids).with_context(|| format!("reading {}", args.prompt_ids.display()))?;
    let prompt: Vec<u32> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON array of token ids", args.prompt_ids.display()))?;
    let engine = Engine::load(&args.model)?;
    let request = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt, args.gen_tokens) };
    let mut decode = Vec::new();
    let mut prefill = Vec::new();
    let mut ttft = Vec::new();
    for run in 0..=args.runs.max(1) {
        let (_, summary) = engine.generate_text(request.clone())?;
        anyhow::ensure!(summary.usage.completion_tokens == args.gen_tokens, "generated {} tokens, wanted {}", summary.usage.completion_tokens, args.gen_tokens);
        if run > 0 {
            decode.push(summary.timings.decode_tps);
            prefill.push(summary.timings.prompt_tps);
            ttft.push(summary.timings.ttft.as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let report = serde_json::json!({
        "engine": "ferrite",
        "backend": engine.backend.to_string(),
        "prompt_tokens": request.prompt.len(),
        "gen_tokens": args.gen_tokens,
        "decode_tps": median(&mut decode),
        "prompt_tps": median(&mut prefill),
        "ttft_s": median(&mut ttft),
        "peak_memory_bytes": engine::generate::peak_memory_bytes(),
    });
    println!("{report}");
    Ok(())
}

