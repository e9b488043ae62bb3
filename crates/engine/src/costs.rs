//! What speculation costs on this machine: a plain decode step, an MTP draft step, a block
//! drafter's pass and verify passes of each depth, timed on the loaded model. The depth
//! controller and the tuner decide from these; the speculator only runs what they decide.

use std::time::Instant;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};
use serde::Serialize;

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::models::{BlockDrafter, LanguageModel};
use crate::speculation::DraftWith;

/// The deepest draft a speculator runs (and the deepest verify pass timed).
pub const MAX_DRAFT_DEPTH: usize = 4;

/// What one speculative cycle costs relative to a plain decode step, measured on a model.
#[derive(Debug, Clone, Serialize)]
pub struct Costs {
    /// Seconds per plain decode step (one token through the trunk, argmax read back), timed
    /// pipelined as decoding runs it.
    pub plain_step_s: f64,
    /// Seconds per MTP draft step (one position through the head, argmax read back); `None`
    /// for a model without a head.
    pub draft_step_s: Option<f64>,
    /// Seconds per block drafter pass drafting `d` tokens, `block_draft_s[d - 1]` (a cycle's
    /// two new positions join its context, the block runs, `d` rows go through the output
    /// head); empty without a drafter. One pass drafts every depth, so its cost hardly grows
    /// with it, unlike the head's steps.
    pub block_draft_s: Vec<f64>,
    /// Seconds per verify pass of depth + 1 tokens, for depth = 1..=4 (or up to a block
    /// drafter's deepest draft, when deeper).
    pub verify_s: Vec<f64>,
    /// Of `verify_s`, the seconds spent making the pass's graph on the host, before MLX
    /// evaluates it: a cycle waits for its verify pass, so this host work is not hidden behind
    /// the device's as a plain step's is.
    pub verify_build_s: Vec<f64>,
}

impl Costs {
    /// An MTP draft step against a plain step.
    pub fn draft_ratio(&self) -> Option<f64> {
        self.draft_step_s.map(|s| s / self.plain_step_s)
    }

    pub fn verify_ratio(&self, depth: usize) -> f64 {
        self.verify_s[depth - 1] / self.plain_step_s
    }

    /// What drafting `depth` tokens with `with` costs against a plain step: `depth` head steps,
    /// or one block pass; `None` where nothing was measured for it.
    pub fn drafting_ratio(&self, with: DraftWith, depth: usize) -> Option<f64> {
        match with {
            DraftWith::Mtp => self.draft_ratio().map(|r| depth as f64 * r),
            DraftWith::Block => {
                depth.checked_sub(1).and_then(|i| self.block_draft_s.get(i)).map(|s| s / self.plain_step_s)
            }
        }
    }

    /// Speed-up over plain decoding if the drafts at each position are accepted at these
    /// rates: (1 + sum of acceptance) / (verify cost + drafting cost).
    pub fn speedup_bound(&self, with: DraftWith, depth: usize, acceptance: &[f64]) -> Option<f64> {
        let accepted: f64 = acceptance.iter().take(depth).sum();
        let verify = (depth <= self.verify_s.len()).then(|| self.verify_ratio(depth))?;
        Some((1.0 + accepted) / (verify + self.drafting_ratio(with, depth)?))
    }
}

/// Times plain steps, the drafters' work (the model's MTP head, `block` when given) and verify
/// passes after a `prompt` prefill (`iters` of each, after two warm-ups).
pub fn measure_costs(
    model: &dyn LanguageModel,
    block: Option<&BlockDrafter>,
    prompt: &[u32],
    iters: usize,
) -> Result<Costs> {
    if model.mtp().is_none() && block.is_none() {
        return Err(Error::Request("the model has no MTP head and no block drafter: nothing drafts".into()));
    }
    let mut cache = model.new_cache();
    let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
    // The trunk's features a block drafter reads (the prompt's), else its final hidden states.
    let (h, taps) = match block {
        Some(block) => {
            let (h, taps) = model.hidden_tapped(&ids, &mut cache, &block.spec.target_layers)?;
            (h, Some(taps))
        }
        None => (model.hidden(&ids, &mut cache)?, None),
    };
    let h = h.index((.., -1.., ..));
    eval(cache.arrays().into_iter().chain([&h]).chain(taps.as_ref()))?;
    let token = |i: usize| prompt[i % prompt.len()];
    let argmax = |logits: &Array| -> Result<Array> {
        Ok(ops::indexing::argmax_axis(crate::logits::last_position(logits)?, -1, None)?)
    };
    // Two untimed calls: on a GPU the first of a new shape compiles kernels, and after one
    // the first verify depth timed still read high (the embedded model's 2-position pass at
    // 1.4 times its 3-position one on an H100, where `ferrite dev ops` found it cheaper).
    let time = |f: &mut dyn FnMut(usize) -> Result<()>| -> Result<f64> {
        f(0)?;
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

    // The lengths a drafter's catch-ups run (a power of two: `speculative::slot`), met once
    // here: on a GPU the first pass of each length costs several milliseconds, which would
    // otherwise fall on a request's first returns to drafting.
    let catch_ups = || (4..=8).map(|p| 1 << p);
    let draft_step_s = match model.mtp() {
        Some(head) => {
            let mut mtp_cache = head.new_cache();
            for p in catch_ups() {
                let features = ops::broadcast_to(&h, &[1, p, h.dim(2)])?;
                let _ = head.forward(
                    model,
                    &features,
                    &Array::from_slice(&vec![token(0); p as usize], &[1, p]),
                    &mut mtp_cache,
                )?;
                eval(mtp_cache.arrays())?;
                mtp_cache.rollback(p)?;
            }
            Some(time(&mut |i| {
                let x = head.forward(model, &h, &Array::from_slice(&[token(i)], &[1, 1]), &mut mtp_cache)?;
                let y = argmax(&head.logits(model, &x)?)?;
                y.eval()?;
                mtp_cache.rollback(1)?;
                Ok(())
            })?)
        }
        None => None,
    };

    // A block pass as a cycle runs it: the positions the last verify pass committed (two,
    // a typical cycle's) join the context, the block drafts `depth` tokens, and both are
    // rolled back so every pass sees the same context.
    let mut block_draft_s = Vec::new();
    if let (Some(block), Some(taps)) = (block, &taps) {
        let mut draft_cache = block.new_cache();
        let n = taps.dim(1);
        let joins = (n - 1).min(2);
        block.extend(&taps.index((.., ..n - joins, ..)), &mut draft_cache)?;
        eval(draft_cache.arrays())?;
        let joining = (joins > 0).then(|| taps.index((.., n - joins.., ..)));
        for p in catch_ups() {
            block.extend(&ops::broadcast_to(taps.index((.., -1.., ..)), &[1, p, taps.dim(2)])?, &mut draft_cache)?;
            eval(draft_cache.arrays())?;
            draft_cache.rollback(p)?;
        }
        for depth in 1..=block.max_drafts() {
            block_draft_s.push(time(&mut |i| {
                let logits = block.draft(model, joining.as_ref(), token(i), depth, &mut draft_cache)?;
                let y = ops::indexing::argmax_axis(&logits, -1, None)?;
                y.eval()?;
                draft_cache.rollback(block.spec.block_size as i32 + joins)?;
                Ok(())
            })?);
        }
    }

    cache.set_record(true);
    let (mut verify_s, mut verify_build_s) = (Vec::new(), Vec::new());
    let deepest = MAX_DRAFT_DEPTH.max(block.map_or(0, BlockDrafter::max_drafts));
    for depth in 1..=deepest {
        let mut building = 0.0;
        verify_s.push(time(&mut |i| {
            let ids: Vec<u32> = (0..=depth).map(|j| token(i + j)).collect();
            let began = Instant::now();
            let hidden = model.hidden(&Array::from_slice(&ids, &[1, ids.len() as i32]), &mut cache)?;
            let y = ops::indexing::argmax_axis(&model.logits(&hidden)?, -1, None)?;
            if i > 0 {
                building += began.elapsed().as_secs_f64();
            }
            eval([&y, &hidden])?;
            cache.rollback(depth as i32)?;
            Ok(())
        })?);
        verify_build_s.push(building / iters.max(1) as f64);
    }
    Ok(Costs { plain_step_s, draft_step_s, block_draft_s, verify_s, verify_build_s })
}

/// A plain step timed as a verify pass is, one at a time: its graph built, then waited for.
/// Against [`Costs::plain_step_s`] it shows what the host's work and the round trip add to any
/// pass a cycle waits for (`ferrite bench --spec` shows it; the controller does not need it).
#[derive(Debug, Clone, Serialize)]
pub struct WaitedStep {
    /// Seconds per plain step, built and waited for.
    pub waited_s: f64,
    /// Of `waited_s`, the seconds spent making the step's graph on the host.
    pub build_s: f64,
}

/// Times `iters` plain steps one at a time after a `prompt` prefill (two untimed first).
pub fn measure_waited_step(model: &dyn LanguageModel, prompt: &[u32], iters: usize) -> Result<WaitedStep> {
    let mut cache = model.new_cache();
    eval([&model.hidden(&Array::from_slice(prompt, &[1, prompt.len() as i32]), &mut cache)?])?;
    eval(cache.arrays())?;
    let iters = iters.max(1);
    let (mut building, mut total) = (0.0, 0.0);
    for i in 0..iters + 2 {
        let began = Instant::now();
        let input = Array::from_slice(&[prompt[i % prompt.len()]], &[1, 1]);
        let y =
            ops::indexing::argmax_axis(crate::logits::last_position(&model.forward(&input, &mut cache)?)?, -1, None)?;
        let built = began.elapsed().as_secs_f64();
        y.eval()?;
        if i >= 2 {
            building += built;
            total += began.elapsed().as_secs_f64();
        }
    }
    Ok(WaitedStep { waited_s: total / iters as f64, build_s: building / iters as f64 })
}
