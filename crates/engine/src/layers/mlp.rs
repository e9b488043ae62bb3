use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{ops, Array};

use super::{Linear, Projections};
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
