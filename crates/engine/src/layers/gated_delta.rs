//! Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: projections, a
//! depthwise causal conv1d over (q, k, v) with a cached tail, L2-normalised q/k, the gated
//! delta rule with an f32 recurrent state [B, Hv, Dv, Dk], and a z-gated RMSNorm.
//!
//! The recurrence follows mlx-lm's `gated_delta_ops` step by step (one compiled graph per
//! position), so results match it exactly on every backend.

use std::cell::RefCell;
use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{IndexOp, NewAxis};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{fast, ops, Array, Dtype};

use super::delta_chunked::delta_rule_chunked;
use super::delta_cuda;
use super::delta_fused;
use super::delta_path::{self, DeltaPath, KernelUse};
use super::{Linear, Projections, RmsNorm};
use crate::cache::LinearState;
use crate::device::on_gpu;
use crate::error::Result;
use crate::laps;

/// Row orders that turn Qwen3-Next's per-key-head interleaved input projections into
/// Qwen3.5's separate ones: `in_proj_qkvz` holds, for each key head, [q (Dk), k (Dk),
/// v (r Dv), z (r Dv)] with r = Hv / Hk; `in_proj_ba` holds [b (r), a (r)] per key head.
/// Returns the rows of (qkv, z) and of (b, a).
pub fn fused_input_rows(nk: i32, nv: i32, dk: i32, dv: i32) -> ([Vec<i32>; 2], [Vec<i32>; 2]) {
    let r = nv / nk;
    let width = 2 * dk + 2 * r * dv;
    let block = |start: i32, len: i32| (0..nk).flat_map(move |h| (0..len).map(move |i| h * width + start + i));
    let qkv = block(0, dk).chain(block(dk, dk)).chain(block(2 * dk, r * dv)).collect();
    let z = block(2 * dk + r * dv, r * dv).collect();
    let b = (0..nk).flat_map(|h| (0..r).map(move |i| h * 2 * r + i)).collect();
    let a = (0..nk).flat_map(|h| (0..r).map(move |i| h * 2 * r + r + i)).collect();
    ([qkv, z], [b, a])
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// The input projections, in Qwen3.5's order: q k v (all heads' q, then k, then v), z, b,
    /// a. Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba` are reordered into these at
    /// load (the loader's job), so a step needs no gathering of its own.
    pub inputs: Projections,
    /// Depthwise conv weights in MLX layout [channels, kernel, 1].
    pub conv_weight: Array,
    pub dt_bias: Array,
    pub a_log: Array,
    /// RMSNorm over each value head, gated by `silu(z)`.
    pub norm: RmsNorm,
    pub out_proj: Linear,
    pub num_k_heads: i32,
    pub num_v_heads: i32,
    pub head_k_dim: i32,
    pub head_v_dim: i32,
    pub kernel: i32,
}

/// Sequences at least this long use the chunked delta rule.
pub const CHUNKED_FROM: i32 = 64;

/// A Python-style scalar: takes the dtype of the array it meets.
fn scalar(v: f64, like: &Array) -> std::result::Result<Array, Exception> {
    Array::from_f32(v as f32).as_dtype(like.dtype())
}

impl GatedDeltaNet {
    pub fn forward(&self, x: &Array, state: &mut LinearState) -> Result<Array> {
        let (b, s) = (x.dim(0), x.dim(1));
        let (nk, nv, dk, dv) = (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim);
        let short = s < CHUNKED_FROM && self.norm.eps == DECODE_NORM_EPS;
        if short && self.launches(DeltaPath::CudaFused, x.dtype(), state.record) {
            return self.fused_step(x, state);
        }
        let [qkv, z, beta_logits, a] = <[Array; 4]>::try_from(self.inputs.forward(x)?)
            .map_err(|_| Exception::custom("a Gated DeltaNet layer needs four input projections"))?;
        let z = z.reshape(&[b, s, nv, dv])?;

        if short {
            return self.short_step(&qkv, &z, &beta_logits, &a, state);
        }
        laps::lap("gated delta: input projections", &[&qkv, &z, &beta_logits, &a])?;

        // Causal depthwise conv over the cached tail plus the new positions.
        let channels = qkv.dim(-1);
        let keep = self.kernel - 1;
        let tail = match state.conv.take() {
            Some(t) => t,
            None => ops::zeros_dtype(&[b, keep, channels], x.dtype())?,
        };
        let conv_input = ops::concatenate(&[tail, qkv], 1)?;
        let total = conv_input.dim(1);
        state.conv = Some(conv_input.index((.., (total - keep).., ..)).contiguous()?);
        if state.record {
            state.conv_window = Some(conv_input.clone());
        }
        let conv = depthwise_conv(&conv_input, &self.conv_weight)?;
        let (q, k, v) = conv_qkv(&conv, s, [nk, dk, nv, dv])?;

        let beta = ops::sigmoid(&beta_logits)?;
        let g = DECAY.with_borrow_mut(|f| f((&self.a_log, &a, &self.dt_bias)))?;
        let recurrent = match state.recurrent.take() {
            Some(r) => r,
            None => ops::zeros_dtype(&[b, nv, dv, dk], Dtype::Float32)?,
        };
        laps::lap("gated delta: conv, q/k norms, gates", &[&q, &k, &v, &beta, &g])?;
        // Long prefills go through the chunked form; decode and verify passes step by step
        // (they are short, and verify needs the state after every position).
        let (y, mut steps) = if s >= CHUNKED_FROM && !state.record {
            // MLX's op takes the key heads as they are; the chunked form wants them repeated.
            let (y, last) = if delta_path::current() == DeltaPath::Native {
                crate::ffi::gated_delta_update(&q, &k, &v, &g, &beta, &recurrent)?
            } else {
                let r = v.dim(2) / q.dim(2);
                let (qr, kr) =
                    (Array::repeat_axis::<f32>(q.clone(), r, -2)?, Array::repeat_axis::<f32>(k.clone(), r, -2)?);
                delta_rule_chunked(&qr, &kr, &v, &g, &beta, recurrent)?
            };
            (y.as_dtype(q.dtype())?, vec![last])
        } else {
            delta_rule(&q, &k, &v, &g, &beta, recurrent, state.record)?
        };
        state.recurrent = steps.pop();
        if state.record {
            steps.extend(state.recurrent.clone());
            state.steps = steps;
        }
        state.offset += s;
        laps::lap("gated delta: delta rule", &[&y])?;

        let normed = self.norm.forward(&y)?;
        let out = GATED_NORM.with_borrow_mut(|f| f((&y, &z, &normed)))?;
        let out = self.out_proj.forward(&out.reshape(&[b, s, -1])?)?;
        laps::lap("gated delta: gated norm, output projection", &[&out])?;
        Ok(out)
    }
}

impl GatedDeltaNet {
    /// A few positions (a decode step, a verify pass, a short prompt): everything between the
    /// input projections and the output projection as one compiled graph (the same
    /// operations as the general path, fused by MLX), so a step builds and dispatches a
    /// handful of primitives per layer instead of dozens: at decode the host's graph work,
    /// not the arithmetic, sets the pace. Recording (verify passes) also returns the conv
    /// window and the state after every position, for a rollback.
    fn short_step(
        &self,
        qkv: &Array,
        z: &Array,
        beta_logits: &Array,
        a: &Array,
        state: &mut LinearState,
    ) -> Result<Array> {
        let (b, s) = (qkv.dim(0), qkv.dim(1));
        let tail = match state.conv.take() {
            Some(t) => t,
            None => ops::zeros_dtype(&[b, self.kernel - 1, qkv.dim(-1)], qkv.dtype())?,
        };
        let recurrent = match state.recurrent.take() {
            Some(r) => r,
            None => ops::zeros_dtype(&[b, self.num_v_heads, self.head_v_dim, self.head_k_dim], Dtype::Float32)?,
        };
        let args = [
            qkv.clone(),
            z.clone(),
            beta_logits.clone(),
            a.clone(),
            tail,
            recurrent,
            self.conv_weight.clone(),
            self.a_log.clone(),
            self.dt_bias.clone(),
            self.norm.weight.clone(),
        ];
        let record = state.record;
        let path = match delta_path::current() {
            // Where the fused step was not taken (head sizes it does not take, as the embedded
            // model's 48, or a use that failed its check): the recurrence alone as a kernel.
            DeltaPath::Cuda | DeltaPath::CudaFused if self.launches(DeltaPath::Cuda, qkv.dtype(), record) => {
                DeltaPath::Cuda
            }
            DeltaPath::Cuda | DeltaPath::CudaFused => DeltaPath::Ops,
            path => path,
        };
        let out = SHORT_CORES.with_borrow_mut(|cores| {
            let core = cores
                .entry((path, record))
                .or_insert_with(|| Box::new(compile(move |args: &[Array]| short_core_on(args, record, path), false)));
            core(&args)
        })?;
        let mut out = out.into_iter();
        let (Some(y), Some(tail)) = (out.next(), out.next()) else {
            return Err(Exception::custom("the short step returned too few arrays").into());
        };
        state.conv = Some(tail);
        if state.record {
            state.conv_window = out.next();
        }
        let mut states: Vec<Array> = out.collect();
        state.recurrent = states.last().cloned();
        if state.recurrent.is_none() {
            return Err(Exception::custom("the short step returned no state").into());
        }
        if state.record {
            state.steps = std::mem::take(&mut states);
        }
        state.offset += s;
        self.out_proj.forward(&y)
    }
}

impl GatedDeltaNet {
    /// The kernel use a short step of this layer on `kernel` is, on activations of `dtype`.
    pub fn kernel_use(&self, kernel: DeltaPath, dtype: Dtype, record: bool) -> KernelUse {
        KernelUse::Delta {
            kernel,
            heads: [self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.kernel],
            dtype,
            weights: [self.conv_weight.dtype(), self.a_log.dtype(), self.dt_bias.dtype(), self.norm.weight.dtype()],
            record,
        }
    }

    /// Whether `kernel` (`cuda-fused` or `cuda-kernel`) takes this layer's head sizes.
    pub fn takes(&self, kernel: DeltaPath) -> bool {
        match kernel {
            DeltaPath::CudaFused => delta_fused::fits(self.head_k_dim, self.head_v_dim),
            DeltaPath::Cuda => delta_cuda::fits(self.head_k_dim),
            _ => false,
        }
    }

    /// Whether a short step launches `kernel` here: this process's path offers it, it takes
    /// the layer's head sizes, and its use passed the check at the model's load.
    pub fn launches(&self, kernel: DeltaPath, dtype: Dtype, record: bool) -> bool {
        let offered = match delta_path::current() {
            DeltaPath::CudaFused => matches!(kernel, DeltaPath::CudaFused | DeltaPath::Cuda),
            DeltaPath::Cuda => kernel == DeltaPath::Cuda,
            _ => false,
        };
        offered && self.takes(kernel) && delta_path::passed(&self.kernel_use(kernel, dtype, record))
    }

    /// A few positions on the `cuda-fused` path: the input projections as one array, then
    /// everything up to the output projection in one launch (`delta_fused.rs`).
    fn fused_step(&self, x: &Array, state: &mut LinearState) -> Result<Array> {
        let proj = self.inputs.forward_joined(x)?;
        let (b, s, channels) = (proj.dim(0), proj.dim(1), self.conv_weight.dim(0));
        let tail = match state.conv.take() {
            Some(t) => t,
            None => ops::zeros_dtype(&[b, self.kernel - 1, channels], proj.dtype())?,
        };
        let recurrent = match state.recurrent.take() {
            Some(r) => r,
            None => ops::zeros_dtype(&[b, self.num_v_heads, self.head_v_dim, self.head_k_dim], Dtype::Float32)?,
        };
        let step = delta_fused::Step {
            proj: &proj,
            tail: &tail,
            conv_weight: &self.conv_weight,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm_weight: &self.norm.weight,
            state: &recurrent,
        };
        let out = delta_fused::run(&step, state.record)?;
        if state.record {
            let qkv = proj.index((.., .., ..channels));
            state.conv_window = Some(ops::concatenate(&[&tail, &qkv], 1)?);
            state.steps = out.states.clone();
        }
        state.conv = Some(out.tail);
        state.recurrent = out.states.last().cloned();
        state.offset += s;
        self.out_proj.forward(&out.y)
    }
}

/// The z-gated norm's epsilon the compiled short steps are traced with (Qwen3-Next's and
/// Qwen3.5's `rms_norm_eps`); a model with another takes the general path.
const DECODE_NORM_EPS: f32 = 1e-6;

/// A few positions of the layer between its projections: [y, conv tail, (conv window, the
/// state after each position) or (the final state)]. Every size comes from the inputs'
/// shapes, so one compiled function serves every layer and model (MLX traces again for new
/// shapes): conv [C, K, 1] gives the channels, a_log [Hv] the value heads, the norm weight
/// [Dv] the value dims, the state [B, Hv, Dv, Dk] the key dims, and the channels
/// (2 Hk Dk + Hv Dv) the key heads. `path` runs the recurrence itself (`delta_path.rs`).
pub(crate) fn short_core_on(
    args: &[Array],
    record: bool,
    path: DeltaPath,
) -> std::result::Result<Vec<Array>, Exception> {
    let [qkv, z, beta_logits, a, tail, recurrent, conv_weight, a_log, dt_bias, norm_weight] = args else {
        return Err(Exception::custom("the short step takes 10 arrays"));
    };
    let (b, s) = (qkv.dim(0), qkv.dim(1));
    let (channels, nv, dv, dk) = (conv_weight.dim(0), a_log.dim(0), norm_weight.dim(0), recurrent.dim(-1));
    let nk = (channels - nv * dv) / (2 * dk);
    if path == DeltaPath::CudaFused {
        let proj = ops::concatenate(&[qkv, &z.reshape(&[b, s, nv * dv])?, beta_logits, a], -1)?;
        let step = delta_fused::Step { proj: &proj, tail, conv_weight, a_log, dt_bias, norm_weight, state: recurrent };
        let out = delta_fused::run(&step, record)?;
        let mut outputs = vec![out.y, out.tail];
        if record {
            outputs.push(ops::concatenate(&[tail, qkv], 1)?);
        }
        outputs.extend(out.states);
        return Ok(outputs);
    }
    let conv_input = ops::concatenate(&[tail, qkv], 1)?;
    let new_tail = conv_input.index((.., s.., ..));
    let (q, k, v) = conv_qkv(&depthwise_conv(&conv_input, conv_weight)?, s, [nk, dk, nv, dv])?;
    if path != DeltaPath::Ops {
        let (y, states) = kernel_recurrence(path, [&q, &k, &v, beta_logits, a], [a_log, dt_bias], recurrent, record)?;
        return short_core_outputs(y, z, norm_weight, new_tail, conv_input, states, record);
    }
    // On a GPU the gates are computed per position, in the value heads' groups, inside the
    // step: so MLX fuses them into the step's element-wise kernels instead of running them
    // apart. A fused kernel recomputes its element-wise inputs per output element, which on
    // the CPU would run the decay's exp and log1p once per state element (Dv x Dk of them)
    // with scalar libm calls; there the decays of all positions are computed first, per head,
    // and the slice and reshape between (not element-wise) keep them out of the state's kernel.
    let r = nv / nk;
    let decays = if on_gpu() { None } else { Some(decay_graph((a_log, a, dt_bias))?) };
    let (a_log, dt_bias) = (a_log.reshape(&[nk, r, 1, 1])?, dt_bias.reshape(&[nk, r, 1, 1])?);
    let mut state = recurrent.clone();
    let mut ys = Vec::with_capacity(s as usize);
    let mut states = Vec::new();
    for t in 0..s {
        let at = |x: &Array| x.index((.., t));
        let g = match &decays {
            Some(all) => at(all).reshape(&[b, nk, r, 1, 1])?,
            None => decay_graph((&a_log, &at(a).reshape(&[b, nk, r, 1, 1])?, &dt_bias))?,
        };
        let beta = ops::sigmoid(&at(beta_logits).reshape(&[b, nk, r, 1])?)?;
        let mut step = grouped_delta_step(&at(&q), &at(&k), &at(&v), &g, &beta, state)?;
        let (Some(next), Some(y)) = (step.pop(), step.pop()) else {
            return Err(Exception::custom("the delta step returned fewer than two arrays"));
        };
        state = next;
        ys.push(y);
        if record {
            states.push(state.clone());
        }
    }
    if !record {
        states.push(state);
    }
    short_core_outputs(stack_positions(&ys)?, z, norm_weight, new_tail, conv_input, states, record)
}

/// The recurrence of a short step on a kernel path: q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], the
/// gates' inputs [B, S, Hv]. Returns y [B, S, Hv, Dv] and the state after each position
/// (`record`) or the final one.
fn kernel_recurrence(
    path: DeltaPath,
    [q, k, v, beta_logits, a]: [&Array; 5],
    [a_log, dt_bias]: [&Array; 2],
    state: &Array,
    record: bool,
) -> std::result::Result<(Array, Vec<Array>), Exception> {
    let g = decay_graph((a_log, a, dt_bias))?;
    let beta = ops::sigmoid(beta_logits)?;
    match path {
        DeltaPath::Cuda => delta_cuda::run(q, k, v, &g, &beta, state, record),
        // MLX's op returns only the final state: a verify pass runs it a position at a time,
        // the same call as a decode step, so every state is there and equals decoding's.
        DeltaPath::Native if record => {
            let (mut ys, mut states) = (Vec::new(), Vec::new());
            let mut state = state.clone();
            for t in 0..q.dim(1) {
                let at = |x: &Array| x.index((.., t..t + 1));
                let (y, next) = crate::ffi::gated_delta_update(&at(q), &at(k), &at(v), &at(&g), &at(&beta), &state)?;
                ys.push(y);
                states.push(next.clone());
                state = next;
            }
            Ok((ops::concatenate(&ys, 1)?, states))
        }
        DeltaPath::Native => {
            let (y, state) = crate::ffi::gated_delta_update(q, k, v, &g, &beta, state)?;
            Ok((y, vec![state]))
        }
        DeltaPath::Ops | DeltaPath::CudaFused => {
            Err(Exception::custom(format!("the {path} path has no separate kernel recurrence")))
        }
    }
}

/// The short step's outputs from the recurrence's: [y (normed, gated, [B, S, Hv Dv]), conv
/// tail, (conv window, each position's state) or (the final state)].
fn short_core_outputs(
    y: Array,
    z: &Array,
    norm_weight: &Array,
    new_tail: Array,
    conv_input: Array,
    states: Vec<Array>,
    record: bool,
) -> std::result::Result<Vec<Array>, Exception> {
    let (b, s) = (y.dim(0), y.dim(1));
    let normed = fast::rms_norm(&y, Some(norm_weight), DECODE_NORM_EPS)?;
    let out = gated_norm_graph((&y, z, &normed))?;
    let mut outputs = vec![out.reshape(&[b, s, -1])?, new_tail];
    if record {
        outputs.push(conv_input);
    }
    outputs.extend(states);
    Ok(outputs)
}

/// The causal depthwise conv of `conv_input` [B, S + K - 1, C] (the cached tail, then the new
/// positions) with weights [C, K, 1] → [B, S, C]: MLX's grouped conv1d, one group per channel.
fn depthwise_conv(conv_input: &Array, conv_weight: &Array) -> std::result::Result<Array, Exception> {
    ops::conv1d(conv_input, conv_weight, 1, 0, 1, conv_weight.dim(0))
}

/// The conv's output over `s` positions, SiLU, then q, k, v split into heads ([Hk, Dk],
/// [Hk, Dk], [Hv, Dv]) with q and k L2-normalised and the dk^-0.5 readout scale folded into
/// q, as mlx-lm does.
fn conv_qkv(conv: &Array, s: i32, [nk, dk, nv, dv]: [i32; 4]) -> std::result::Result<(Array, Array, Array), Exception> {
    let b = conv.dim(0);
    let conv = conv.multiply(ops::sigmoid(conv)?)?;
    let p = conv.split_at_indices(&[2 * nk * dk], -1)?;
    let v = p[1].reshape(&[b, s, nv, dv])?;
    let inv_scale = (dk as f64).powf(-0.5);
    let rms_eps = (1e-6 * inv_scale * inv_scale) as f32;
    // q's heads and k's normalised in one kernel: the same weightless norm row by row as
    // two calls would do (mlx-lm's), one dispatch fewer per layer and step.
    let qk = fast::rms_norm(&p[0].reshape(&[b, s, 2 * nk, dk])?, None, rms_eps)?;
    let qk = qk.split_at_indices(&[nk], 2)?;
    let q = scalar(inv_scale * inv_scale, &qk[0])?.multiply(&qk[0])?;
    let k = scalar(inv_scale, &qk[1])?.multiply(&qk[1])?;
    Ok((q, k, v))
}

/// Runs the recurrence over the sequence: y [B, T, Hv, Dv] and the states after each
/// position (`all`) or only the final one.
pub(crate) fn delta_rule(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    mut state: Array,
    all: bool,
) -> Result<(Array, Vec<Array>)> {
    let mut ys = Vec::with_capacity(q.dim(1) as usize);
    let mut states = Vec::new();
    for t in 0..q.dim(1) {
        let at = |x: &Array| x.index((.., t));
        let args = [at(q), at(k), at(v), at(g), at(beta), state];
        let mut out = DELTA_STEP.with_borrow_mut(|f| f(&args))?;
        let (Some(next), Some(y)) = (out.pop(), out.pop()) else {
            return Err(Exception::custom("the delta step returned fewer than two arrays").into());
        };
        state = next;
        ys.push(y);
        if all && t + 1 < q.dim(1) {
            states.push(state.clone());
        }
    }
    states.push(state);
    Ok((stack_positions(&ys)?, states))
}

/// Per-position outputs [B, ...] as [B, T, ...]; one position is a view, not a copy.
fn stack_positions(ys: &[Array]) -> std::result::Result<Array, Exception> {
    match ys {
        [one] => ops::expand_dims(one, 1),
        _ => ops::stack(ys, 1),
    }
}

type Unary3 = Box<dyn for<'a> FnMut((&'a Array, &'a Array, &'a Array)) -> std::result::Result<Array, Exception>>;
type Step = Box<dyn for<'a> FnMut(&'a [Array]) -> std::result::Result<Vec<Array>, Exception>>;

thread_local! {
    /// Per-position decay `exp(-exp(A_log) * softplus(a + dt_bias))`, as mlx-lm's `compute_g`.
    static DECAY: RefCell<Unary3> = RefCell::new(Box::new(compile(decay_graph, true)));
    /// `silu(z) * norm(y)` in f32, as mlx-lm's `precise_swiglu`.
    static GATED_NORM: RefCell<Unary3> = RefCell::new(Box::new(compile(gated_norm_graph, true)));
    /// One position of the delta rule, as mlx-lm's `_gated_delta_step_ops`.
    static DELTA_STEP: RefCell<Step> = RefCell::new(Box::new(compile(delta_step_graph, false)));
    /// A few positions between the projections ([`GatedDeltaNet::short_step`]), one compiled
    /// graph per delta path and per kind: final state only, or (verify passes) every
    /// position's state and the conv window.
    static SHORT_CORES: RefCell<HashMap<(DeltaPath, bool), Step>> = RefCell::new(HashMap::new());
}

fn decay_graph((a_log, a, dt_bias): (&Array, &Array, &Array)) -> std::result::Result<Array, Exception> {
    let x = a.add(dt_bias)?;
    let softplus = ops::logaddexp(&x, Array::from_f32(0.0).as_dtype(x.dtype())?)?;
    let rate = ops::exp(a_log.as_dtype(Dtype::Float32)?)?.negative()?;
    ops::exp(rate.multiply(&softplus)?)
}

fn gated_norm_graph((y, z, normed): (&Array, &Array, &Array)) -> std::result::Result<Array, Exception> {
    let z = z.as_dtype(Dtype::Float32)?;
    let gate = z.multiply(ops::sigmoid(&z)?)?;
    gate.multiply(normed.as_dtype(Dtype::Float32)?)?.as_dtype(y.dtype())
}

/// q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dv, Dk], with the
/// value heads in groups of r = Hv / Hk per key head. mlx-lm repeats q and k r times first;
/// here the state is viewed as [B, Hk, r, Dv, Dk] and q, k broadcast over the group: the
/// same products and sums, without the two copies.
fn delta_step_graph(args: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let [q, k, v, g, beta, state] = args else {
        return Err(Exception::custom("delta step takes 6 arrays"));
    };
    let (b, hk, r) = (q.dim(0), q.dim(1), v.dim(1) / q.dim(1));
    grouped_delta_step(q, k, v, &g.reshape(&[b, hk, r, 1, 1])?, &beta.reshape(&[b, hk, r, 1])?, state.clone())
}

/// [`delta_step_graph`] with the gates already in groups: g [B, Hk, r, 1, 1], beta
/// [B, Hk, r, 1]. Returns [y, state].
fn grouped_delta_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Array,
) -> std::result::Result<Vec<Array>, Exception> {
    let (b, hk, dk) = (q.dim(0), q.dim(1), q.dim(2));
    let (hv, dv) = (v.dim(1), v.dim(2));
    let r = hv / hk;
    let state = state.reshape(&[b, hk, r, dv, dk])?.multiply(g)?;
    let k_row = k.reshape(&[b, hk, 1, 1, dk])?;
    let kv_mem = state.multiply(&k_row)?.sum_axis(-1, false)?;
    let delta = v.reshape(&[b, hk, r, dv])?.subtract(&kv_mem)?.multiply(beta)?;
    let state = state.add(k_row.multiply(delta.index((.., .., .., .., NewAxis)))?)?;
    let y = state.multiply(q.reshape(&[b, hk, 1, 1, dk])?)?.sum_axis(-1, false)?;
    Ok(vec![y.reshape(&[b, hv, dv])?.as_dtype(q.dtype())?, state.reshape(&[b, hv, dv, dk])?])
}
