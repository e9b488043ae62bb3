//! The self-checks of the gated delta paths (`delta_path.rs`): a kernel against the
//! operations, through the same layer code a model runs (`gated_delta::short_core_on`). MLX's
//! op on a Mac is checked once per process on small inputs in float32 and bfloat16
//! ([`choose`]); the CUDA kernels at each model's load on exactly what its layers launch
//! ([`check_model`]).

use mlx_rs::error::Exception;
use mlx_rs::{ops, random, Array, Dtype};

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};

use super::block::{DecoderLayer, FeedForward, Mixer};
use super::delta_path::{self, DeltaPath, DeltaReport, KernelUse};
use super::gated_delta::GatedDeltaNet;
pub use super::kernel_check::Tolerance;
use super::kernel_check::{mismatch, relative_difference};
use super::moe_cuda::{self, Routing};
use crate::device;

/// Why a CUDA path is taken without a check here: its kernels are checked per use.
const CHECKED_AT_LOAD: &str =
    "each kernel a model launches is checked against the operations at its load, on that layer's shapes and weights";

/// Settles the path once per process: `wanted` (or the first of the backend's kernel paths)
/// whose self-check passes, else `ops`; a CUDA path without one here (see
/// [`check_model`]). Later calls return the first decision.
pub fn choose(wanted: Option<DeltaPath>) -> &'static DeltaReport {
    delta_path::settle(|| {
        let candidates = match wanted {
            Some(DeltaPath::Ops) => Vec::new(),
            Some(path) => vec![path],
            None => DeltaPath::for_backend(device::backend()).to_vec(),
        };
        let mut failures = Vec::new();
        let mut report = None;
        for &kernel in &candidates {
            if matches!(kernel, DeltaPath::Cuda | DeltaPath::CudaFused) {
                report = Some(DeltaReport { path: kernel, why: CHECKED_AT_LOAD.into() });
                break;
            }
            match self_check(kernel) {
                Ok(why) => {
                    report = Some(DeltaReport { path: kernel, why });
                    break;
                }
                Err(e) => {
                    tracing::warn!("the {kernel} gated delta path failed its self-check: {e}");
                    failures.push(format!("{kernel} failed its self-check: {e}"));
                }
            }
        }
        let mut report = report.unwrap_or_else(|| DeltaReport {
            path: DeltaPath::Ops,
            why: if candidates.is_empty() { ops_reason(wanted.is_some()) } else { String::new() },
        });
        if !failures.is_empty() {
            let why = std::mem::take(&mut report.why);
            report.why = failures.into_iter().chain((!why.is_empty()).then_some(why)).collect::<Vec<_>>().join("; ");
        }
        tracing::info!("gated delta rule: {} ({})", report.path, report.why);
        report
    })
}

fn ops_reason(asked: bool) -> String {
    if asked {
        "asked for".into()
    } else {
        format!("no kernel path on {}", device::backend())
    }
}

/// The candidate against the operations on small inputs (two sequences, grouped heads, the
/// real head size), for a decode step and a recorded 3-position verify pass, in float32 and
/// bfloat16. Returns the largest differences seen.
pub fn self_check(candidate: DeltaPath) -> crate::error::Result<String> {
    let mut worst = Vec::new();
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        worst.extend(check_steps(candidate, dtype, FULL_HEAD)?);
        if candidate == DeltaPath::Native {
            worst.push(format!("{dtype:?} prefill x{PREFILL_CHECKED}: {:.1e}", check_native_prefill(dtype)?));
        }
        if candidate == DeltaPath::CudaFused {
            worst.push(format!("{dtype:?} MoE: {:.1e}", check_moe_kernels(dtype)?));
        }
    }
    Ok(format!("checked against ops, largest relative difference {}", worst.join(", ")))
}

/// The head size of the checks: the real models' key and value heads.
const FULL_HEAD: i32 = 128;

/// At a model's load, on a CUDA path: every kernel use of `layers` (a short step of each
/// Gated DeltaNet shape, decoding and recording, on activations of `dtype`; the MoE kernels)
/// this process has not checked yet runs against the operations, on that layer's own weights.
/// A layer launches a kernel only on a use that passed (`GatedDeltaNet::launches`): the fused
/// step, else the recurrence alone, else the operations. The modules compiled here are the
/// ones the model's steps then launch.
pub fn check_model<'a>(layers: impl IntoIterator<Item = &'a DecoderLayer>, dtype: Dtype) {
    let path = delta_path::current();
    if !matches!(path, DeltaPath::Cuda | DeltaPath::CudaFused) {
        return;
    }
    let started = std::time::Instant::now();
    let mut checked = 0;
    for layer in layers {
        if let Mixer::Linear(delta) = &layer.mixer {
            let fused = path == DeltaPath::CudaFused && delta.takes(DeltaPath::CudaFused);
            for record in [false, true] {
                if !(fused && check_use(delta, DeltaPath::CudaFused, dtype, record, &mut checked))
                    && delta.takes(DeltaPath::Cuda)
                {
                    check_use(delta, DeltaPath::Cuda, dtype, record, &mut checked);
                }
            }
        }
        if let (FeedForward::Moe(_), DeltaPath::CudaFused) = (&layer.mlp, path) {
            let moe = KernelUse::Moe { dtype };
            if !delta_path::settled(&moe) {
                checked += 1;
                let verdict = check_moe_kernels(dtype);
                match &verdict {
                    Ok(worst) => tracing::info!(
                        "MoE routing and combine kernels, {dtype:?}: agree with the operations ({worst:.1e})"
                    ),
                    Err(e) => tracing::warn!("the MoE kernels failed their check on {dtype:?}: {e}; operations there"),
                }
                delta_path::settle_use(moe, verdict.is_ok());
            }
        }
    }
    if checked > 0 {
        tracing::info!("{checked} kernel use(s) checked in {:.1} s", started.elapsed().as_secs_f64());
    }
}

/// Checks `kernel` on `layer`'s short step unless its use already has a verdict; returns
/// whether the use passed (now or before).
fn check_use(layer: &GatedDeltaNet, kernel: DeltaPath, dtype: Dtype, record: bool, checked: &mut usize) -> bool {
    let kernel_use = layer.kernel_use(kernel, dtype, record);
    if !delta_path::settled(&kernel_use) {
        *checked += 1;
        let positions = if record { 3 } else { 1 };
        let verdict = layer_inputs(layer, dtype, positions)
            .map_err(crate::error::Error::from)
            .and_then(|args| compare(kernel, &args, record, &format!("{dtype:?}, {positions} position(s)")));
        let (hk, hv, dk, dv) = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim);
        let what = format!("{kernel} on {hk}x{dk} key and {hv}x{dv} value heads, {dtype:?}, recording: {record}");
        match &verdict {
            Ok(largest) => tracing::info!("gated delta {what}: agrees with the operations ({largest:.1e})"),
            Err(e) => tracing::warn!("gated delta {what}: failed its check ({e}); the next path there"),
        }
        delta_path::settle_use(kernel_use, verdict.is_ok());
    }
    delta_path::passed(&kernel_use)
}

/// A decode step and a recorded 3-position verify pass on `path` against the operations, in
/// `dtype` with heads of `head`: the largest difference of each.
fn check_steps(path: DeltaPath, dtype: Dtype, head: i32) -> crate::error::Result<Vec<String>> {
    [(1, false), (3, true)]
        .into_iter()
        .map(|(positions, record)| {
            let largest = check_short(path, dtype, head, positions, record)?;
            Ok(format!("{dtype:?} x{positions}: {largest:.1e}"))
        })
        .collect()
}

/// One short step of `positions` on `path` against the operations, heads of `head` keys and
/// values: the largest relative difference over its outputs.
fn check_short(path: DeltaPath, dtype: Dtype, head: i32, positions: i32, record: bool) -> crate::error::Result<f32> {
    let args = check_inputs(dtype, positions, head)?;
    compare(path, &args, record, &format!("{dtype:?}, {positions} position(s), heads of {head}"))
}

/// The short step on `path` against the operations on `args` (see
/// `gated_delta::short_core_on`): the largest relative difference over its outputs.
fn compare(path: DeltaPath, args: &[Array], record: bool, what: &str) -> crate::error::Result<f32> {
    let dtype = args.first().map_or(Dtype::Float32, Array::dtype);
    let expected = super::gated_delta::short_core_on(args, record, DeltaPath::Ops)?;
    let got = super::gated_delta::short_core_on(args, record, path)?;
    if expected.len() != got.len() {
        return Err(mismatch(format!("{} outputs where the operations give {}", got.len(), expected.len())));
    }
    let mut largest = 0f32;
    for (i, (e, g)) in expected.iter().zip(&got).enumerate() {
        let tol = match (dtype, e.dtype()) {
            (Dtype::Float32, _) => Tolerance::F32,
            (_, Dtype::Float32) => Tolerance::BF16_STATE,
            _ => Tolerance::BF16_OUTPUT,
        };
        largest = largest.max(relative_difference(&format!("{what}: output {i}"), e, g, tol)?);
    }
    Ok(largest)
}

/// Positions of the whole-sequence check of MLX's op: past one of its chunks.
const PREFILL_CHECKED: i32 = 80;

/// A long prompt runs MLX's op over the whole sequence (`GatedDeltaNet::forward`), not the
/// short step: checked against the operations' step-by-step rule on normalised keys, as a
/// model feeds it. Returns the largest relative difference.
fn check_native_prefill(dtype: Dtype) -> crate::error::Result<f32> {
    let (b, t, hk, hv, dk, dv) = (1, PREFILL_CHECKED, 2, 4, 128, 128);
    let normal = |i: u64, shape: &[i32]| -> Result<Array, Exception> {
        random::normal::<f32>(shape, None, None, Some(&random::key(2000 + i)?))
    };
    let unit = |x: Array| -> Result<Array, Exception> {
        let norm = ops::sqrt(&x.square()?.sum_axis(-1, true)?)?;
        x.divide(&norm)?.as_dtype(dtype)
    };
    let (q, k) = (unit(normal(0, &[b, t, hk, dk])?)?, unit(normal(1, &[b, t, hk, dk])?)?);
    let v = normal(2, &[b, t, hv, dv])?.as_dtype(dtype)?;
    let g = random::uniform::<f32, f32>(0.5, 1.0, &[b, t, hv], Some(&random::key(2003)?))?;
    let beta = random::uniform::<f32, f32>(0.0, 1.0, &[b, t, hv], Some(&random::key(2004)?))?.as_dtype(dtype)?;
    let state = normal(5, &[b, hv, dv, dk])?.multiply(Array::from_f32(0.1))?;
    let (y, last) = crate::ffi::gated_delta_update(&q, &k, &v, &g, &beta, &state)?;
    let (y_ops, mut states) = super::gated_delta::delta_rule(&q, &k, &v, &g, &beta, state, false)?;
    let last_ops = states.pop().ok_or_else(|| Exception::custom("the operations returned no state"))?;
    let tol = if dtype == Dtype::Float32 { Tolerance::F32 } else { Tolerance::BF16_OUTPUT };
    let output = relative_difference(&format!("{dtype:?}, a {t}-position prefill: the output"), &y_ops, &y, tol)?;
    let state = relative_difference(&format!("{dtype:?}, a {t}-position prefill: the state"), &last_ops, &last, tol)?;
    Ok(output.max(state))
}

/// The `cuda-fused` path's MoE routing and combine (`moe_cuda.rs`) against the operations
/// `moe.rs` runs, for a few tokens over 64 experts and a shared one, with and without
/// normalised scores. The experts' outputs are a fixed table per (token, expert), so a routing
/// that picks other experts shows in the result. Returns the largest relative difference.
fn check_moe_kernels(dtype: Dtype) -> crate::error::Result<f32> {
    let (k, experts) = (MOE_TOP_K, MOE_EXPERTS);
    let [logits, table, residual] = moe_check_inputs(dtype)?;
    let mut largest = 0f32;
    for normalize in [false, true] {
        let routing = Routing { top_k: k, normalize, shared_id: Some(experts as u32) };
        let expected = moe_by_operations(&logits, &table, &residual, &routing)?;
        let routed = moe_cuda::route(&logits, &routing)?;
        let got = moe_cuda::combine(&outputs_of(&table, &routed.ids)?, &routed.weights, &residual, &routing)?;
        let tol = if dtype == Dtype::Float32 { Tolerance::F32 } else { Tolerance::BF16_OUTPUT };
        let what = format!("{dtype:?}, the MoE step (normalised scores: {normalize})");
        largest = largest.max(relative_difference(&what, &expected, &got, tol)?);
    }
    Ok(largest)
}

const MOE_EXPERTS: i32 = 64;
const MOE_TOP_K: i32 = 4;

/// The MoE check's router logits [1, 3, experts + 1], experts' outputs [1, 3, experts + 1, 256]
/// and residual [1, 3, 256], all in `dtype` (as a model's are: the kernels take one dtype).
fn moe_check_inputs(dtype: Dtype) -> Result<[Array; 3], Exception> {
    let (tokens, d) = (3, 256);
    let normal = |i: u64, shape: &[i32], scale: f32| -> Result<Array, Exception> {
        let key = random::key(3000 + i)?;
        random::normal::<f32>(shape, None, None, Some(&key))?.multiply(Array::from_f32(scale))?.as_dtype(dtype)
    };
    Ok([
        normal(0, &[1, tokens, MOE_EXPERTS + 1], 2.0)?,
        normal(1, &[1, tokens, MOE_EXPERTS + 1, d], 1.0)?,
        normal(2, &[1, tokens, d], 1.0)?,
    ])
}

/// Each token's row of the experts' outputs `table` [.., experts (+ shared), D] at `ids`.
fn outputs_of(table: &Array, ids: &Array) -> Result<Array, Exception> {
    take_along_axis(table, &ops::expand_dims(ids, -1)?, -2)
}

/// What `moe.rs` computes for a few tokens when the experts' outputs are `table`: softmax,
/// argpartition, the scores gathered, the shared expert appended, the compiled combine's graph.
fn moe_by_operations(logits: &Array, table: &Array, residual: &Array, routing: &Routing) -> Result<Array, Exception> {
    let (k, experts) = (routing.top_k, logits.dim(-1) - i32::from(routing.shared_id.is_some()));
    let probs = ops::softmax_axis(logits.index((.., .., ..experts)), -1, true)?;
    let top = ops::argpartition_axis(&probs, -k, -1)?.index((.., .., -k..));
    let scores = take_along_axis(&probs, &top, -1)?;
    let mut args = match routing.shared_id {
        Some(id) => {
            let batch = &top.shape()[..2];
            let shared =
                Array::from_iter(std::iter::repeat_n(id, (batch[0] * batch[1]) as usize), &[batch, &[1]].concat());
            let y = outputs_of(table, &ops::concatenate(&[top, shared], -1)?)?;
            vec![y.index((.., .., ..k, ..)), scores, y.index((.., .., k, ..)), logits.index((.., .., experts..))]
        }
        None => vec![outputs_of(table, &top)?, scores],
    };
    args.push(residual.clone());
    let combined = if routing.normalize {
        super::moe::combine_graph::<true>(&args)
    } else {
        super::moe::combine_graph::<false>(&args)
    };
    combined?.pop().ok_or_else(|| Exception::custom("the MoE combine returned nothing"))
}

/// Arguments of `layer`'s short step over `positions` for two sequences: random activations in
/// `dtype` (values of a model's scale) and a random state, with the layer's own weights, so the
/// kernels compiled for the check are the layer's.
fn layer_inputs(layer: &GatedDeltaNet, dtype: Dtype, positions: i32) -> Result<Vec<Array>, Exception> {
    let (nk, nv, dk, dv) = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim);
    let (b, channels) = (2, layer.conv_weight.dim(0));
    if channels != 2 * nk * dk + nv * dv || layer.kernel < 1 {
        return Err(Exception::custom(format!(
            "the layer's conv has {channels} channels for {nk}x{dk} key and {nv}x{dv} value heads"
        )));
    }
    let mut args = step_activations(dtype, 1100, [b, positions], [nk, nv, dk, dv, layer.kernel])?;
    args.extend([layer.conv_weight.clone(), layer.a_log.clone(), layer.dt_bias.clone(), layer.norm.weight.clone()]);
    Ok(args)
}

/// A random value of `shape` in `dtype`, scaled, from key `seed`.
fn normal(dtype: Dtype, seed: u64, shape: &[i32], scale: f32) -> Result<Array, Exception> {
    let key = random::key(seed)?;
    random::normal::<f32>(shape, None, None, Some(&key))?.multiply(Array::from_f32(scale))?.as_dtype(dtype)
}

/// The short step's first six arguments for `b` sequences of `s` positions and heads
/// `[nk, nv, dk, dv, conv kernel]`: qkv, z, beta logits, a and the conv tail in `dtype`, the
/// recurrent state in float32; keys from `seed` on.
fn step_activations(dtype: Dtype, seed: u64, [b, s]: [i32; 2], heads: [i32; 5]) -> Result<Vec<Array>, Exception> {
    let [nk, nv, dk, dv, kernel] = heads;
    let channels = 2 * nk * dk + nv * dv;
    Ok(vec![
        normal(dtype, seed, &[b, s, channels], 1.0)?,
        normal(dtype, seed + 1, &[b, s, nv, dv], 1.0)?,
        normal(dtype, seed + 2, &[b, s, nv], 1.0)?,
        normal(dtype, seed + 3, &[b, s, nv], 1.0)?,
        normal(dtype, seed + 4, &[b, kernel - 1, channels], 1.0)?,
        normal(dtype, seed + 5, &[b, nv, dv, dk], 0.1)?.as_dtype(Dtype::Float32)?,
    ])
}

/// Random arguments of the short step (see `gated_delta::short_core_on`): two sequences, 2 key
/// heads and 4 value heads of `head` keys and values, conv kernel 4; values of a model's scale.
fn check_inputs(dtype: Dtype, s: i32, head: i32) -> Result<Vec<Array>, Exception> {
    let (nk, nv, kernel) = (2, 4, 4);
    let channels = 2 * nk * head + nv * head;
    let mut args = step_activations(dtype, 1000, [2, s], [nk, nv, head, head, kernel])?;
    args.extend([
        normal(dtype, 1006, &[channels, kernel, 1], 0.5)?,
        normal(dtype, 1007, &[nv], 0.5)?,
        normal(dtype, 1008, &[nv], 0.5)?,
        normal(dtype, 1009, &[head], 1.0)?.add(Array::from_f32(1.0))?.as_dtype(dtype)?,
    ]);
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_moe_check_feeds_the_kernels_one_dtype() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let inputs = moe_check_inputs(dtype).unwrap();
            assert!(inputs.iter().all(|a| a.dtype() == dtype), "{dtype:?}: {:?}", inputs.map(|a| a.dtype()));
        }
    }

    #[test]
    fn the_moe_reference_weights_the_top_experts_and_the_gated_shared_one() {
        // Four experts with logits 0, 1, 2, 3 and a gate logit of 0; each expert's output is
        // its id + 1 in every feature. Top 2: experts 3 and 2.
        let logits = Array::from_slice(&[0f32, 1.0, 2.0, 3.0, 0.0], &[1, 1, 5]);
        let table = Array::from_iter((0..5).flat_map(|e| [e as f32 + 1.0; 2]), &[1, 1, 5, 2]);
        let residual = Array::from_slice(&[10f32, 20.0], &[1, 1, 2]);
        let total: f32 = (0..4).map(|i| (i as f32).exp()).sum();
        let (p3, p2) = (3f32.exp() / total, 2f32.exp() / total);
        for normalize in [false, true] {
            let routing = Routing { top_k: 2, normalize, shared_id: Some(4) };
            let got = moe_by_operations(&logits, &table, &residual, &routing).unwrap();
            let (w3, w2) = if normalize { (p3 / (p3 + p2), p2 / (p3 + p2)) } else { (p3, p2) };
            let moe = 4.0 * w3 + 3.0 * w2 + 0.5 * 5.0;
            let expected = [10.0 + moe, 20.0 + moe];
            let got: Vec<f32> = got.as_slice().to_vec();
            for (g, e) in got.iter().zip(expected) {
                assert!((g - e).abs() < 1e-5, "normalize {normalize}: {got:?} vs {expected:?}");
            }
        }
    }
}
