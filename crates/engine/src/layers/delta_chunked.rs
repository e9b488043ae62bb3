//! The gated delta rule over a long sequence in chunks of [`CHUNK`] positions, so prefill
//! costs a few batched matmuls per chunk instead of a graph per position.
//!
//! Per head, with state S [Dv, Dk] mapping keys to values, a position does
//! `S ← g·S;  u = β (v − S k);  S ← S + u kᵀ;  y = S q`. Within a chunk entered with state
//! S₀, with γ_t the product of the decays up to t (so γ_t/γ_j ≤ 1 for j ≤ t):
//!
//! * the written values U (rows u_t) solve `(I + L) U = diag(β) V − diag(βγ) K S₀ᵀ`, with
//!   `L_tj = β_t (γ_t/γ_j) k_t·k_j` for j < t. L is strictly lower triangular, so
//!   `(I + L)⁻¹ = (I − L)(I + L²)(I + L⁴)…`: log₂(CHUNK) matmuls, no solver (which MLX runs
//!   on the CPU only). W = (I+L)⁻¹ diag(β) V and K' = (I+L)⁻¹ diag(βγ) K do not depend on S₀
//!   and are computed for all chunks at once; then U = W − K' S₀ᵀ.
//! * outputs `Y = diag(γ) Q S₀ᵀ + (M ⊙ Q Kᵀ) U` with `M_tj = γ_t/γ_j` for j ≤ t;
//! * the next state `S = γ_C S₀ + Uᵀ diag(γ_C/γ_j) K`.
//!
//! Only U and the next state run chunk after chunk; the outputs then take every chunk's
//! entering state at once. Everything is f32.

use mlx_rs::ops::indexing::{IndexOp, NewAxis};
use mlx_rs::{ops, Array, Dtype};

use crate::error::Result;

pub const CHUNK: i32 = 64;

/// q, k: [B, T, H, Dk] (already repeated to the value heads); v: [B, T, H, Dv];
/// g, beta: [B, T, H]; state: [B, H, Dv, Dk] f32. Returns y [B, T, H, Dv] in q's dtype and
/// the final state.
pub fn delta_rule_chunked(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Array,
) -> Result<(Array, Array)> {
    let (b, t, h) = (q.dim(0), q.dim(1), q.dim(2));
    let (dk, dv) = (q.dim(3), v.dim(3));
    let n = (t + CHUNK - 1) / CHUNK;
    let pad = n * CHUNK - t;
    let f32 = |x: &Array| x.as_dtype(Dtype::Float32);
    // Padding positions write nothing (beta = 0) and do not decay (g = 1).
    let padded = |x: Array, value: f32| -> Result<Array> {
        if pad == 0 {
            return Ok(x);
        }
        let mut widths = vec![(0, 0); x.ndim()];
        widths[1] = (0, pad);
        Ok(ops::pad(&x, widths.as_slice(), Array::from_f32(value), None)?)
    };
    // [B, T, H, D] -> [B, H, N, C, D]
    let chunks =
        |x: Array, d: i32| -> Result<Array> { Ok(x.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, h, n, CHUNK, d])?) };
    let q = chunks(padded(f32(q)?, 0.0)?, dk)?;
    let k = chunks(padded(f32(k)?, 0.0)?, dk)?;
    let v = chunks(padded(f32(v)?, 0.0)?, dv)?;
    let per_pos = |x: Array| -> Result<Array> { Ok(x.transpose_axes(&[0, 2, 1])?.reshape(&[b, h, n, CHUNK])?) };
    let beta = per_pos(padded(f32(beta)?, 0.0)?)?;
    // A decay that underflowed to 0 would give log 0 - log 0 = NaN below; 1e-30 forgets the
    // state just as completely.
    let log_g = per_pos(padded(ops::log(ops::maximum(f32(g)?, Array::from_f32(1e-30))?)?, 0.0)?)?;

    // Decay ratios inside each chunk, in log space so long chunks cannot overflow.
    let lc = log_g.cumsum(-1, None, None)?; // log γ_t
    let diff = lc.index((.., .., .., .., NewAxis)).subtract(lc.index((.., .., .., NewAxis, ..)))?; // log γ_t/γ_j
    let lower_incl = ops::tril(ops::ones::<bool>(&[CHUNK, CHUNK])?, 0)?;
    let lower_strict = ops::tril(ops::ones::<bool>(&[CHUNK, CHUNK])?, -1)?;
    let zero = Array::from_f32(0.0);
    let ratio = |mask: &Array| -> Result<Array> {
        let e = ops::exp(ops::select(mask, &diff, &zero)?)?;
        Ok(ops::select(mask, &e, &zero)?)
    };
    let (m_incl, m_strict) = (ratio(&lower_incl)?, ratio(&lower_strict)?);
    let kt = k.swap_axes(-1, -2)?;

    // (I + L)^-1 with L nilpotent.
    let l = beta.index((.., .., .., .., NewAxis)).multiply(&m_strict)?.multiply(k.matmul(&kt)?)?;
    let neg = l.negative()?;
    let eye = ops::eye::<f32>(CHUNK, None, None)?;
    let mut inv = eye.add(&neg)?;
    let mut power = neg;
    let mut span = 2;
    while span < CHUNK {
        power = power.matmul(&power)?;
        inv = inv.matmul(eye.add(&power)?)?;
        span *= 2;
    }
    let gamma = ops::exp(&lc)?; // γ_t
    let w = inv.matmul(beta.index((.., .., .., .., NewAxis)).multiply(&v)?)?;
    let k_prime = inv.matmul(beta.multiply(&gamma)?.index((.., .., .., .., NewAxis)).multiply(&k)?)?;
    let attn = m_incl.multiply(q.matmul(&kt)?)?;
    let last = lc.index((.., .., .., CHUNK - 1..CHUNK)); // log γ_C
    let k_to_end = ops::exp(last.subtract(&lc)?)?.index((.., .., .., .., NewAxis)).multiply(&k)?; // diag(γ_C/γ_j) K
    let gamma_c = ops::exp(&last)?; // [B, H, N, 1]

    // Chunk after chunk only what needs the entering state: U, then the next state. Three
    // kernels a chunk (a fused multiply-add for U, a scale and a fused multiply-add for S);
    // the outputs, which need every chunk's entering state but nothing after, follow as two
    // batched matmuls over all chunks at once.
    let mut s = state;
    let (mut entering, mut us) = (Vec::with_capacity(n as usize), Vec::with_capacity(n as usize));
    for c in 0..n {
        let at = |x: &Array| x.index((.., .., c));
        let u = ops::addmm(at(&w), at(&k_prime), s.swap_axes(-1, -2)?, -1.0, 1.0)?; // W − K' S₀ᵀ
        let next = ops::addmm(
            at(&gamma_c).index((.., .., .., NewAxis)).multiply(&s)?,
            u.swap_axes(-1, -2)?,
            at(&k_to_end),
            1.0,
            1.0,
        )?;
        entering.push(s);
        us.push(u);
        s = next;
    }
    let (s0, u) = (ops::stack(&entering, 2)?, ops::stack(&us, 2)?); // [B, H, N, Dv, Dk], [B, H, N, C, Dv]
    let y = gamma.index((.., .., .., .., NewAxis)).multiply(q.matmul(s0.swap_axes(-1, -2)?)?)?.add(attn.matmul(&u)?)?;
    let y = y.reshape(&[b, h, n * CHUNK, dv])?;
    let y = y.index((.., .., ..t, ..)).transpose_axes(&[0, 2, 1, 3])?;
    Ok((y, s))
}

#[cfg(test)]
mod tests {
    use mlx_rs::{random, Array};

    use super::*;
    use crate::layers::gated_delta::delta_rule;

    fn max_rel_diff(a: &Array, b: &Array) -> f32 {
        let d = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
        let m = b.abs().unwrap().max(None).unwrap().item_cast::<f32>();
        d / m.max(1e-6)
    }

    #[test]
    fn chunked_equals_step_by_step() {
        let (b, t, h, dk, dv) = (1, 150, 3, 16, 8);
        let key = |i| random::key(i).unwrap();
        let unit = |x: Array| x.divide(x.square().unwrap().sum_axis(-1, true).unwrap().sqrt().unwrap()).unwrap();
        let q = unit(random::normal::<f32>(&[b, t, h, dk][..], None, None, &key(1)).unwrap());
        let k = unit(random::normal::<f32>(&[b, t, h, dk][..], None, None, &key(2)).unwrap());
        let v = random::normal::<f32>(&[b, t, h, dv][..], None, None, &key(3)).unwrap();
        let g = random::uniform::<f32, f32>(0.05, 1.0, &[b, t, h][..], &key(4)).unwrap();
        let beta = random::uniform::<f32, f32>(0.0, 1.0, &[b, t, h][..], &key(5)).unwrap();
        let s0 = random::normal::<f32>(&[b, h, dv, dk][..], None, None, &key(6)).unwrap();
        let (y_step, states) = delta_rule(&q, &k, &v, &g, &beta, s0.clone(), false).unwrap();
        let (y_chunk, s_chunk) = delta_rule_chunked(&q, &k, &v, &g, &beta, s0.clone()).unwrap();
        let (dy, ds) = (max_rel_diff(&y_chunk, &y_step), max_rel_diff(&s_chunk, states.last().unwrap()));
        assert!(dy < 1e-5 && ds < 1e-5, "f32: relative differences y {dy:e}, state {ds:e}");
        // bf16 inputs (as a bf16 model gives them): the state is still f32-exact, y within
        // one bf16 rounding of the step-by-step result.
        let bf = |x: &Array| x.as_dtype(Dtype::Bfloat16).unwrap();
        let (q, k, v, beta) = (bf(&q), bf(&k), bf(&v), bf(&beta));
        let (y_step, states) = delta_rule(&q, &k, &v, &g, &beta, s0.clone(), false).unwrap();
        let (y_chunk, s_chunk) = delta_rule_chunked(&q, &k, &v, &g, &beta, s0).unwrap();
        let (dy, ds) = (max_rel_diff(&y_chunk, &y_step), max_rel_diff(&s_chunk, states.last().unwrap()));
        assert!(dy < 8e-3 && ds < 1e-5, "bf16: relative differences y {dy:e}, state {ds:e}");
    }

    /// Operations other than views (slices, reshapes, transposes, broadcasts: no kernels
    /// on a GPU) that each further chunk adds to the graph: only the sequential part grows
    /// with the number of chunks, the rest is batched over all of them.
    fn kernels_per_chunk() -> usize {
        const VIEWS: [&str; 6] = ["Slice", "Reshape", "Transpose", "ExpandDims", "Broadcast", "Squeeze"];
        let count = |t: i32| {
            let (b, h, d) = (1, 2, 8);
            let x = |i| random::normal::<f32>(&[b, t, h, d][..], None, None, &random::key(i).unwrap()).unwrap();
            let g = ops::ones::<f32>(&[b, t, h]).unwrap();
            let s0 = ops::zeros::<f32>(&[b, h, d, d]).unwrap();
            let (q, k, v) = (x(1), x(2), x(3));
            mlx_rs::transforms::eval([&q, &k, &v, &g, &s0]).unwrap();
            let (y, s) = delta_rule_chunked(&q, &k, &v, &g, &g, s0).unwrap();
            let ops = crate::ffi::pending_primitives(&[y, s]).unwrap();
            ops.iter().filter(|kind| !VIEWS.contains(&kind.as_str())).count()
        };
        (count(6 * CHUNK) - count(2 * CHUNK)) / 4
    }

    #[test]
    fn each_chunk_adds_three_kernels() {
        // U as one fused multiply-add, the state's decay, the next state as one fused
        // multiply-add (the step-by-step form of the outputs took ten).
        assert_eq!(kernels_per_chunk(), 3);
    }

    #[test]
    fn a_decay_of_zero_resets_the_state_without_nan() {
        let (b, t, h, d) = (1, 70, 2, 8);
        let key = |i| random::key(i).unwrap();
        let q = random::normal::<f32>(&[b, t, h, d][..], None, None, &key(1)).unwrap();
        let k = random::normal::<f32>(&[b, t, h, d][..], None, None, &key(2)).unwrap();
        let v = random::normal::<f32>(&[b, t, h, d][..], None, None, &key(3)).unwrap();
        let beta = random::uniform::<f32, f32>(0.0, 1.0, &[b, t, h][..], &key(5)).unwrap();
        let g = ops::zeros::<f32>(&[b, t, h]).unwrap();
        let s0 = ops::zeros::<f32>(&[b, h, d, d]).unwrap();
        let (y_step, _) = delta_rule(&q, &k, &v, &g, &beta, s0.clone(), false).unwrap();
        let (y_chunk, _) = delta_rule_chunked(&q, &k, &v, &g, &beta, s0).unwrap();
        assert!(max_rel_diff(&y_chunk, &y_step) < 1e-5);
    }
}
