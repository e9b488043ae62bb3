//! What the self-checks of the engine's GPU kernels share: how far a kernel's outputs may be
//! from the reference's, and the comparison that names what differs.

use mlx_rs::{ops, Array, Dtype};

use mlx_rs::error::Exception;

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

/// max |expected - got| / (1 + max |expected|); an error naming `what` past `tol` (a NaN is
/// past every tolerance) or when the shapes differ.
pub(super) fn relative_difference(what: &str, expected: &Array, got: &Array, tol: f32) -> crate::error::Result<f32> {
    if expected.shape() != got.shape() {
        return Err(mismatch(format!("{what} has shape {:?}, the reference's {:?}", got.shape(), expected.shape())));
    }
    let (e, g) = (expected.as_dtype(Dtype::Float32)?, got.as_dtype(Dtype::Float32)?);
    let scale = 1.0 + ops::abs(&e)?.max(None)?.try_item_cast::<f32>()?;
    let relative = ops::abs(&e.subtract(&g)?)?.max(None)?.try_item_cast::<f32>()? / scale;
    if relative.is_nan() || relative > tol {
        return Err(mismatch(format!("{what} differs by {relative:.2e} relative (allowed {tol:.0e})")));
    }
    Ok(relative)
}

pub(super) fn mismatch(why: String) -> crate::error::Error {
    crate::error::Error::from(Exception::custom(why))
}
