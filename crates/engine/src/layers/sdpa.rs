//! Attention's core, softmax(q·kᵀ·scale, masked)·v, for q, k, v as [batch, heads, positions,
//! head_dim] (k and v with fewer heads under grouped-query attention).
//!
//! MLX's fused kernel runs it everywhere but in one case. On CUDA, MLX gives a few-query shape
//! (a verify pass's positions, a batch's masked decode step) to cuDNN, which builds a graph
//! for every new key length — so for every step, since the keys grow by one — spending a
//! step's worth of host time on the build and, once a process has met 512 key lengths,
//! stopping with "Cache thrashing is happening". Those shapes are written here as the
//! matmuls and softmax MLX's own fallback uses, on CUDA only (Metal's vector kernels take
//! them as they are). So are the passes a little longer whose scores stay small: a drafter
//! catching up on the tokens a plain stretch decoded (17 to a few hundred positions, a new
//! key length each time), a short prompt's prefill — each would otherwise build a graph of
//! its own. Only long passes over long contexts, where the scores would not fit, go to cuDNN.

use std::cell::RefCell;

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::{ops, Array, Dtype};

use crate::device::{backend, Backend};
use crate::error::Result;

/// Which key positions each query may see.
pub enum Mask<'a> {
    /// All of them (one new position after its cache).
    None,
    /// Causal, aligned to the end of the keys (the new positions follow a cached prefix).
    Causal,
    /// True where a query may attend, broadcast against [batch, heads, queries, keys].
    Keep(&'a Array),
}

/// Passes of up to this many queries take the written-out form on CUDA whatever their
/// context (a verify pass's, a batch's masked decode step).
const FEW_QUERIES: i32 = 16;
/// Longer passes take it while their scores (batch x heads x queries x keys, float32) stay
/// within this many: 64 MiB, a transient beside any model's weights.
const WRITTEN_OUT_SCORES: i64 = 1 << 24;

pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>) -> Result<Array> {
    if on_cuda() && writes_out(q.shape(), k.dim(2), &mask) {
        return written_out(q, k, v, scale, mask);
    }
    let mask = match mask {
        Mask::None => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Keep(keep) => Some(ScaledDotProductAttentionMask::Array(keep)),
    };
    Ok(fast::scaled_dot_product_attention(q, k, v, scale, mask, None)?)
}

/// Whether a pass of queries `q_shape` [batch, heads, queries, dim] over `keys` keys takes the
/// written-out form on CUDA. One query with no mask array is MLX's vector kernel's (no graph).
fn writes_out(q_shape: &[i32], keys: i32, mask: &Mask<'_>) -> bool {
    let queries = q_shape[2];
    if queries == 1 && !matches!(mask, Mask::Keep(_)) {
        return false;
    }
    let scores = i64::from(q_shape[0]) * i64::from(q_shape[1]) * i64::from(queries) * i64::from(keys);
    queries <= FEW_QUERIES || scores <= WRITTEN_OUT_SCORES
}

fn on_cuda() -> bool {
    static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CUDA.get_or_init(|| backend() == Backend::Cuda)
}

/// The same attention as matmuls and a softmax (in float32, as MLX's fused kernels and its
/// fallback compute it), query heads grouped over their key/value head.
///
/// Each key/value head's query heads and positions are the rows of one matrix, so the
/// matmuls' batch is [batch, kv_heads] alone: MLX's CUDA matmul runs that as one strided
/// batched GEMM, where a broadcast group axis (keys expanded over their query heads) makes it
/// launch a GEMM per key/value head, twice a layer.
pub fn written_out(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>) -> Result<Array> {
    let (batch, heads, queries, dim) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (kv_heads, keys) = (k.dim(1), k.dim(2));
    let group = heads / kv_heads;
    let rows = group * queries;
    let q = q.multiply(constant(scale, q.dtype())?)?.reshape(&[batch, kv_heads, rows, dim])?;
    let scores = q.matmul(&k.swap_axes(-1, -2)?)?; // [batch, kv_heads, group * queries, keys]
    let keep = match mask {
        Mask::None => None,
        Mask::Causal => Some(causal(queries, keys)?),
        Mask::Keep(keep) => Some(keep.expand_dims(2)?),
    };
    let scores = match keep {
        Some(keep) => {
            // The masks speak of [batch, heads, queries, keys]: seen with the group apart.
            let grouped = scores.reshape(&[batch, kv_heads, group, queries, keys])?;
            let hidden = constant(f32::NEG_INFINITY, scores.dtype())?;
            ops::select(&keep, &grouped, &hidden)?.reshape(&[batch, kv_heads, rows, keys])?
        }
        None => scores,
    };
    let weights = ops::softmax_axis(&scores, -1, true)?;
    let out = weights.matmul(v)?; // [batch, kv_heads, group * queries, dim]
    Ok(out.reshape(&[batch, heads, queries, dim])?)
}

thread_local! {
    /// The last causal mask built, by (queries, keys): every attention layer of a pass asks
    /// for the same one, so a pass builds it once, not once a layer.
    static CAUSAL: RefCell<Option<((i32, i32), Array)>> = const { RefCell::new(None) };
    /// Scalars in the dtypes asked for (the scale, minus infinity), made once per thread: each
    /// conversion would otherwise be an operation of its own in every layer of every pass.
    static CONSTANTS: RefCell<Vec<(u32, Dtype, Array)>> = const { RefCell::new(Vec::new()) };
}

/// True where query i (at key position keys - queries + i) may see key j: [queries, keys].
fn causal(queries: i32, keys: i32) -> Result<Array> {
    CAUSAL.with_borrow_mut(|last| {
        if let Some((shape, keep)) = last.as_ref() {
            if *shape == (queries, keys) {
                return Ok(keep.clone());
            }
        }
        let at = ops::arange::<_, i32>(keys - queries, keys, None)?.reshape(&[queries, 1])?;
        let keep = ops::arange::<_, i32>(0, keys, None)?.le(&at)?;
        *last = Some(((queries, keys), keep.clone()));
        Ok(keep)
    })
}

/// `value` as a 0-d array of `dtype`.
fn constant(value: f32, dtype: Dtype) -> Result<Array> {
    CONSTANTS.with_borrow_mut(|made| {
        if let Some((_, _, c)) = made.iter().find(|(bits, d, _)| *bits == value.to_bits() && *d == dtype) {
            return Ok(c.clone());
        }
        let c = Array::from_f32(value).as_dtype(dtype)?;
        made.push((value.to_bits(), dtype, c.clone()));
        Ok(c)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn close(a: &Array, b: &Array) -> f32 {
        a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>()
    }

    fn qkv(queries: i32, keys: i32) -> (Array, Array, Array) {
        let n =
            |seed: u64, shape: &[i32]| random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap();
        (n(1, &[2, 8, queries, 64]), n(2, &[2, 2, keys, 64]), n(3, &[2, 2, keys, 64]))
    }

    #[test]
    fn the_written_out_form_matches_the_fused_kernel() {
        let scale = 0.125;
        // A verify pass of 4 positions after 29 cached ones, causal.
        let (q, k, v) = qkv(4, 33);
        let fused = fast::scaled_dot_product_attention(&q, &k, &v, scale, ScaledDotProductAttentionMask::Causal, None);
        assert!(close(&written_out(&q, &k, &v, scale, Mask::Causal).unwrap(), &fused.unwrap()) < 1e-5);
        // A batch's decode step: one query per row, the first row's first 5 keys padding.
        let (q, k, v) = qkv(1, 12);
        let pads = Array::from_slice(&[5, 0], &[2, 1, 1, 1]);
        let keep = ops::arange::<_, i32>(0, 12, None).unwrap().ge(&pads).unwrap();
        let fused =
            fast::scaled_dot_product_attention(&q, &k, &v, scale, ScaledDotProductAttentionMask::Array(&keep), None);
        assert!(close(&written_out(&q, &k, &v, scale, Mask::Keep(&keep)).unwrap(), &fused.unwrap()) < 1e-5);
        // One position, nothing masked.
        let fused = fast::scaled_dot_product_attention(&q, &k, &v, scale, None, None);
        assert!(close(&written_out(&q, &k, &v, scale, Mask::None).unwrap(), &fused.unwrap()) < 1e-5);
    }

    /// A drafter's catch-up after a plain stretch (40 positions after 90 cached ones) and a
    /// short prompt take the written-out form on CUDA, and agree with the fused kernel; a
    /// long pass over a long context goes to the fused kernel, one query without a mask to
    /// MLX's vector kernel.
    #[test]
    fn passes_whose_scores_are_small_are_written_out() {
        let (q, k, v) = qkv(40, 130);
        let fused = fast::scaled_dot_product_attention(&q, &k, &v, 0.125, ScaledDotProductAttentionMask::Causal, None);
        assert!(close(&written_out(&q, &k, &v, 0.125, Mask::Causal).unwrap(), &fused.unwrap()) < 1e-5);
        assert!(writes_out(&[1, 16, 40, 64], 130, &Mask::Causal));
        assert!(writes_out(&[1, 32, 256, 128], 2048, &Mask::Causal));
        assert!(writes_out(&[1, 32, 4, 128], 1 << 20, &Mask::Causal));
        assert!(!writes_out(&[1, 32, 2048, 128], 8192, &Mask::Causal));
        assert!(!writes_out(&[1, 32, 1, 128], 8192, &Mask::None));
        let keep = Array::from_bool(true);
        assert!(writes_out(&[1, 32, 1, 128], 8192, &Mask::Keep(&keep)));
    }

    /// The GPU runs bf16 checkpoints: the masked scores and the softmax keep that dtype's
    /// answer (within its precision) and hand back bf16.
    #[test]
    fn the_written_out_form_keeps_bfloat16() {
        let bf16 = |a: Array| a.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
        let (q, k, v) = qkv(3, 20);
        let (q, k, v) = (bf16(q), bf16(k), bf16(v));
        let ours = written_out(&q, &k, &v, 0.125, Mask::Causal).unwrap();
        assert_eq!(ours.dtype(), mlx_rs::Dtype::Bfloat16);
        let fused =
            fast::scaled_dot_product_attention(&q, &k, &v, 0.125, ScaledDotProductAttentionMask::Causal, None).unwrap();
        let f32 = |a: &Array| a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        assert!(close(&f32(&ours), &f32(&fused)) < 2e-2);
    }
}
