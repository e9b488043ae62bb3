//! Linear and embedding layers, dense or affine-quantized as `mx.quantize` packs them.

use mlx_rs::{ops, Array};

use crate::error::Result;

pub use super::packed::Packed;

#[derive(Debug, Clone)]
pub enum Linear {
    Dense { weight: Array, bias: Option<Array> },
    Quantized { packed: Packed, bias: Option<Array> },
}

impl Linear {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (y, bias) = match self {
            Linear::Dense { weight, bias } => {
                if let Some(bias) = bias {
                    return Ok(ops::addmm(bias, x, weight.t(), None, None)?);
                }
                (ops::matmul(x, weight.t())?, None)
            }
            Linear::Quantized { packed, bias } => (quantized_matmul(x, packed)?, bias.as_ref()),
        };
        Ok(match bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

impl Linear {
    /// The projection onto the given output rows, in their order (a reordering or a part of
    /// the matrix; quantization groups run along the inputs, so rows move with their scales).
    pub fn take_rows(&self, rows: &[i32]) -> Result<Linear> {
        let rows = Array::from_slice(rows, &[rows.len() as i32]);
        let take = |a: &Array| a.take_axis(&rows, 0);
        let bias = |b: &Option<Array>| b.as_ref().map(take).transpose();
        Ok(match self {
            Linear::Dense { weight, bias: b } => Linear::Dense { weight: take(weight)?, bias: bias(b)? },
            Linear::Quantized { packed, bias: b } => Linear::Quantized {
                packed: Packed {
                    weight: take(&packed.weight)?,
                    scales: take(&packed.scales)?,
                    biases: take(&packed.biases)?,
                    spec: packed.spec,
                },
                bias: bias(b)?,
            },
        })
    }

    /// Rows of the output (the matrix's first axis).
    pub fn out_features(&self) -> i32 {
        match self {
            Linear::Dense { weight, .. } => weight.dim(0),
            Linear::Quantized { packed, .. } => packed.weight.dim(-2),
        }
    }
}

/// MLX's product, or the matmul path's asked for where it takes these rows (`matmul_path.rs`,
/// after its self-check).
fn quantized_matmul(x: &Array, p: &Packed) -> Result<Array> {
    if let Some(kernel) = super::matmul_path::kernel_for(x, p) {
        return Ok(kernel(x, p)?);
    }
    Ok(ops::quantized_matmul(x, &p.weight, &p.scales, &p.biases, true, p.spec.group_size, p.spec.bits)?)
}

#[derive(Debug, Clone)]
pub enum Embedding {
    Dense { weight: Array },
    Quantized { packed: Packed },
}

impl Embedding {
    /// Rows of the table for token ids of any shape.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight } => Ok(weight.take_axis(ids, 0)?),
            Embedding::Quantized { packed } => {
                let w = packed.weight.take_axis(ids, 0)?;
                let s = packed.scales.take_axis(ids, 0)?;
                let b = packed.biases.take_axis(ids, 0)?;
                Ok(ops::dequantize(&w, &s, &b, packed.spec.group_size, packed.spec.bits)?)
            }
        }
    }

    /// The table used as the output projection (tied embeddings).
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight } => Ok(ops::matmul(x, weight.t())?),
            Embedding::Quantized { packed } => quantized_matmul(x, packed),
        }
    }
}
