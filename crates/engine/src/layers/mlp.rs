use mlx_rs::Array;

use super::{swiglu, Linear, Projections};
use crate::error::Result;

/// The dense SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, gate and up joined into
/// one matrix when stored alike.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_up: Projections,
    pub down_proj: Linear,
}

impl Mlp {
    /// `gate_up`: the gate and up projections, in that order.
    pub fn new(gate_up: Projections, down_proj: Linear) -> Mlp {
        Mlp { gate_up, down_proj }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let parts = self.gate_up.forward(x)?;
        self.down_proj.forward(&swiglu(&parts[0], &parts[1])?)
    }
}
