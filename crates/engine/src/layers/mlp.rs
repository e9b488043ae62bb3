use mlx_rs::Array;

use super::{swiglu, Linear, Projections};
use crate::error::Result;

/// The dense SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` (gate and up joined into
/// one matrix when the model joins its projections: [`super::Loader::projections`]).
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
        let [gate, up] = <[Array; 2]>::try_from(self.gate_up.forward(x)?)
            .map_err(|_| mlx_rs::error::Exception::custom("an MLP needs gate and up projections"))?;
        self.down_proj.forward(&swiglu(&gate, &up)?)
    }
}
