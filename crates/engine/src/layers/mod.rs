//! Building blocks shared by the model files: linear and embedding layers (dense or
//! affine-quantized) and joined projections, RMSNorm, RoPE, attention, Gated DeltaNet, the SwiGLU MLP and the
//! mixture of experts and its stacked experts.

pub mod attention;
pub mod block;
pub mod delta_check;
pub mod delta_chunked;
mod delta_cuda;
mod delta_fused;
pub mod delta_path;
pub mod gated_delta;
pub mod linear;
pub mod loader;
pub mod measured;
pub mod mlp;
pub mod moe;
mod moe_cuda;
pub mod norm;
pub mod parallel;
pub mod projections;
pub mod sdpa;
pub mod switch;

pub use attention::Attention;
pub use block::{DecoderLayer, FeedForward, Mixer};
pub use gated_delta::GatedDeltaNet;
pub use linear::{Embedding, Linear};
pub use loader::{JoinGroup, Joins, Loader};
pub use mlp::Mlp;
pub use moe::SparseMoe;
pub use norm::RmsNorm;
pub use projections::Projections;

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{ops, Array};

type Binary = Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> Result<Array, Exception>>;

thread_local! {
    /// SwiGLU compiled once per thread (shapeless), so its three element-wise ops run as one
    /// fused kernel, as mlx-lm's `@mx.compile` swiglu does.
    static SWIGLU: RefCell<Binary> = RefCell::new(Box::new(compile(swiglu_graph, true)));
}

fn swiglu_graph((gate, up): (&Array, &Array)) -> Result<Array, Exception> {
    gate.multiply(ops::sigmoid(gate)?)?.multiply(up)
}

/// `silu(gate) * up`, the SwiGLU gate (mlx-lm's `swiglu`).
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    SWIGLU.with_borrow_mut(|f| f((gate, up)))
}
