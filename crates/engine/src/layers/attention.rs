//! Grouped-query attention with per-head q/k RMSNorm and RoPE (Qwen3), optionally with the
//! sigmoid output gate and partial rotary embeddings of the hybrid models' full-attention layers.

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::{Linear, Projections, RmsNorm};
use crate::cache::KvCache;
use crate::error::Result;

#[derive(Debug, Clone)]
pub struct Rope {
    pub dims: i32,
    pub base: f32,
    pub scale: f32,
}

impl Rope {
    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        Ok(fast::rope(x, self.dims, false, self.base, self.scale, offset, None)?)
    }
}

#[derive(Debug, Clone)]
pub struct Attention {
    /// q, k, v and (gated attention) the output gate.
    pub qkv: Projections,
    pub o_proj: Linear,
    pub q_norm: RmsNorm,
    pub k_norm: RmsNorm,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub rope: Rope,
    /// Qwen3-Next / Qwen3.5: q's projection also yields a per-channel gate, `o_proj(o * sigmoid(gate))`.
    pub output_gate: bool,
}

impl Attention {
    /// `x`: [B, L, hidden]. Attends causally over the cache plus the `L` new positions.
    pub fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        self.forward_rows(x, &mut [cache])
    }

    /// `x`: [B, L, hidden], row i a sequence of its own with its own cache (`caches[i]`, of
    /// any length): the projections run for all rows at once (one read of the weights), each
    /// row attends over its own keys at its own positions.
    pub fn forward_rows(&self, x: &Array, caches: &mut [&mut KvCache]) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let heads = |y: Array, n: i32| y.reshape(&[b, l, n, -1]);
        let mut parts = self.qkv.forward(x)?.into_iter();
        let (Some(q), Some(k), Some(v), gate) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(mlx_rs::error::Exception::custom("attention needs q, k and v projections").into());
        };
        if gate.is_some() != self.output_gate {
            return Err(mlx_rs::error::Exception::custom("attention's output gate and its projections disagree").into());
        }
        let q = self.q_norm.forward(&heads(q, self.n_heads)?)?;
        let k = self.k_norm.forward(&heads(k, self.n_kv_heads)?)?;
        let v = heads(v, self.n_kv_heads)?;
        let (q, k, v) =
            (q.transpose_axes(&[0, 2, 1, 3])?, k.transpose_axes(&[0, 2, 1, 3])?, v.transpose_axes(&[0, 2, 1, 3])?);
        let o = match caches {
            [cache] => self.attend(&q, &k, &v, cache)?,
            _ if caches.len() == b as usize => {
                let rows = caches
                    .iter_mut()
                    .enumerate()
                    .map(|(i, cache)| {
                        let row = |a: &Array| a.index(i as i32..i as i32 + 1);
                        self.attend(&row(&q), &row(&k), &row(&v), cache)
                    })
                    .collect::<Result<Vec<_>>>()?;
                mlx_rs::ops::concatenate(&rows, 0)?
            }
            _ => return Err(mlx_rs::error::Exception::custom("attention needs one cache per row").into()),
        };
        let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        match gate {
            Some(gate) => self.o_proj.forward(&o.multiply(mlx_rs::ops::sigmoid(&gate)?)?),
            None => self.o_proj.forward(&o),
        }
    }

    /// One sequence's attention: q, k, v [B, heads, L, head_dim] at the cache's positions.
    fn attend(&self, q: &Array, k: &Array, v: &Array, cache: &mut KvCache) -> Result<Array> {
        let q = self.rope.forward(q, cache.offset)?;
        let k = self.rope.forward(k, cache.offset)?;
        let (k, v) = cache.update_and_fetch(&k, v)?;
        let scale = (self.head_dim as f64).powf(-0.5) as f32;
        // MLX's causal mode aligns the mask to the end of the keys, so it is right after a
        // cached prefix too; a single new position needs no mask.
        let mask = (q.dim(2) > 1).then_some(ScaledDotProductAttentionMask::Causal);
        Ok(fast::scaled_dot_product_attention(&q, &k, &v, scale, mask, None)?)
    }
}
