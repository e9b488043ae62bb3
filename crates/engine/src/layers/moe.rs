//! Mixture of experts (Qwen3-MoE, and the hybrids' with a shared expert): a softmax router
//! picks `top_k` experts per token, the experts run as gathered matmuls ([`super::switch`]),
//! and their outputs are weighted, summed and added to the residual in one compiled graph.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{ops, Array};

use super::delta_path::{self, DeltaPath, KernelUse};
use super::moe_cuda::{self, Routing};
use super::switch::{SwitchGateUp, SwitchGlu, SORT_FROM};
use super::{Mlp, Projections};
use crate::error::Result;
use crate::laps;

#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// The router (one logit per expert) and, with a shared expert, that expert's gate (one
    /// logit): both read the same input, so they run as one matmul when stored alike.
    pub router: Projections,
    pub experts: SwitchGlu,
    pub top_k: i32,
    pub norm_topk_prob: bool,
    /// Hybrid models add an always-on expert, scaled by `sigmoid(shared_expert_gate(x))`.
    pub shared: Option<SharedExpert>,
}

/// The hybrid models' always-on expert.
#[derive(Debug, Clone)]
pub enum SharedExpert {
    /// An MLP of its own.
    Mlp(Mlp),
    /// Also stored as the experts' last one (`index`): a few tokens (decode, verify) route
    /// to it with the others, in the same gathered matmuls; a long prompt, whose gathered
    /// matmuls group rows by expert, runs its own MLP (a plain matmul over every row).
    InExperts { index: u32, mlp: Mlp },
}

impl SharedExpert {
    /// Takes the shared expert in as one more expert when its matrices are stored as the
    /// routed experts' are (Qwen3-Next and Qwen3.5 give it the same width): then it runs in
    /// the same two gathered matmuls as the routed ones instead of three dispatches of its
    /// own. Otherwise it stays an MLP beside them.
    pub fn take_in_shared(experts: &mut SwitchGlu, shared: Mlp) -> Result<SharedExpert> {
        let index = experts.down_proj.experts() as u32;
        let gate_up = match (&experts.gate_up, &shared.gate_up) {
            (SwitchGateUp::Joined { both, hidden }, Projections::Joined { all, .. })
                if shared.gate_up.widths() == [*hidden, *hidden] =>
            {
                both.with_extra(all)?.map(|both| SwitchGateUp::Joined { both, hidden: *hidden })
            }
            (SwitchGateUp::Separate { gate, up }, Projections::Separate(parts)) if parts.len() == 2 => {
                match (gate.with_extra(&parts[0])?, up.with_extra(&parts[1])?) {
                    (Some(gate), Some(up)) => Some(SwitchGateUp::Separate { gate, up }),
                    _ => None,
                }
            }
            _ => None,
        };
        let down = experts.down_proj.with_extra(&shared.down_proj)?;
        match (gate_up, down) {
            (Some(gate_up), Some(down_proj)) => {
                experts.gate_up = gate_up;
                experts.down_proj = down_proj;
                Ok(SharedExpert::InExperts { index, mlp: shared })
            }
            _ => Ok(SharedExpert::Mlp(shared)),
        }
    }
}

impl SparseMoe {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_plus(x, None)
    }

    /// `residual + moe(x)`: the residual is added inside the compiled combine, one kernel
    /// fewer than adding it after.
    pub fn forward_plus(&self, x: &Array, residual: Option<&Array>) -> Result<Array> {
        if let Some((residual, routing)) = residual.and_then(|r| Some((r, self.kernel_routing(x, r)?))) {
            return self.forward_kernels(x, residual, &routing);
        }
        let mut logits = self.router.forward(x)?.into_iter();
        let (Some(router), shared_gate) = (logits.next(), logits.next()) else {
            return Err(Exception::custom("the MoE router returned nothing").into());
        };
        let probs = ops::softmax_axis(router, -1, true)?;
        let k = self.top_k;
        let top = ops::argpartition_axis(&probs, -k, -1)?;
        let top = top.try_index((Ellipsis, -k..))?;
        let scores = ops::indexing::take_along_axis(&probs, &top, -1)?;
        let long = top.size() >= SORT_FROM;
        if long {
            laps::lap("moe: router", &[&top, &scores])?;
        }
        // [experts' outputs, scores] + [shared expert's output, its gate logit] + [residual].
        let mut args = match (&self.shared, shared_gate) {
            // A few tokens route to the shared expert with the others (long prompts run its MLP).
            (Some(SharedExpert::InExperts { index, .. }), Some(gate)) if !long => {
                let batch = &top.shape()[..top.ndim() - 1];
                let count: i32 = batch.iter().product();
                let shared_ids = Array::from_iter(std::iter::repeat_n(*index, count as usize), &[batch, &[1]].concat());
                let ids = ops::concatenate(&[top, shared_ids], -1)?;
                let y = self.experts.forward(x, &ids)?;
                vec![y.try_index((Ellipsis, ..k, ..))?, scores, y.try_index((Ellipsis, k, ..))?, gate]
            }
            (Some(SharedExpert::Mlp(shared) | SharedExpert::InExperts { mlp: shared, .. }), Some(gate)) => {
                let experts = self.experts_lapped(x, &top, long)?;
                let shared = shared.forward(x)?;
                if long {
                    laps::lap("moe: shared expert", &[&shared])?;
                }
                vec![experts, scores, shared, gate]
            }
            (None, None) => vec![self.experts_lapped(x, &top, long)?, scores],
            _ => return Err(Exception::custom("a shared expert needs its gate (and only then)").into()),
        };
        args.extend(residual.cloned());
        let combine = if self.norm_topk_prob { &COMBINE_NORMALIZED } else { &COMBINE };
        let out = combine
            .with_borrow_mut(|f| f(&args))?
            .pop()
            .ok_or_else(|| Exception::custom("the MoE combine returned nothing"))?;
        if long {
            laps::lap("moe: combine", &[&out])?;
        }
        Ok(out)
    }

    /// How a few tokens route through the `cuda-fused` path's kernels (`moe_cuda.rs`), when
    /// this process runs it and the layer's shape fits: the shared expert, if any, stored
    /// with the routed ones.
    fn kernel_routing(&self, x: &Array, residual: &Array) -> Option<Routing> {
        let tokens = x.size() / x.dim(-1).max(1) as usize;
        let few = tokens * (self.top_k as usize) < SORT_FROM;
        let checked = delta_path::passed(&KernelUse::Moe { dtype: x.dtype() });
        if delta_path::current() != DeltaPath::CudaFused || !checked || !few || residual.dtype() != x.dtype() {
            return None;
        }
        let shared_id = match &self.shared {
            None => None,
            Some(SharedExpert::InExperts { index, .. }) => Some(*index),
            Some(SharedExpert::Mlp(_)) => return None,
        };
        Some(Routing { top_k: self.top_k, normalize: self.norm_topk_prob, shared_id })
    }

    /// `residual + moe(x)` with the routing and the combine as one launch each.
    fn forward_kernels(&self, x: &Array, residual: &Array, routing: &Routing) -> Result<Array> {
        let routed = moe_cuda::route(&self.router.forward_joined(x)?, routing)?;
        let y = self.experts.forward(x, &routed.ids)?;
        // A router kept in another dtype than the activations (float32 on some checkpoints)
        // weighs in that dtype; the combine takes one.
        let weights = match routed.weights.dtype() == residual.dtype() {
            true => routed.weights,
            false => routed.weights.as_dtype(residual.dtype())?,
        };
        Ok(moe_cuda::combine(&y, &weights, residual, routing)?)
    }

    /// The routed experts' outputs, a lap of their own in a long prompt.
    fn experts_lapped(&self, x: &Array, top: &Array, long: bool) -> Result<Array> {
        let y = self.experts.forward(x, top)?;
        if long {
            laps::lap("moe: experts", &[&y])?;
        }
        Ok(y)
    }
}

type Graph = Box<dyn for<'a> FnMut(&'a [Array]) -> std::result::Result<Vec<Array>, Exception>>;

thread_local! {
    /// The experts' outputs weighted by their scores (normalised to sum 1 first, for models
    /// that ask) and summed, the gated shared expert and the residual added, as one compiled
    /// graph: MLX fuses the element-wise parts, so a step dispatches three kernels where the
    /// plain operations take seven.
    static COMBINE: RefCell<Graph> = RefCell::new(Box::new(compile(combine_graph::<false>, false)));
    static COMBINE_NORMALIZED: RefCell<Graph> = RefCell::new(Box::new(compile(combine_graph::<true>, false)));
}

/// Experts' outputs [.., K, D] and scores [.., K], then optionally the shared expert's output
/// and its gate logit, then optionally the residual → `(residual +) sum(y * scores, K)
/// (+ sigmoid(gate) * shared)`, as mlx-lm computes it.
pub(super) fn combine_graph<const NORMALIZE: bool>(args: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let (y, scores, shared, residual) = match args {
        [y, scores] => (y, scores, None, None),
        [y, scores, residual] => (y, scores, None, Some(residual)),
        [y, scores, shared, gate] => (y, scores, Some((shared, gate)), None),
        [y, scores, shared, gate, residual] => (y, scores, Some((shared, gate)), Some(residual)),
        _ => return Err(Exception::custom("the MoE combine takes 2 to 5 arrays")),
    };
    // Scores as [.., K, 1] before any arithmetic, so the normalising division fuses into the
    // weighting's kernel (a reshape between them would end the fused chain).
    let scores = ops::expand_dims(scores, -1)?;
    let scores = if NORMALIZE { scores.divide(scores.sum_axis(-2, true)?)? } else { scores };
    let mut out = y.multiply(&scores)?.sum_axis(-2, false)?;
    if let Some((shared, gate)) = shared {
        out = out.add(ops::sigmoid(gate)?.multiply(shared)?)?;
    }
    if let Some(residual) = residual {
        out = residual.add(&out)?;
    }
    Ok(vec![out])
}
