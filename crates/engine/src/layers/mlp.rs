use mlx_rs::Array;

use super::{swiglu, Linear};
use crate::error::Result;

/// The gate and up projections of a SwiGLU block: as the checkpoint stores them, or joined
/// into one matrix (gate's rows first) so a step runs one matmul instead of two.
#[derive(Debug, Clone)]
pub enum GateUp {
    Separate { gate: Linear, up: Linear },
    Joined { both: Linear, hidden: i32 },
}

impl GateUp {
    /// Joins the two when they are stored alike (see [`Linear::join_rows`]).
    pub fn new(gate: Linear, up: Linear, hidden: i32) -> Result<GateUp> {
        Ok(match Linear::join_rows(&gate, &up)? {
            Some(both) => GateUp::Joined { both, hidden },
            None => GateUp::Separate { gate, up },
        })
    }

    /// (gate(x), up(x)).
    pub fn forward(&self, x: &Array) -> Result<(Array, Array)> {
        match self {
            GateUp::Separate { gate, up } => Ok((gate.forward(x)?, up.forward(x)?)),
            GateUp::Joined { both, hidden } => {
                let parts = both.forward(x)?.split_at_indices(&[*hidden], -1)?;
                Ok((parts[0].clone(), parts[1].clone()))
            }
        }
    }
}

/// The dense SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_up: GateUp,
    pub down_proj: Linear,
}

impl Mlp {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (gate, up) = self.gate_up.forward(x)?;
        self.down_proj.forward(&swiglu(&gate, &up)?)
    }
}
