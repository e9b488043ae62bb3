//! `ferrite dev depth`: the runtime depth controller against a fixed draft depth and plain
//! decoding, on an answer whose acceptance collapses mid-way: held-out code, then prose. The
//! answer is fixed in advance (`GenerateRequest::forced_tokens`: the verify pass takes its
//! tokens, the drafts are the drafter's own), so all three decode the same tokens and only the
//! drafting differs. The MTP head drafts, or a block drafter given with `--drafter`. Settings
//! alternate round by round; one JSON line per setting.

use std::path::Path;

use anyhow::{Context, Result};
use engine::{DraftWith, Engine, GenerateRequest};
use serde_json::json;

pub struct Options<'a> {
    pub model: &'a Path,
    /// A block drafter to draft with in place of the MTP head.
    pub drafter: Option<&'a Path>,
    /// JSON array of token-id arrays (held-out code in the model's tokenizer); the first
    /// `code_tokens` ids of them, in order.
    pub code_ids: &'a Path,
    pub code_tokens: usize,
    /// Prose, tokenized with the model's tokenizer.
    pub prose: &'a Path,
    pub depth: usize,
    pub rounds: usize,
}

pub fn run(o: Options) -> Result<()> {
    let mut options = server::engine_options::from_env(engine::Profile::default(), None)?;
    options.drafter = o.drafter.map(Path::to_path_buf);
    let mut engine = Engine::load_with(o.model, &options).with_context(|| format!("loading {}", o.model.display()))?;
    engine.set_prompt_cache_budget(0);
    let draft_with = if o.drafter.is_some() { DraftWith::Block } else { DraftWith::Mtp };
    anyhow::ensure!(
        engine.drafter().is_some() || engine.model().mtp().is_some(),
        "{}: no MTP head, nothing to draft with (a block drafter: --drafter)",
        o.model.display()
    );
    let code: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(o.code_ids).with_context(|| format!("reading {}", o.code_ids.display()))?,
    )
    .with_context(|| format!("{}: expected a JSON array of token-id arrays", o.code_ids.display()))?;
    let prose = std::fs::read_to_string(o.prose).with_context(|| format!("reading {}", o.prose.display()))?;
    let mut answer: Vec<u32> = code.into_iter().flatten().take(o.code_tokens).collect();
    let code_len = answer.len();
    answer.extend(engine.tokenizer().encode(&prose)?);
    let prompt = engine.tokenizer().encode("Write the module, then explain it.\n")?;
    let request = |depth: usize| GenerateRequest {
        forced_tokens: Some(answer.clone()),
        draft_depth: depth,
        draft_with,
        ..GenerateRequest::greedy(prompt.clone(), answer.len() + 1)
    };

    engine.set_depth_control(true)?;
    let costs = engine.depth_costs().cloned();
    let settings = [("plain", 0, false), ("fixed", o.depth, false), ("controller", o.depth, true)];
    let mut runs: Vec<Vec<(f64, Option<engine::speculative::SpecStats>)>> = vec![vec![]; settings.len()];
    for round in 0..=o.rounds {
        for (k, &(_, depth, control)) in settings.iter().enumerate() {
            engine.set_depth_costs(if control { costs.clone() } else { None });
            let (_, summary) = engine.generate_text(request(depth))?;
            anyhow::ensure!(summary.usage.completion_tokens == answer.len() + 1, "the answer did not run to its end");
            if round > 0 {
                runs[k].push((summary.timings.decode_tps, summary.speculative));
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    // Each round's speed over the same round's plain decoding: paired, so a machine that slows
    // down or speeds up between rounds moves both sides of a ratio alike.
    let plain: Vec<f64> = runs[0].iter().map(|r| r.0).collect();
    for ((name, depth, _), runs) in settings.iter().zip(runs) {
        let (tps, low, high) = median(runs.iter().map(|r| r.0).collect());
        let (ratio, ratio_low, ratio_high) = median(runs.iter().zip(&plain).map(|(r, p)| r.0 / p).collect());
        let spec = runs.last().and_then(|r| r.1.clone());
        println!(
            "{}",
            json!({
                "setting": name, "drafter": draft_with, "depth": depth, "decode_tps": round1(tps), "decode_tps_range": [round1(low), round1(high)],
                "vs_plain": round2(ratio), "vs_plain_range": [round2(ratio_low), round2(ratio_high)],
                "rounds": runs.len(), "answer_tokens": answer.len(), "code_tokens": code_len,
                "acceptance": spec.as_ref().map(|s| s.acceptance().iter().map(|a| round2(*a)).collect::<Vec<_>>()),
                "tokens_per_cycle": spec.as_ref().map(|s| round2(s.tokens_per_cycle())),
                "control": spec.as_ref().and_then(|s| s.control.clone()),
                "costs": costs,
            })
        );
    }
    Ok(())
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
