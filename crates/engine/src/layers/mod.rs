//! Building blocks shared by the model files: linear and embedding layers (dense or
//! affine-quantized), RMSNorm, RoPE, attention, the SwiGLU MLP and the mixture of experts.

pub mod attention;
pub mod block;
pub mod linear;
pub mod loader;
pub mod mlp;
pub mod moe;
pub mod norm;

pub use attention::Attention;
pub use block::{DecoderLayer, FeedForward};
pub use linear::{Embedding, Linear};
pub use loader::Loader;
pub use mlp::Mlp;
pub use moe::SparseMoe;
pub use norm::RmsNorm;

use mlx_rs::{ops, Array};

/// `silu(gate) * up`, the SwiGLU gate (mlx-lm's `swiglu`).
pub fn swiglu(gate: &Array, up: &Array) -> mlx_rs::error::Result<Array> {
    let silu = gate.multiply(ops::sigmoid(gate)?)?;
    silu.multiply(up)
}
