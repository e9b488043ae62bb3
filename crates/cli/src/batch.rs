//! `ferrite dev batch`: decode speed of several sequences stepped together (`engine::batch`)
//! against one sequence alone, interleaved round by round on the same model: total and
//! per-stream tok/s for each stream count, one JSON line each.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use engine::batch::Batch;
use engine::batch_rule::decode_rate;
use engine::{CancelToken, Engine, GenerateRequest};

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
    let mut engine = Engine::load_with(model, &server::engine_options::from_env(engine::Profile::default(), None)?)
        .with_context(|| format!("loading {}", model.display()))?;
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

/// How a newcomer's prefill interleaved with a running stream's decode steps plays out, for
/// each `settings` value of prompt tokens per step (0: the whole prompt in one step, as
/// without interleaving): the running stream's longest gap between tokens and its rate while
/// the newcomer's `prompt_tokens` are prefilled, and the newcomer's time to first token.
/// Settings alternate round by round; one JSON line each with medians and ranges.
pub fn interleave(model: &Path, prompt_tokens: usize, settings: &[usize], rounds: usize) -> Result<()> {
    let mut engine = Engine::load_with(model, &server::engine_options::from_env(engine::Profile::default(), None)?)
        .with_context(|| format!("loading {}", model.display()))?;
    engine.set_prompt_cache_budget(0);
    let code: String =
        (0..).map(|i| format!("    total_{i} = compute(values[{i}], scale={i})\n")).take(prompt_tokens).collect();
    let mut long = engine.tokenizer().encode(&code)?;
    long.truncate(prompt_tokens.max(2));
    let running = GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::greedy(engine.tokenizer().encode(PROMPTS[0])?, 100_000)
    };
    let newcomer = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(long, 2) };
    let mut results: Vec<Vec<Joined>> = vec![vec![]; settings.len()];
    for round in 0..=rounds {
        for (k, &tokens) in settings.iter().enumerate() {
            engine.set_prefill_interleave(if tokens == 0 { engine.prefill_chunk() } else { tokens });
            let joined = join_once(&engine, &running, &newcomer)?;
            if round > 0 {
                results[k].push(joined); // round 0 warms every shape up
            }
        }
    }
    for (k, &tokens) in settings.iter().enumerate() {
        let r = &mut results[k];
        let stat = |r: &mut Vec<Joined>, f: fn(&Joined) -> f64| {
            let mut v: Vec<f64> = r.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            (round(v[v.len() / 2]), round(v[0]), round(v[v.len() - 1]))
        };
        let (gap, gap_lo, gap_hi) = stat(r, |j| j.longest_gap_ms);
        let (step, ..) = stat(r, |j| j.step_before_ms);
        let (rate, rate_lo, rate_hi) = stat(r, |j| j.rate_during);
        let (ttft, ttft_lo, ttft_hi) = stat(r, |j| j.newcomer_ttft_ms);
        println!(
            "{}",
            serde_json::json!({"prompt_tokens": prompt_tokens, "interleave_tokens": if tokens == 0 { engine.prefill_chunk() } else { tokens },
                "whole_prompt_at_once": tokens == 0, "rounds": rounds,
                "running_step_ms_before": step,
                "running_longest_gap_ms": gap, "running_longest_gap_ms_range": [gap_lo, gap_hi],
                "running_tps_during_prefill": rate, "running_tps_range": [rate_lo, rate_hi],
                "newcomer_ttft_ms": ttft, "newcomer_ttft_ms_range": [ttft_lo, ttft_hi]})
        );
    }
    Ok(())
}

#[derive(Clone)]
struct Joined {
    step_before_ms: f64,
    longest_gap_ms: f64,
    rate_during: f64,
    newcomer_ttft_ms: f64,
}

/// One stream decoding, then a newcomer queued: steps until the newcomer's first token.
fn join_once(engine: &Engine, running: &GenerateRequest, newcomer: &GenerateRequest) -> Result<Joined> {
    let stop = CancelToken::default();
    let mut batch = Batch::default();
    batch.queue(0, engine.generate(running.clone(), stop.clone())?)?;
    let mut gaps = vec![];
    let mut last = Instant::now();
    for _ in 0..12 {
        batch.step();
        gaps.push(last.elapsed().as_secs_f64() * 1e3);
        last = Instant::now();
    }
    gaps.sort_by(f64::total_cmp);
    let step_before_ms = gaps[gaps.len() / 2];
    let queued = Instant::now();
    batch.queue(1, engine.generate(newcomer.clone(), CancelToken::default())?)?;
    let (mut longest, mut decoded) = (0f64, 0usize);
    let mut first_token = None;
    while first_token.is_none() {
        let before = batch.generated(&0).unwrap_or(0);
        let events = batch.step();
        longest = longest.max(last.elapsed().as_secs_f64() * 1e3);
        last = Instant::now();
        decoded += batch.generated(&0).unwrap_or(0) - before;
        if events.iter().any(|(k, _)| *k == 1) || batch.generated(&1).is_some_and(|n| n > 0) {
            first_token = Some(queued.elapsed());
        }
    }
    let window = queued.elapsed().as_secs_f64();
    stop.cancel();
    while !batch.is_empty() {
        batch.step();
    }
    Ok(Joined {
        step_before_ms,
        longest_gap_ms: longest,
        rate_during: decoded as f64 / window,
        newcomer_ttft_ms: first_token.unwrap_or_default().as_secs_f64() * 1e3,
    })
}
