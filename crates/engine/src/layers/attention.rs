//! Grouped-query attention with per-head q/k RMSNorm and RoPE (Qwen3), optionally with the
//! sigmoid output gate and partial rotary embeddings of the hybrid models' full-attention layers.

use mlx_rs::fast;
use mlx_rs::Array;

use super::sdpa::{self, Mask};
use super::{Linear, Projections, RmsNorm};
use crate::batch_cache::{BatchKv, Step};
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

    /// `x` [B, heads, L, head_dim] rotated by given `angles` [L, dims / 2] (each token's own,
    /// e.g. an image's grid), the dimensions past `dims` passed through; as fast RoPE does
    /// (the halves rotate together), computed in f32 and cast back.
    pub fn rotate(&self, x: &Array, angles: &Array) -> Result<Array> {
        use mlx_rs::ops;
        use mlx_rs::ops::indexing::IndexOp;
        let (d, half) = (self.dims, self.dims / 2);
        let emb = ops::concatenate(&[angles, angles], -1)?.multiply(Array::from_f32(self.scale))?;
        let (cos, sin) = (ops::cos(&emb)?, ops::sin(&emb)?);
        let rot = x.index((.., .., .., ..d));
        let turned =
            ops::concatenate(&[rot.index((.., .., .., half..)).negative()?, rot.index((.., .., .., ..half))], -1)?;
        let out = rot.multiply(&cos)?.add(turned.multiply(&sin)?)?.as_dtype(x.dtype())?;
        if d == x.dim(-1) {
            return Ok(out);
        }
        Ok(ops::concatenate(&[out, x.index((.., .., .., d..))], -1)?)
    }

    /// `x` [B, heads, L, dims], row i starting at position `offsets[i]`.
    pub fn forward_rows(&self, x: &Array, offsets: &Array) -> Result<Array> {
        Ok(fast::rope_dynamic(x, self.dims, false, self.base, self.scale, offsets, None)?)
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
        let (q, k, v, gate) = self.project(x)?;
        let o = self.attend(&q, &k, &v, cache)?;
        self.output(&o, gate.as_ref())
    }

    /// One decode step of a batch: `x` [rows, 1, hidden], each row a sequence at its own
    /// position, every row's keys in one buffer ([`BatchKv`]): one attention for the batch.
    pub fn forward_batch(&self, x: &Array, kv: &mut BatchKv, step: &Step) -> Result<Array> {
        let (q, k, v, gate) = self.project(x)?;
        let q = self.rope.forward_rows(&q, &step.offsets)?;
        let k = self.rope.forward_rows(&k, &step.offsets)?;
        let (k, v) = kv.update_and_fetch(&k, &v, step.column)?;
        let mask = step.mask.as_ref().map_or(Mask::None, Mask::Keep);
        let o = sdpa::attention(&q, &k, &v, self.scale(), mask)?;
        self.output(&o, gate.as_ref())
    }

    /// q, k, v as [B, heads, L, head_dim] (q and k normed), and the output gate's input.
    pub(crate) fn project(&self, x: &Array) -> Result<(Array, Array, Array, Option<Array>)> {
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
        let t = |a: Array| a.transpose_axes(&[0, 2, 1, 3]);
        Ok((t(q)?, t(k)?, t(v)?, gate))
    }

    /// The attention's output [B, heads, L, head_dim] through the gate and `o_proj`.
    pub(crate) fn output(&self, o: &Array, gate: Option<&Array>) -> Result<Array> {
        let (b, l) = (o.dim(0), o.dim(2));
        let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        match gate {
            Some(gate) => self.o_proj.forward(&o.multiply(mlx_rs::ops::sigmoid(gate)?)?),
            None => self.o_proj.forward(&o),
        }
    }

    pub(crate) fn scale(&self) -> f32 {
        (self.head_dim as f64).powf(-0.5) as f32
    }

    /// One sequence's attention: q, k, v [B, heads, L, head_dim] at the cache's positions.
    fn attend(&self, q: &Array, k: &Array, v: &Array, cache: &mut KvCache) -> Result<Array> {
        let (q, k) = match cache.angles.take() {
            Some(angles) => (self.rope.rotate(q, &angles)?, self.rope.rotate(k, &angles)?),
            None => {
                let at = cache.offset + cache.rope_shift;
                (self.rope.forward(q, at)?, self.rope.forward(k, at)?)
            }
        };
        let (k, v) = cache.update_and_fetch(&k, v)?;
        // MLX's causal mode aligns the mask to the end of the keys, so it is right after a
        // cached prefix too; a single new position needs no mask.
        let mask = if q.dim(2) > 1 { Mask::Causal } else { Mask::None };
        sdpa::attention(&q, &k, &v, self.scale(), mask)
    }
}
