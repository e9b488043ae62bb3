//! `ferrite dev batch`: decode speed of several sequences stepped together (`engine::batch`)
//! against one sequence alone, interleaved round by round on the same model: total and
//! per-stream tok/s for each stream count, one JSON line each.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use engine::batch::Batch;
use engine::{CancelToken, Engine, Event, GenerateRequest};

/// Distinct code prompts, one per stream.
const PROMPTS: [&str; 8] = [
    "def read_config(path):\n",
    "fn main() {\n    let args",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self, x):",
    "SELECT name FROM users WHERE",
    "#include <stdio.h>\n\nint main(",
    "const express = require('express');\n",
    "func handler(w http.ResponseWriter, r *http.Request) {\n",
];

pub fn run(model: &Path, streams: &[usize], tokens: usize, rounds: usize) -> Result<()> {
    let mut engine = Engine::load(model).with_context(|| format!("loading {}", model.display()))?;
    // Each timed run starts from its own prefill: the prompt cache would answer repeats.
    engine.set_prompt_cache_budget(0);
    let request = |i: usize| -> Result<GenerateRequest> {
        let prompt = engine.tokenizer().encode(PROMPTS[i % PROMPTS.len()])?;
        Ok(GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt, tokens) })
    };
    decode_rate(&engine, &[request(0)?])?; // warm-up
    let mut rates: Vec<Vec<f64>> = vec![vec![]; streams.len()];
    let mut alone = vec![];
    for _ in 0..rounds {
        alone.push(decode_rate(&engine, &[request(0)?])?);
        for (k, &n) in streams.iter().enumerate() {
            let requests = (0..n).map(request).collect::<Result<Vec<_>>>()?;
            rates[k].push(decode_rate(&engine, &requests)?);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let single = median(&mut alone);
    for (k, &n) in streams.iter().enumerate() {
        let range =
            (rates[k].iter().copied().fold(f64::INFINITY, f64::min), rates[k].iter().copied().fold(0.0, f64::max));
        let total = median(&mut rates[k]);
        println!(
            "{}",
            serde_json::json!({"streams": n, "tokens_per_stream": tokens, "rounds": rounds,
                "total_tps": round(total), "total_tps_range": [round(range.0), round(range.1)],
                "per_stream_tps": round(total / n as f64), "single_tps": round(single),
                "total_over_single": (total / single * 1000.0).round() / 1000.0})
        );
    }
    Ok(())
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Decode tok/s of `requests` stepped together (prefills not timed).
fn decode_rate(engine: &Engine, requests: &[GenerateRequest]) -> Result<f64> {
    let mut batch = Batch::default();
    for (i, r) in requests.iter().enumerate() {
        batch.join(i, engine.generate(r.clone(), CancelToken::default())?)?;
    }
    let started = Instant::now();
    // Every token but the first (drawn by the prefill) is decoded by a step.
    let mut decoded = 0usize;
    while !batch.is_empty() {
        for (_, event) in batch.step() {
            if let Event::Finished(summary) = event? {
                decoded += summary.usage.completion_tokens.saturating_sub(1);
            }
        }
    }
    Ok(decoded as f64 / started.elapsed().as_secs_f64())
}
