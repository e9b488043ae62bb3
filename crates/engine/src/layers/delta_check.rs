//! The self-check that decides which gated delta path a process runs (`delta_path.rs`): the
//! candidate against the operations on small inputs, through the same compiled layer code a
//! model runs (`gated_delta::short_core_on`), in float32 and bfloat16.

use mlx_rs::error::Exception;
use mlx_rs::{ops, random, Array, Dtype};

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};

use super::delta_path::{self, DeltaPath, DeltaReport};
pub use super::kernel_check::Tolerance;
use super::kernel_check::{mismatch, relative_difference};
use super::moe_cuda::{self, Routing};
use crate::device;

/// Settles the path once per process: `wanted` (or the first of the backend's kernel paths)
/// whose self-check passes, else `ops`. Later calls return the first decision.
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

/// For a model whose key heads, `head_k_dim`, are not whole warps (the embedded model's 48),
/// on a process that runs a CUDA kernel path: the recurrence kernel on heads of that size, for
/// a decode step and a recorded 3-position verify pass in float32 and bfloat16, against the
/// operations. Once per process, at the model's load: models of whole warps never pay for it.
pub fn check_odd_heads(head_k_dim: i32) {
    if head_k_dim % 32 == 0 || !matches!(delta_path::current(), DeltaPath::Cuda | DeltaPath::CudaFused) {
        return;
    }
    delta_path::settle_odd_heads(head_k_dim, || {
        let checked = [Dtype::Float32, Dtype::Bfloat16]
            .into_iter()
            .map(|dtype| check_steps(DeltaPath::Cuda, dtype, head_k_dim))
            .collect::<crate::error::Result<Vec<_>>>();
        match checked {
            Ok(worst) => {
                let worst = worst.concat().join(", ");
                tracing::info!("gated delta rule on key heads of {head_k_dim}: the CUDA kernel ({worst})");
                true
            }
            Err(e) => {
                tracing::warn!("the CUDA delta kernel failed its check on key heads of {head_k_dim}: {e}; ops there");
                false
            }
        }
    });
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
    let expected = super::gated_delta::short_core_on(&args, record, DeltaPath::Ops)?;
    let got = super::gated_delta::short_core_on(&args, record, path)?;
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
        let what = format!("{dtype:?}, {positions} position(s), heads of {head}: output {i}");
        largest = largest.max(relative_difference(&what, e, g, tol)?);
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

/// Random arguments of the short step (see `gated_delta::short_core_on`): two sequences, 2 key
/// heads and 4 value heads of `head` keys and values, conv kernel 4; values of a model's scale.
fn check_inputs(dtype: Dtype, s: i32, head: i32) -> Result<Vec<Array>, Exception> {
    let (b, nk, nv, dk, dv, kernel) = (2, 2, 4, head, head, 4);
    let channels = 2 * nk * dk + nv * dv;
    let normal = |i: u64, shape: &[i32], scale: f32| -> Result<Array, Exception> {
        let key = random::key(1000 + i)?;
        random::normal::<f32>(shape, None, None, Some(&key))?.multiply(Array::from_f32(scale))?.as_dtype(dtype)
    };
    Ok(vec![
        normal(0, &[b, s, channels], 1.0)?,
        normal(1, &[b, s, nv, dv], 1.0)?,
        normal(2, &[b, s, nv], 1.0)?,
        normal(3, &[b, s, nv], 1.0)?,
        normal(4, &[b, kernel - 1, channels], 1.0)?,
        normal(5, &[b, nv, dv, dk], 0.1)?.as_dtype(Dtype::Float32)?,
        normal(6, &[channels, kernel, 1], 0.5)?,
        normal(7, &[nv], 0.5)?,
        normal(8, &[nv], 0.5)?,
        normal(9, &[dv], 1.0)?.add(Array::from_f32(1.0))?.as_dtype(dtype)?,
    ])
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
