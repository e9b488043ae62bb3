//! Rejection sampling of a cycle's drafts against the verify pass's distributions, on the
//! host: what keeps a sampled speculative answer distributed as plain sampling's.

use mlx_rs::Array;
use rand::rngs::StdRng;
use rand::Rng;

use crate::error::Result;

/// Accepts draft i with probability min(1, p_i(d) / q_i(d)); the first rejection draws
/// from max(0, p_i - q_i) renormalised; if all pass, the bonus token comes from p_depth.
/// Without `q` each draft is a point mass: accepted with probability p_i(d), the residual
/// is p_i without d.
pub(super) fn sample(rng: &mut StdRng, drafts: &[u32], p: &Array, q: Option<&[Array]>) -> Result<(usize, u32)> {
    let vocab = p.dim(-1) as usize;
    let p_all = p.as_slice::<f32>();
    for (i, &d) in drafts.iter().enumerate() {
        let p_i = &p_all[i * vocab..(i + 1) * vocab];
        let q_i = q.map(|q| q[i].as_slice::<f32>());
        let (pd, qd) = (p_i[d as usize], q_i.map_or(1.0, |q_i| q_i[d as usize]));
        if qd > 0.0 && rng.random::<f32>() * qd < pd {
            continue;
        }
        let residual: Vec<f32> = match q_i {
            Some(q_i) => p_i.iter().zip(q_i).map(|(a, b)| (a - b).max(0.0)).collect(),
            None => p_i.iter().enumerate().map(|(t, &a)| if t == d as usize { 0.0 } else { a }).collect(),
        };
        return Ok((i, draw(rng, &residual).unwrap_or_else(|| draw(rng, p_i).unwrap_or(0))));
    }
    let last = &p_all[drafts.len() * vocab..(drafts.len() + 1) * vocab];
    Ok((drafts.len(), draw(rng, last).unwrap_or(0)))
}

/// Samples an index from unnormalised non-negative weights; `None` if they sum to 0.
fn draw(rng: &mut StdRng, weights: &[f32]) -> Option<u32> {
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    if total <= 0.0 {
        return None;
    }
    let mut r = rng.random::<f64>() * total;
    for (i, &w) in weights.iter().enumerate() {
        r -= w as f64;
        if r < 0.0 {
            return Some(i as u32);
        }
    }
    weights.iter().rposition(|&w| w > 0.0).map(|i| i as u32)
}
