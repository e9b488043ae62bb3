//! The self-check that decides which gated delta path a process runs (`delta_path.rs`): the
//! candidate against the operations on small inputs, through the same compiled layer code a
//! model runs (`gated_delta::short_core_on`), in float32 and bfloat16.

use mlx_rs::error::Exception;
use mlx_rs::{ops, random, Array, Dtype};

use super::delta_path::{self, DeltaPath, DeltaReport};
use crate::device;

/// How far a kernel's outputs may be from the operations': |a - b| <= tol * (1 + max |b|), per
/// output. With float32 inputs only the order of the sums differs. With bfloat16 inputs the
/// outputs are rounded to 8 bits of mantissa (a step of 2^-8 relative), and an implementation
/// may round an intermediate to the inputs' dtype (MLX's own op does): the f32 states may then
/// differ by about two such steps.
pub struct Tolerance;

impl Tolerance {
    pub const F32: f32 = 1e-4;
    pub const BF16_OUTPUT: f32 = 2e-2;
    pub const BF16_STATE: f32 = 8e-3;
}

/// Settles the path once per process: `wanted` (or the backend's kernel path) after its
/// self-check, else `ops`. Later calls return the first decision.
pub fn choose(wanted: Option<DeltaPath>) -> &'static DeltaReport {
    delta_path::settle(|| {
        let candidate = wanted.unwrap_or_else(|| DeltaPath::for_backend(device::backend()));
        let report = match candidate {
            DeltaPath::Ops => DeltaReport { path: DeltaPath::Ops, why: ops_reason(wanted.is_some()) },
            kernel => match self_check(kernel) {
                Ok(checked) => DeltaReport { path: kernel, why: checked },
                Err(e) => {
                    tracing::warn!("the {kernel} gated delta path failed its self-check, running ops: {e}");
                    DeltaReport { path: DeltaPath::Ops, why: format!("{kernel} failed its self-check: {e}") }
                }
            },
        };
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
        for (positions, record) in [(1, false), (3, true)] {
            let args = check_inputs(dtype, positions)?;
            let expected = super::gated_delta::short_core_on(&args, record, DeltaPath::Ops)?;
            let got = super::gated_delta::short_core_on(&args, record, candidate)?;
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
                let what = format!("{dtype:?}, {positions} position(s): output {i}");
                largest = largest.max(relative_difference(&what, e, g, tol)?);
            }
            worst.push(format!("{dtype:?} x{positions}: {largest:.1e}"));
        }
        if candidate == DeltaPath::Native {
            worst.push(format!("{dtype:?} prefill x{PREFILL_CHECKED}: {:.1e}", check_native_prefill(dtype)?));
        }
    }
    Ok(format!("checked against ops, largest relative difference {}", worst.join(", ")))
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

/// max |expected - got| / (1 + max |expected|); an error naming `what` past `tol` (a NaN is
/// past every tolerance) or when the shapes differ.
fn relative_difference(what: &str, expected: &Array, got: &Array, tol: f32) -> crate::error::Result<f32> {
    if expected.shape() != got.shape() {
        return Err(mismatch(format!("{what} has shape {:?}, the operations' {:?}", got.shape(), expected.shape())));
    }
    let (e, g) = (expected.as_dtype(Dtype::Float32)?, got.as_dtype(Dtype::Float32)?);
    let scale = 1.0 + ops::abs(&e)?.max(None)?.try_item_cast::<f32>()?;
    let relative = ops::abs(&e.subtract(&g)?)?.max(None)?.try_item_cast::<f32>()? / scale;
    if relative.is_nan() || relative > tol {
        return Err(mismatch(format!("{what} differs by {relative:.2e} relative (allowed {tol:.0e})")));
    }
    Ok(relative)
}

fn mismatch(why: String) -> crate::error::Error {
    crate::error::Error::from(Exception::custom(why))
}

/// Random arguments of the short step (see `gated_delta::short_core_on`): two sequences, 2 key
/// heads and 4 value heads of 128, conv kernel 4; values of a model's scale.
fn check_inputs(dtype: Dtype, s: i32) -> Result<Vec<Array>, Exception> {
    let (b, nk, nv, dk, dv, kernel) = (2, 2, 4, 128, 128, 4);
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
