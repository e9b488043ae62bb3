//! What one decode step asks of MLX: the operations it dispatches, by kind. At decode the
//! GPU work per operation is small, so the count of operations — each one built on the host,
//! then launched — sets much of the pace; this is the figure the graph work in the layers
//! is judged by (`ferrite dev ops`, beside mlx-lm's count from `bench/mlx_lm_ops.py`).
//! For prompts, where the arithmetic is large, [`prefill_times`] says which kind of layer
//! the time goes to.

use std::collections::BTreeMap;
use std::time::Instant;

use mlx_rs::transforms::eval;
use mlx_rs::Array;

use crate::engine::{synthetic_prompt, Engine};
use crate::error::Result;
use crate::ffi;

/// Operations of one step, by MLX primitive name, and where a step's time goes.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StepOps {
    pub total: usize,
    pub by_kind: BTreeMap<String, usize>,
    /// Host time to build one step's graph (the model's forward pass, nothing evaluated).
    pub build_ms: f64,
    /// Wall time of one step built and evaluated before the next is built (no overlap):
    /// build + dispatch + device time + read-back.
    pub step_ms: f64,
}

impl StepOps {
    fn from_names(names: Vec<String>) -> StepOps {
        let mut by_kind = BTreeMap::new();
        for name in &names {
            *by_kind.entry(name.clone()).or_insert(0) += 1;
        }
        StepOps { total: names.len(), by_kind, ..Default::default() }
    }
}

/// The operations of one greedy decode step after `context` prompt tokens (prefilled and
/// evaluated first, so only the step itself is counted): the model's forward pass for one
/// token, its cache updates and the argmax. With `positions` > 1, a verify pass's step instead:
/// that many positions at once, the cache recording what a rollback needs (as speculation
/// runs it), rolled back after each step so every one sees the same context.
pub fn decode_step_ops(engine: &Engine, context: usize, positions: usize) -> Result<StepOps> {
    let model = engine.model();
    let prompt = synthetic_prompt(model.config().vocab_size.max(2) as u32, context.max(1));
    let mut cache = model.new_cache();
    for chunk in prompt.chunks(engine.prefill_chunk().max(1)) {
        let hidden = model.hidden(&Array::from_slice(chunk, &[1, chunk.len() as i32]), &mut cache)?;
        eval([&hidden])?;
        eval(cache.arrays())?;
    }
    let positions = positions.max(1);
    let verify = positions > 1;
    cache.set_record(verify);
    let ids = vec![1u32; positions];
    let step = |cache: &mut crate::cache::Cache| -> Result<Array> {
        let logits = model.forward(&Array::from_slice(&ids, &[1, positions as i32]), cache)?;
        Ok(mlx_rs::ops::indexing::argmax_axis(&logits, -1, None)?)
    };
    // A verify pass whose drafts were all rejected: only its first position stays (the state
    // before it is not recorded), so the context grows by one a step, as plain decoding's.
    let rewind = |cache: &mut crate::cache::Cache| -> Result<()> {
        if verify {
            cache.rollback(positions as i32 - 1)?;
        }
        Ok(())
    };
    // One step first: weights only the output side reads (lm_head) are still lazy after the
    // prefill, and their loading is not part of a step.
    step(&mut cache)?.eval()?;
    rewind(&mut cache)?;
    let token = step(&mut cache)?;
    let mut ops = StepOps::from_names(ffi::pending_primitives(std::slice::from_ref(&token))?);
    eval([&token])?;
    rewind(&mut cache)?;
    // Timed steps after two untimed ones (kernels compiled, buffers cached).
    const WARM: usize = 2;
    const TIMED: usize = 16;
    let (mut build, mut total) = (0.0, 0.0);
    for i in 0..WARM + TIMED {
        let started = Instant::now();
        let token = step(&mut cache)?;
        let built = started.elapsed().as_secs_f64();
        token.eval()?;
        rewind(&mut cache)?;
        if i >= WARM {
            build += built;
            total += started.elapsed().as_secs_f64();
        }
    }
    ops.build_ms = build * 1e3 / TIMED as f64;
    ops.step_ms = total * 1e3 / TIMED as f64;
    Ok(ops)
}

/// Where one prompt chunk's time goes, by part of the layer: each layer's mixer (attention or
/// Gated DeltaNet, with its norm and residual) and feed-forward (dense MLP or MoE) is
/// evaluated and waited for on its own, so the parts' times add up to the chunk's (plus the
/// embedding). The second of two passes is reported (the first compiles kernels). Memory:
/// MLX's active memory before the prompt (the model and little else) and, per part, the
/// highest peak any one layer's part reached. `laps`: the prompt paths of Gated DeltaNet and
/// MoE layers split further (`"gated delta: delta rule"`, `"moe: experts"`, …), each piece
/// evaluated on its own too, summed over layers.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PrefillTimes {
    pub tokens: usize,
    pub total_ms: f64,
    pub by_part: BTreeMap<String, f64>,
    pub before_mb: f64,
    pub peak_mb_by_part: BTreeMap<String, f64>,
    pub laps: Vec<(String, f64)>,
}

pub fn prefill_times(engine: &Engine, tokens: usize) -> Result<PrefillTimes> {
    let model = engine.model();
    let prompt = synthetic_prompt(model.config().vocab_size.max(2) as u32, tokens.max(1));
    let ids = Array::from_slice(&prompt, &[1, prompt.len() as i32]);
    let mut times = PrefillTimes { tokens: prompt.len(), ..Default::default() };
    for pass in 0..2 {
        let mut cache = model.new_cache();
        let mut by_part = BTreeMap::new();
        let mut peaks = BTreeMap::new();
        let mb = |bytes: usize| bytes as f64 / 1e6;
        let before_mb = mb(mlx_rs::memory::active_memory()?);
        // One layer part, evaluated: its time since `started`, and MLX's peak since the last
        // part (the highest any layer's part of this kind reached is kept).
        let mut record = |part: &str, started: Instant| -> Result<()> {
            *by_part.entry(part.to_string()).or_insert(0.0) += started.elapsed().as_secs_f64() * 1e3;
            let seen = peaks.entry(part.to_string()).or_insert(0.0f64);
            *seen = seen.max(mb(mlx_rs::memory::peak_memory()?));
            mlx_rs::memory::reset_peak_memory()?;
            Ok(())
        };
        let start_part = || {
            crate::laps::restart();
            Instant::now()
        };
        crate::laps::start();
        let started = Instant::now();
        let mut h = model.embed(&ids)?;
        h.eval()?;
        mlx_rs::memory::reset_peak_memory()?;
        for (layer, state) in model.layers().iter().zip(cache.layers.iter_mut()) {
            let started = start_part();
            h = h.add(layer.mixer.forward(&layer.input_layernorm.forward(&h)?, state)?)?;
            h.eval()?;
            record(
                match layer.mixer {
                    crate::layers::Mixer::Attention(_) => "attention",
                    crate::layers::Mixer::Linear(_) => "gated delta",
                },
                started,
            )?;
            let started = start_part();
            h = layer.mlp.forward_plus(&layer.post_attention_layernorm.forward(&h)?, &h)?;
            h.eval()?;
            record(
                match layer.mlp {
                    crate::layers::FeedForward::Dense(_) => "mlp",
                    crate::layers::FeedForward::Moe(_) => "moe",
                },
                started,
            )?;
        }
        let laps = crate::laps::finish();
        if pass == 1 {
            times.laps = laps;
            times.total_ms = started.elapsed().as_secs_f64() * 1e3;
            times.by_part = by_part;
            times.before_mb = before_mb;
            times.peak_mb_by_part = peaks;
        }
    }
    Ok(times)
}
