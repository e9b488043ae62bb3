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

/// Row numbers as an index array of `u32`, the token ids' dtype: MLX's CUDA backend compiles a
/// gather kernel per index dtype on a machine's first run, so the weights' rows taken at load
/// share the module of the embedding lookups instead of compiling two more. A negative row
/// (which a `u32` would turn into a read past the end) is refused.
pub fn row_index(rows: &[i32]) -> Result<Array> {
    let ids: Vec<u32> = rows
        .iter()
        .map(|&r| u32::try_from(r))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| mlx_rs::error::Exception::custom(format!("negative row number among {rows:?}")))?;
    Ok(Array::from_slice(&ids, &[ids.len() as i32]))
}

impl Linear {
    /// The projection onto the given output rows, in their order (a reordering or a part of
    /// the matrix; quantization groups run along the inputs, so rows move with their scales).
    pub fn take_rows(&self, rows: &[i32]) -> Result<Linear> {
        let rows = row_index(rows)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_index_as_token_ids_do_and_a_negative_row_is_refused() {
        let index = row_index(&[3, 0, 7]).unwrap();
        assert_eq!(index.dtype(), mlx_rs::Dtype::Uint32);
        assert_eq!(index.as_slice::<u32>(), &[3, 0, 7]);
        let err = row_index(&[1, -2]).unwrap_err().to_string();
        assert!(err.contains("negative row number among [1, -2]"), "{err}");
    }
}
