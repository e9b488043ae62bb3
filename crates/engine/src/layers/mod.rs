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
mod kernel_check;
pub mod linear;
pub mod loader;
pub mod matmul_path;
pub mod measured;
pub mod mlp;
pub mod moe;
mod moe_cuda;
pub mod norm;
pub mod packed;
pub mod parallel;
pub mod projections;
mod qmm_mma;
mod qmm_rows;
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
