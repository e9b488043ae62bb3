//! A matrix's affine-quantized form as `mx.quantize` packs it: what linear layers, embeddings,
//! stacked experts and the few-rows kernel share.

use mlx_rs::{ops, Array};

use crate::config::QuantSpec;
use crate::error::Result;

/// Packed weights of a quantized matrix: `weight` is uint32 with `32 / bits` values per word,
/// `scales` and `biases` have one value per group of `group_size` inputs.
#[derive(Debug, Clone)]
pub struct Packed {
    pub weight: Array,
    pub scales: Array,
    pub biases: Array,
    pub spec: QuantSpec,
}

impl Packed {
    /// The matrices joined along `axis` (an output or expert axis, never the packed input
    /// axis), in order; all share the first one's spec.
    pub fn concat(parts: &[&Packed], axis: i32) -> Result<Packed> {
        let all =
            |pick: fn(&Packed) -> &Array| ops::concatenate(&parts.iter().map(|p| pick(p)).collect::<Vec<_>>(), axis);
        Ok(Packed {
            weight: all(|p| &p.weight)?,
            scales: all(|p| &p.scales)?,
            biases: all(|p| &p.biases)?,
            spec: parts[0].spec,
        })
    }

    /// A random [n, k] matrix (normal, scaled as a model's weights; from `key` when given)
    /// packed at `bits` in groups of `group_size`: what the kernels' self-checks and tests
    /// multiply.
    pub fn random(n: i32, k: i32, bits: i32, group_size: i32, key: Option<&Array>) -> Result<Packed> {
        let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, key)?.multiply(Array::from_f32(0.02))?;
        let (weight, scales, biases) = ops::quantize(&w, group_size, bits)?;
        Ok(Packed { weight, scales, biases, spec: QuantSpec { group_size, bits } })
    }

    /// Whether this is one 2-D matrix packed over `k` inputs: words, scales and biases sized
    /// for them and for the same rows. A kernel that indexes the buffers itself checks this
    /// first (MLX's own op checks shapes; a kernel would read past them).
    pub fn is_matrix_over(&self, k: i32) -> bool {
        let (bits, group) = (self.spec.bits, self.spec.group_size);
        let n = self.weight.dim(0);
        bits > 0
            && 32 % bits == 0
            && group > 0
            && k % group == 0
            && [&self.weight, &self.scales, &self.biases].iter().all(|a| a.ndim() == 2 && a.dim(0) == n)
            && self.weight.dim(1) * (32 / bits) == k
            && self.scales.dim(1) == k / group
            && self.biases.dim(1) == k / group
    }

    pub fn eval(&self) -> Result<()> {
        mlx_rs::transforms::eval([&self.weight, &self.scales, &self.biases])?;
        Ok(())
    }
}
