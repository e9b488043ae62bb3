//! A mixture-of-experts layer's few-token step around its gathered matmuls as two CUDA
//! launches (the `cuda-fused` path, `delta_path.rs`), through MLX's custom CUDA kernel API:
//!
//! - [`route`]: the router's logits → the chosen experts' ids (the shared expert's appended)
//!   and their weights (the softmax scores, normalised when the model asks; the shared
//!   expert's sigmoid gate). The operations take a split, a softmax, an argpartition, a slice,
//!   a gather and a concatenation for this, each built on the host.
//! - [`combine`]: the experts' outputs weighted, summed and added to the residual, where the
//!   operations take two slices and a compiled graph of four primitives.
//!
//! Both follow the operations' rounding (`moe.rs`): values the operations hold in the inputs'
//! dtype are rounded to it. Experts whose probabilities tie at the k-th place are chosen by
//! the lower id (the operations' argpartition leaves ties unordered).

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::ffi::{CudaKernel, KernelSource, Launch, TemplateArg};

const ROUTE_SOURCE: &str = r#"
    constexpr int per_lane = (E + 31) / 32;
    constexpr int slots = K + (Shared ? 1 : 0);
    constexpr int W = E + (Shared ? 1 : 0);      // a logits row: the experts', then the gate's
    const int n = blockIdx.z;
    const int lane = threadIdx.x;
    const InT* row = logits + (size_t)n * W;
    auto round_in = [](float x) -> float { return static_cast<float>(static_cast<InT>(x)); };
    const float neg_inf = -__int_as_float(0x7f800000);   // no math header is included

    // The softmax in f32 (as MLX's precise softmax), rounded to the inputs' dtype.
    float p[per_lane];
    float top = neg_inf;
    #pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      const int e = i * 32 + lane;
      p[i] = e < E ? static_cast<float>(row[e]) : neg_inf;
      top = fmaxf(top, p[i]);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float total = 0.0f;
    #pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      const int e = i * 32 + lane;
      p[i] = e < E ? expf(p[i] - top) : 0.0f;
      total += p[i];
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    #pragma unroll
    for (int i = 0; i < per_lane; ++i) p[i] = i * 32 + lane < E ? round_in(p[i] / total) : neg_inf;

    // The K largest, one warp-wide arg-max at a time; a chosen expert's entry becomes -inf.
    float score[K];
    int chosen[K];
    #pragma unroll
    for (int j = 0; j < K; ++j) {
      float best = neg_inf;
      int best_e = 0x7fffffff;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        const int e = i * 32 + lane;
        if (e < E && (p[i] > best || (p[i] == best && e < best_e))) { best = p[i]; best_e = e; }
      }
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, o);
        const int other_e = __shfl_xor_sync(0xffffffffu, best_e, o);
        if (other > best || (other == best && other_e < best_e)) { best = other; best_e = other_e; }
      }
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) if (i * 32 + lane == best_e) p[i] = neg_inf;
      score[j] = best;
      chosen[j] = best_e;
    }
    if (lane == 0) {
      float sum = 0.0f;
      #pragma unroll
      for (int j = 0; j < K; ++j) sum += score[j];
      const float norm = round_in(sum);
      #pragma unroll
      for (int j = 0; j < K; ++j) {
        ids[(size_t)n * slots + j] = static_cast<uint32_t>(chosen[j]);
        weights[(size_t)n * slots + j] = static_cast<InT>(Normalize ? score[j] / norm : score[j]);
      }
      if (Shared) {
        const float gate = static_cast<float>(row[E]);
        ids[(size_t)n * slots + K] = static_cast<uint32_t>(SharedId);
        weights[(size_t)n * slots + K] = static_cast<InT>(1.0f / (1.0f + expf(-gate)));
      }
    }
"#;

const COMBINE_SOURCE: &str = r#"
    constexpr int slots = K + (Shared ? 1 : 0);
    const int n = blockIdx.z;
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    auto round_in = [](float x) -> float { return static_cast<float>(static_cast<InT>(x)); };
    const InT* y_n = y + (size_t)n * slots * D;
    const InT* w_n = weights + (size_t)n * slots;
    float routed = 0.0f;
    #pragma unroll
    for (int j = 0; j < K; ++j) routed += round_in(static_cast<float>(y_n[j * D + d]) * static_cast<float>(w_n[j]));
    float out = round_in(routed);
    if (Shared) out = round_in(out + round_in(static_cast<float>(y_n[K * D + d]) * static_cast<float>(w_n[K])));
    moe_out[(size_t)n * D + d] = static_cast<InT>(static_cast<float>(residual[(size_t)n * D + d]) + out);
"#;

const ROUTE_KERNEL: KernelSource =
    KernelSource { name: "ferrite_moe_route", inputs: &["logits"], outputs: &["ids", "weights"], body: ROUTE_SOURCE };

const COMBINE_KERNEL: KernelSource = KernelSource {
    name: "ferrite_moe_combine",
    inputs: &["y", "weights", "residual"],
    outputs: &["moe_out"],
    body: COMBINE_SOURCE,
};

/// Threads per block of the combine (a block covers this many of a row's features).
const COMBINE_THREADS: i32 = 128;

thread_local! {
    /// Made once per thread; MLX compiles one module per set of template arguments.
    static ROUTE: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
    static COMBINE: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

/// How a layer routes: its top k, whether the scores are normalised to sum 1, and the id of
/// the shared expert stored as the experts' last one (whose gate logit ends the router's row).
#[derive(Debug, Clone, Copy)]
pub struct Routing {
    pub top_k: i32,
    pub normalize: bool,
    pub shared_id: Option<u32>,
}

/// Per token: the experts to run (the shared one last) and their weights, in the logits' dtype.
pub struct Routed {
    pub ids: Array,
    pub weights: Array,
}

fn slots(routing: &Routing) -> i32 {
    routing.top_k + i32::from(routing.shared_id.is_some())
}

/// `logits`: [.., experts (+ 1 gate)] → ids and weights [.., k (+ 1)] (lazy, like any op).
pub fn route(logits: &Array, routing: &Routing) -> Result<Routed, Exception> {
    let width = logits.dim(-1);
    let experts = width - i32::from(routing.shared_id.is_some());
    if routing.top_k < 1 || routing.top_k > experts.min(32) || experts > 1024 {
        return Err(Exception::custom(format!(
            "the CUDA router takes 1..=32 of at most 1024 experts, not {} of {experts}",
            routing.top_k
        )));
    }
    let batch = &logits.shape()[..logits.ndim() - 1];
    let rows: i32 = batch.iter().product();
    let out_shape = [batch, &[slots(routing)]].concat();
    let template = [
        ("InT", TemplateArg::Dtype(logits.dtype())),
        ("E", TemplateArg::Int(experts)),
        ("K", TemplateArg::Int(routing.top_k)),
        ("Shared", TemplateArg::Bool(routing.shared_id.is_some())),
        ("SharedId", TemplateArg::Int(routing.shared_id.unwrap_or(0) as i32)),
        ("Normalize", TemplateArg::Bool(routing.normalize)),
    ];
    let launch = Launch {
        outputs: &[(&out_shape, Dtype::Uint32), (&out_shape, logits.dtype())],
        grid: (32, 1, rows),
        block: (32, 1, 1),
        template: &template,
    };
    let out = ROUTE_KERNEL.apply(&ROUTE, &[logits], &launch)?;
    let [ids, weights] =
        <[Array; 2]>::try_from(out).map_err(|_| Exception::custom("the CUDA router returned other than two arrays"))?;
    Ok(Routed { ids, weights })
}

/// `residual + Σ y · weights` over the slots: `y` [.., slots, D], `weights` [.., slots],
/// `residual` [.., D], all of one dtype.
pub fn combine(y: &Array, weights: &Array, residual: &Array, routing: &Routing) -> Result<Array, Exception> {
    let d = residual.dim(-1);
    let slots = slots(routing);
    let rows = (residual.size() / d.max(1) as usize) as i32;
    let agree = y.dim(-1) == d
        && y.dim(-2) == slots
        && weights.dim(-1) == slots
        && y.size() == (rows * slots * d) as usize
        && weights.size() == (rows * slots) as usize
        && y.dtype() == residual.dtype()
        && weights.dtype() == residual.dtype();
    if !agree {
        return Err(Exception::custom(format!(
            "the CUDA MoE combine does not take y {:?} {:?}, weights {:?} {:?}, residual {:?} {:?}",
            y.shape(),
            y.dtype(),
            weights.shape(),
            weights.dtype(),
            residual.shape(),
            residual.dtype()
        )));
    }
    let template = [
        ("InT", TemplateArg::Dtype(residual.dtype())),
        ("D", TemplateArg::Int(d)),
        ("K", TemplateArg::Int(routing.top_k)),
        ("Shared", TemplateArg::Bool(routing.shared_id.is_some())),
    ];
    let blocks = (d + COMBINE_THREADS - 1) / COMBINE_THREADS;
    let launch = Launch {
        outputs: &[(residual.shape(), residual.dtype())],
        grid: (blocks * COMBINE_THREADS, 1, rows),
        block: (COMBINE_THREADS, 1, 1),
        template: &template,
    };
    let mut out = COMBINE_KERNEL.apply(&COMBINE, &[y, weights, residual], &launch)?;
    out.pop().ok_or_else(|| Exception::custom("the CUDA MoE combine returned nothing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(experts: i32) -> Array {
        mlx_rs::ops::zeros::<f32>(&[1, 2, experts]).unwrap()
    }

    #[test]
    fn the_router_refuses_what_its_warp_cannot_pick() {
        let routing = |top_k| Routing { top_k, normalize: true, shared_id: Some(64) };
        for (top_k, experts) in [(0, 65), (65, 65), (33, 129), (8, 2049)] {
            let err = route(&logits(experts), &routing(top_k)).err().expect("refused");
            assert!(err.what().contains("1..=32"), "{}", err.what());
        }
    }

    #[test]
    fn the_combine_refuses_disagreeing_shapes() {
        let routing = Routing { top_k: 2, normalize: false, shared_id: Some(8) };
        let zeros = |shape: &[i32]| mlx_rs::ops::zeros::<f32>(shape).unwrap();
        let residual = zeros(&[1, 2, 16]);
        // Two routed experts and the shared one: three slots, not two.
        let err = combine(&zeros(&[1, 2, 2, 16]), &zeros(&[1, 2, 2]), &residual, &routing).expect_err("refused");
        assert!(err.what().contains("does not take"), "{}", err.what());
        let err = combine(&zeros(&[1, 2, 3, 8]), &zeros(&[1, 2, 3]), &residual, &routing).expect_err("refused");
        assert!(err.what().contains("does not take"), "{}", err.what());
    }
}
