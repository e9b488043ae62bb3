//! What speculation costs on this machine: a plain decode step, an MTP draft step and verify
//! passes of each depth, timed on the loaded model. The depth controller and the tuner decide
//! from these; the speculator only runs what they decide.

use std::time::Instant;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};
use serde::Serialize;

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::models::LanguageModel;

/// The deepest draft a speculator runs (and the deepest verify pass timed).
pub const MAX_DRAFT_DEPTH: usize = 4;

/// What one speculative cycle costs relative to a plain decode step, measured on a model.
#[derive(Debug, Clone, Serialize)]
pub struct Costs {
    /// Seconds per plain decode step (one token through the trunk, argmax read back).
    pub plain_step_s: f64,
    /// Seconds per MTP draft step (one position through the head, argmax read back).
    pub draft_step_s: f64,
    /// Seconds per verify pass of depth + 1 tokens, for depth = 1..=4.
    pub verify_s: Vec<f64>,
}

impl Costs {
    pub fn draft_ratio(&self) -> f64 {
        self.draft_step_s / self.plain_step_s
    }

    pub fn verify_ratio(&self, depth: usize) -> f64 {
        self.verify_s[depth - 1] / self.plain_step_s
    }

    /// Speed-up over plain decoding if the drafts at each position are accepted at these
    /// rates: (1 + sum of acceptance) / (verify cost + depth x draft cost).
    pub fn speedup_bound(&self, depth: usize, acceptance: &[f64]) -> f64 {
        let accepted: f64 = acceptance.iter().take(depth).sum();
        (1.0 + accepted) / (self.verify_ratio(depth) + depth as f64 * self.draft_ratio())
    }
}

/// Times plain steps, draft steps and verify passes after a `prompt` prefill (`iters` of each,
/// after one warm-up).
pub fn measure_costs(model: &dyn LanguageModel, prompt: &[u32], iters: usize) -> Result<Costs> {
    let head = model.mtp().ok_or_else(|| Error::Request("the model has no MTP head".into()))?;
    let mut cache = model.new_cache();
    let h = model.hidden(&Array::from_slice(prompt, &[1, prompt.len() as i32]), &mut cache)?;
    let h = h.index((.., -1.., ..));
    eval(cache.arrays().into_iter().chain([&h]))?;
    let token = |i: usize| prompt[i % prompt.len()];
    let argmax = |logits: &Array| ops::indexing::argmax_axis(logits.index((.., -1, ..)), -1, None);
    let time = |f: &mut dyn FnMut(usize) -> Result<()>| -> Result<f64> {
        f(0)?;
        let t = Instant::now();
        for i in 1..=iters {
            f(i)?;
        }
        Ok(t.elapsed().as_secs_f64() / iters as f64)
    };

    // A plain step as decoding runs it: each step's graph is built while the one before it
    // computes (`generate.rs` pipelines plain decoding), whereas a speculative cycle waits for
    // its verify pass. Timed one step at a time, a plain step would carry host work that
    // decoding hides (on a GPU, half again its real cost) and drafting would look cheaper.
    let plain_step_s = {
        let step = |input: &Array, cache: &mut Cache| -> Result<Array> {
            let y = argmax(&model.forward(&input.reshape(&[1, 1])?, cache)?)?;
            async_eval([&y])?;
            Ok(y)
        };
        let mut y = step(&Array::from_slice(&[token(0)], &[1, 1]), &mut cache)?;
        y.eval()?;
        let steps = 3 * iters.max(1);
        let t = Instant::now();
        for _ in 0..steps {
            let next = step(&y, &mut cache)?;
            y.eval()?;
            y = next;
        }
        y.eval()?;
        t.elapsed().as_secs_f64() / steps as f64
    };

    let mut mtp_cache = head.new_cache();
    let draft_step_s = time(&mut |i| {
        let x = head.forward(model, &h, &Array::from_slice(&[token(i)], &[1, 1]), &mut mtp_cache)?;
        let y = argmax(&head.logits(model, &x)?)?;
        y.eval()?;
        mtp_cache.rollback(1)?;
        Ok(())
    })?;

    cache.set_record(true);
    let mut verify_s = Vec::new();
    for depth in 1..=MAX_DRAFT_DEPTH {
        verify_s.push(time(&mut |i| {
            let ids: Vec<u32> = (0..=depth).map(|j| token(i + j)).collect();
            let hidden = model.hidden(&Array::from_slice(&ids, &[1, ids.len() as i32]), &mut cache)?;
            let y = ops::indexing::argmax_axis(&model.logits(&hidden)?, -1, None)?;
            eval([&y, &hidden])?;
            cache.rollback(depth as i32)?;
            Ok(())
        })?);
    }
    Ok(Costs { plain_step_s, draft_step_s, verify_s })
}
