use mlx_rs::Array;

use super::{swiglu, Linear};
use crate::error::Result;

/// The dense SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let h = swiglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}
