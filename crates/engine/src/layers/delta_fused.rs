//! A Gated DeltaNet layer's few-position step (a decode step, a verify pass) between its input
//! and output projections as one CUDA launch, through MLX's custom CUDA kernel API: the causal
//! conv over the cached tail, SiLU, q/k RMS norms and scales, the decay and β gates, the delta
//! rule, and the z-gated RMSNorm. The operations path runs these as a dozen and more MLX
//! primitives per layer and step, each built on the host; at decode, host work sets the pace.
//!
//! Layout: one thread block per (sequence, value head), `WARPS` warps; each warp keeps
//! `Dv / WARPS` rows of that head's f32 state in registers (a lane holds `Dk / 32` elements of a
//! row, strided by 32). Per position, the block computes its key head's q and k (conv, SiLU,
//! norm) into shared memory, each warp updates its rows and reads out `y`, and the block sums
//! `y²` over the head for the gated norm. Every sum runs in an order that does not depend on the
//! number of positions, so a verify pass gives bit for bit what decoding the same tokens one at a
//! time gives: greedy speculation stays equal to plain decoding.
//!
//! Rounding follows the operations path (`gated_delta::short_core_on`): values the operations
//! hold in the inputs' dtype (conv output, SiLU, normed q/k, gates, y, the normed y) are rounded
//! to it here too; the state and the sums are f32.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use crate::ffi::{CudaKernel, KernelSource, Launch, TemplateArg};

/// Warps per block (one block per sequence and value head). A block of 256 threads can always
/// launch: each thread may use up to 255 registers and still fit one SM's register file, while
/// 512 threads holding 32 state elements each did not.
const WARPS: i32 = 8;

const SOURCE: &str = r#"
    constexpr int per_lane = Dk / 32;
    constexpr int rows = Dv / Warps;             // state rows per warp
    constexpr int C = 2 * Hk * Dk + Hv * Dv;     // conv channels: q, k, v
    constexpr int P = C + Hv * Dv + 2 * Hv;      // a projection row: q k v | z | b | a
    constexpr int threads = 32 * Warps;
    const int T = proj_shape[1];
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid = warp * 32 + lane;
    const int n = blockIdx.z;                    // sequence * Hv + value head
    const int heads = gridDim.z;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);

    __shared__ float qk_s[2 * Dk];
    __shared__ float norm_s[2];
    __shared__ float sum_s[Warps];

    // The conv's input: the cached tail (K - 1 positions), then this call's positions.
    auto conv_in = [&](int p, int c) -> float {
      return p < K - 1 ? static_cast<float>(tail[((size_t)b * (K - 1) + p) * C + c])
                       : static_cast<float>(proj[((size_t)b * T + p - (K - 1)) * P + c]);
    };
    auto round_in = [](float x) -> float { return static_cast<float>(static_cast<InT>(x)); };
    auto sigmoid = [](float x) -> float { return 1.0f / (1.0f + expf(-x)); };
    // Channel c at position t after the depthwise conv and SiLU.
    auto conv_silu = [&](int t, int c) -> float {
      float acc = 0.0f;
      #pragma unroll
      for (int j = 0; j < K; ++j) acc += static_cast<float>(conv_w[c * K + j]) * conv_in(t + j, c);
      const float x = round_in(acc);
      return round_in(x * round_in(sigmoid(x)));
    };

    float row[rows][per_lane];
    #pragma unroll
    for (int r = 0; r < rows; ++r) {
      const float* row_in = state_in + ((size_t)n * Dv + warp + r * Warps) * Dk;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) row[r][i] = row_in[i * 32 + lane];
    }
    const float qk_eps = 1e-6f / Dk;
    const float q_scale = round_in(1.0f / Dk);
    const float k_scale = round_in(1.0f / sqrtf((float)Dk));
    const float rate = -expf(static_cast<float>(a_log[hv]));
    const float bias = static_cast<float>(dt_bias[hv]);

    for (int t = 0; t < T; ++t) {
      const InT* p_t = proj + ((size_t)b * T + t) * P;
      for (int i = tid; i < 2 * Dk; i += threads) {
        const int c = i < Dk ? hk * Dk + i : Hk * Dk + hk * Dk + (i - Dk);
        qk_s[i] = conv_silu(t, c);
      }
      __syncthreads();
      if (warp < 2) {                            // warp 0: q's norm, warp 1: k's
        float ss = 0.0f;
        for (int i = lane; i < Dk; i += 32) ss += qk_s[warp * Dk + i] * qk_s[warp * Dk + i];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) norm_s[warp] = rsqrtf(ss / Dk + qk_eps);
      }
      __syncthreads();
      float q[per_lane], k[per_lane];
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        q[i] = round_in(q_scale * round_in(qk_s[i * 32 + lane] * norm_s[0]));
        k[i] = round_in(k_scale * round_in(qk_s[Dk + i * 32 + lane] * norm_s[1]));
      }
      const float softplus_in = round_in(static_cast<float>(p_t[C + Hv * Dv + Hv + hv]) + bias);
      const float softplus = round_in(fmaxf(softplus_in, 0.0f) + log1pf(expf(-fabsf(softplus_in))));
      const float decay = expf(rate * softplus);
      const float beta = round_in(sigmoid(static_cast<float>(p_t[C + Hv * Dv + hv])));

      float y[rows];
      float squares = 0.0f;
      #pragma unroll
      for (int r = 0; r < rows; ++r) {
        const int dv = warp + r * Warps;
        const float v = conv_silu(t, 2 * Hk * Dk + hv * Dv + dv);
        float kv = 0.0f;
        #pragma unroll
        for (int i = 0; i < per_lane; ++i) {
          row[r][i] *= decay;
          kv += row[r][i] * k[i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
        const float delta = (v - kv) * beta;
        float out = 0.0f;
        #pragma unroll
        for (int i = 0; i < per_lane; ++i) {
          row[r][i] += k[i] * delta;
          out += row[r][i] * q[i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffffu, out, o);
        y[r] = round_in(out);
        squares += y[r] * y[r];
        if (Capture) {
          float* row_t = state_out + (((size_t)t * heads + n) * Dv + dv) * Dk;
          #pragma unroll
          for (int i = 0; i < per_lane; ++i) row_t[i * 32 + lane] = row[r][i];
        }
      }
      if (lane == 0) sum_s[warp] = squares;
      __syncthreads();
      float total = 0.0f;
      #pragma unroll
      for (int w = 0; w < Warps; ++w) total += sum_s[w];
      const float inv_rms = rsqrtf(total / Dv + 1e-6f);
      #pragma unroll
      for (int r = 0; r < rows; ++r) {
        if (lane != r % 32) continue;
        const int dv = warp + r * Warps;
        const float z = static_cast<float>(p_t[C + hv * Dv + dv]);
        const float normed = round_in(static_cast<float>(norm_w[dv]) * round_in(y[r] * inv_rms));
        y_out[((size_t)b * T + t) * (Hv * Dv) + hv * Dv + dv] = static_cast<InT>(z * sigmoid(z) * normed);
      }
      __syncthreads();                           // qk_s and sum_s are rewritten next position
    }

    if (!Capture) {
      #pragma unroll
      for (int r = 0; r < rows; ++r) {
        float* row_out = state_out + ((size_t)n * Dv + warp + r * Warps) * Dk;
        #pragma unroll
        for (int i = 0; i < per_lane; ++i) row_out[i * 32 + lane] = row[r][i];
      }
    }
    // The conv's next tail: its input's last K - 1 positions, each block a share of channels.
    constexpr int share = (C + Hv - 1) / Hv;
    for (int i = tid; i < (K - 1) * share; i += threads) {
      const int j = i / share;
      const int c = hv * share + i % share;
      if (c < C) tail_out[((size_t)b * (K - 1) + j) * C + c] = static_cast<InT>(conv_in(T + j, c));
    }
"#;

thread_local! {
    /// Made once per thread; MLX compiles one module per set of template arguments.
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

const KERNEL_SOURCE: KernelSource = KernelSource {
    name: "ferrite_gated_delta_step",
    inputs: &["proj", "tail", "conv_w", "a_log", "dt_bias", "norm_w", "state_in"],
    outputs: &["y_out", "tail_out", "state_out"],
    body: SOURCE,
};

/// Whether the kernel takes these head sizes: whole warps over the key dimension, the value
/// rows shared evenly by the block's warps.
pub fn fits(head_k_dim: i32, head_v_dim: i32) -> bool {
    head_k_dim > 0 && head_k_dim % 32 == 0 && head_k_dim <= 256 && head_v_dim > 0 && head_v_dim % WARPS == 0
}

/// The step's inputs: `proj` [B, S, P], the input projections' outputs side by side (q k v,
/// z, b, a: P = C + Hv Dv + 2 Hv); the conv's cached `tail` [B, K - 1, C] and weights
/// `conv_weight` [C, K, 1]; `a_log`, `dt_bias` [Hv]; the gated norm's weight [Dv]; the
/// recurrent `state` [B, Hv, Dv, Dk] f32.
pub struct Step<'a> {
    pub proj: &'a Array,
    pub tail: &'a Array,
    pub conv_weight: &'a Array,
    pub a_log: &'a Array,
    pub dt_bias: &'a Array,
    pub norm_weight: &'a Array,
    pub state: &'a Array,
}

/// What a step gives back: the gated, normed output [B, S, Hv Dv] (the output projection's
/// input), the conv's next tail, and the state after each position (`capture`) or the final one.
pub struct Stepped {
    pub y: Array,
    pub tail: Array,
    pub states: Vec<Array>,
}

/// Runs the step in one launch (lazy, like any op).
pub fn run(step: &Step, capture: bool) -> Result<Stepped, Exception> {
    let Step { proj, tail, conv_weight, a_log, dt_bias, norm_weight, state } = *step;
    let (b, s) = (proj.dim(0), proj.dim(1));
    let (channels, kernel) = (conv_weight.dim(0), conv_weight.dim(1));
    let (hv, dv, dk) = (a_log.dim(0), norm_weight.dim(0), state.dim(-1));
    let hk = if dk > 0 { (channels - hv * dv) / (2 * dk) } else { 0 };
    let shapes_agree = hk > 0
        && hv % hk == 0
        && 2 * hk * dk + hv * dv == channels
        && proj.dim(-1) == channels + hv * dv + 2 * hv
        && tail.shape() == [b, kernel - 1, channels]
        && state.shape() == [b, hv, dv, dk];
    if !fits(dk, dv) || !shapes_agree || kernel < 1 {
        return Err(Exception::custom(format!(
            "the fused CUDA delta step does not take these shapes: proj {:?}, tail {:?}, conv {:?}, state {:?}",
            proj.shape(),
            tail.shape(),
            conv_weight.shape(),
            state.shape()
        )));
    }
    let in_t = proj.dtype();
    let (tail, state) = (tail.as_dtype(in_t)?, state.as_dtype(Dtype::Float32)?);
    let y_shape = [b, s, hv * dv];
    let tail_shape = [b, kernel - 1, channels];
    let states_shape = if capture { vec![s, b, hv, dv, dk] } else { vec![b, hv, dv, dk] };
    let template = [
        ("InT", TemplateArg::Dtype(in_t)),
        ("Dk", TemplateArg::Int(dk)),
        ("Dv", TemplateArg::Int(dv)),
        ("Hk", TemplateArg::Int(hk)),
        ("Hv", TemplateArg::Int(hv)),
        ("K", TemplateArg::Int(kernel)),
        ("Warps", TemplateArg::Int(WARPS)),
        ("Capture", TemplateArg::Bool(capture)),
        // Unused in the source, but part of the compiled module's name: MLX keeps one module
        // per name, and the other inputs' dtypes are in its signature.
        ("ConvT", TemplateArg::Dtype(conv_weight.dtype())),
        ("ALogT", TemplateArg::Dtype(a_log.dtype())),
        ("BiasT", TemplateArg::Dtype(dt_bias.dtype())),
        ("NormT", TemplateArg::Dtype(norm_weight.dtype())),
    ];
    let launch = Launch {
        outputs: &[(&y_shape, in_t), (&tail_shape, in_t), (&states_shape, Dtype::Float32)],
        grid: (32, WARPS, b * hv),
        block: (32, WARPS, 1),
        template: &template,
    };
    let inputs = [proj, &tail, conv_weight, a_log, dt_bias, norm_weight, &state];
    let out = KERNEL_SOURCE.apply(&KERNEL, &inputs, &launch)?;
    let [y, tail, states] = <[Array; 3]>::try_from(out)
        .map_err(|_| Exception::custom("the fused CUDA delta step returned other than three arrays"))?;
    let states = if capture { (0..s).map(|i| states.index(i)).collect() } else { vec![states] };
    Ok(Stepped { y, tail, states })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_the_hybrids_head_sizes_only() {
        assert!(fits(128, 128));
        assert!(fits(64, 64));
        assert!(!fits(48, 128), "Dk must be whole warps");
        assert!(!fits(128, 36), "the value rows must share evenly among the warps");
        assert!(!fits(512, 128), "a lane holds at most 8 elements of a row");
    }
}
