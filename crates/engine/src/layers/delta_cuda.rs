//! The engine's own CUDA kernel for the gated delta rule over a few positions (a decode step,
//! a verify pass, a short prompt), through MLX's custom CUDA kernel API: MLX has no CUDA
//! implementation of it. One launch runs every position; with `capture` it also writes the
//! state after each position, which a verify pass keeps for an exact rollback.
//!
//! Layout: one warp per (sequence, value head, value row); each lane keeps Dk / 32 elements of
//! that state row in registers (rounded up: a key size that is not whole warps, such as the
//! embedded model's 48, leaves the last lanes' extra elements at zero, which add nothing to
//! a sum), strided by 32 so the warp reads and writes whole lines. Per
//! position: decay the row, `kv = row · k` (a warp sum), `delta = (v - kv) β`, `row += k delta`,
//! `y = row · q` (a warp sum). The arithmetic is f32 whatever the inputs' dtype, as the
//! operations path's: q, k, v in their dtype, decay and β as f32, the state f32.
//!
//! The sums run in a fixed order that does not depend on the number of positions, so a verify
//! pass produces bit for bit the states and outputs that decoding the same tokens one at a
//! time does: greedy speculation stays equal to plain decoding.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use crate::ffi::{CudaKernel, KernelSource, Launch, TemplateArg};

const SOURCE: &str = r#"
    constexpr int per_lane = (Dk + 31) / 32;  // the last element may lie past Dk: kept at zero
    const int T = q_shape[1];            // read at run time: one kernel for every length
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;            // sequence * Hv + value head
    const int heads = gridDim.z;         // B * Hv
    if (dv >= Dv) return;                // whole warps leave together: dv is per warp
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);

    const float* row_in = state_in + ((size_t)n * Dv + dv) * Dk;
    float row[per_lane];
    #pragma unroll
    for (int i = 0; i < per_lane; ++i) row[i] = i * 32 + lane < Dk ? row_in[i * 32 + lane] : 0.0f;

    for (int t = 0; t < T; ++t) {
      const size_t bt = (size_t)b * T + t;
      const InT* q_t = q + (bt * Hk + hk) * Dk;
      const InT* k_t = k + (bt * Hk + hk) * Dk;
      const float decay = g[bt * Hv + hv];
      const float rate = beta[bt * Hv + hv];
      float kv = 0.0f;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        const float kj = i * 32 + lane < Dk ? static_cast<float>(k_t[i * 32 + lane]) : 0.0f;
        row[i] *= decay;
        kv += row[i] * kj;
      }
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
      const float delta = (static_cast<float>(v[(bt * Hv + hv) * Dv + dv]) - kv) * rate;
      float out = 0.0f;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        const bool in = i * 32 + lane < Dk;
        row[i] += (in ? static_cast<float>(k_t[i * 32 + lane]) : 0.0f) * delta;
        out += row[i] * (in ? static_cast<float>(q_t[i * 32 + lane]) : 0.0f);
      }
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffffu, out, o);
      if (lane == 0) y[(bt * Hv + hv) * Dv + dv] = static_cast<InT>(out);
      if (Capture) {
        float* row_t = state_out + (((size_t)t * heads + n) * Dv + dv) * Dk;
        #pragma unroll
        for (int i = 0; i < per_lane; ++i) if (i * 32 + lane < Dk) row_t[i * 32 + lane] = row[i];
      }
    }
    if (!Capture) {
      float* row_out = state_out + ((size_t)n * Dv + dv) * Dk;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) if (i * 32 + lane < Dk) row_out[i * 32 + lane] = row[i];
    }
"#;

thread_local! {
    /// Made once per thread; MLX compiles one module per set of template arguments.
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

const KERNEL_SOURCE: KernelSource = KernelSource {
    name: "ferrite_gated_delta",
    inputs: &["q", "k", "v", "g", "beta", "state_in"],
    outputs: &["y", "state_out"],
    body: SOURCE,
};

/// The largest key size a warp's registers hold (8 elements a lane).
const MAX_DK: i32 = 256;

/// Whether the kernel takes key heads of this size (any up to `MAX_DK`; a layer launches it
/// only on a use that passed its check at the model's load, `delta_check::check_model`).
pub fn fits(head_k_dim: i32) -> bool {
    head_k_dim > 0 && head_k_dim <= MAX_DK
}

/// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] f32.
/// Returns y [B, T, Hv, Dv] in q's dtype and the state after each position (`capture`) or
/// the final one.
pub fn run(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
    capture: bool,
) -> Result<(Array, Vec<Array>), Exception> {
    let (b, t, hk, dk) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (hv, dv) = (v.dim(2), v.dim(3));
    if dk <= 0 || dk > MAX_DK || hv % hk != 0 {
        return Err(Exception::custom(format!(
            "the CUDA delta kernel takes Dk up to 256 and value heads a multiple of the key heads, not Dk {dk}, {hv} value and {hk} key heads"
        )));
    }
    let (g, beta) = (g.as_dtype(Dtype::Float32)?, beta.as_dtype(Dtype::Float32)?);
    let state = state.as_dtype(Dtype::Float32)?;
    let y_shape = [b, t, hv, dv];
    let states_shape = if capture { vec![t, b, hv, dv, dk] } else { vec![b, hv, dv, dk] };
    let rows_per_block = if dv % 4 == 0 { 4 } else { 1 };
    let template = [
        ("InT", TemplateArg::Dtype(q.dtype())),
        ("Dk", TemplateArg::Int(dk)),
        ("Dv", TemplateArg::Int(dv)),
        ("Hk", TemplateArg::Int(hk)),
        ("Hv", TemplateArg::Int(hv)),
        ("Capture", TemplateArg::Bool(capture)),
    ];
    let launch = Launch {
        outputs: &[(&y_shape, q.dtype()), (&states_shape, Dtype::Float32)],
        grid: (32, dv, b * hv),
        block: (32, rows_per_block, 1),
        template: &template,
    };
    let inputs = [q, k, &v.as_dtype(q.dtype())?, &g, &beta, &state];
    let out = KERNEL_SOURCE.apply(&KERNEL, &inputs, &launch)?;
    let mut out = out.into_iter();
    let (Some(y), Some(states)) = (out.next(), out.next()) else {
        return Err(Exception::custom("the CUDA delta kernel returned fewer than two arrays"));
    };
    if capture {
        let states = (0..t).map(|i| states.index(i)).collect();
        Ok((y, states))
    } else {
        Ok((y, vec![states]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_heads_up_to_a_warps_registers_fit() {
        assert!(fits(128) && fits(64) && fits(256) && fits(48));
        assert!(!fits(512) && !fits(0));
    }
}
