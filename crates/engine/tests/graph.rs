//! `engine::graph`: the operations one decode step dispatches, read from MLX's graph.

mod common;

use engine::checkpoint::{Architecture, Dtype};
use engine::weight_form::Override;
use engine::{Engine, EngineOptions};

/// One decode step's operations with the checkpoint's quantized weights kept as stored (the
/// CPU backend would otherwise dequantize them at load).
fn step_ops(arch: Architecture, bits: Option<i32>) -> engine::graph::StepOps {
    step_ops_as(arch, bits, Override::Quantized)
}

fn step_ops_as(arch: Architecture, bits: Option<i32>, weights: Override) -> engine::graph::StepOps {
    let dir = common::make(&common::options(arch, "tiny", bits, 32, Dtype::Float32));
    let engine = Engine::load_with(dir.path(), &EngineOptions { weights, ..Default::default() }).unwrap();
    engine::graph::decode_step_ops(&engine, 20, 1).unwrap()
}

#[test]
fn dequantized_weights_run_the_same_projections_as_plain_matmuls() {
    for arch in [Architecture::Qwen3, Architecture::Qwen3Next] {
        let quantized = step_ops(arch, Some(4));
        let dense = step_ops_as(arch, Some(4), Override::Dequantized(mlx_rs::Dtype::Float32));
        let count = |ops: &engine::graph::StepOps, kind: &str| ops.by_kind.get(kind).copied().unwrap_or(0);
        assert_eq!(count(&dense, "QuantizedMatmul") + count(&dense, "GatherQMM"), 0, "{:?}", dense.by_kind);
        assert_eq!(
            count(&dense, "Matmul"),
            count(&quantized, "Matmul") + count(&quantized, "QuantizedMatmul"),
            "{arch:?}"
        );
        assert_eq!(
            count(&dense, "GatherMM"),
            count(&quantized, "GatherMM") + count(&quantized, "GatherQMM"),
            "{arch:?}"
        );
    }
}

#[test]
fn a_dense_step_keeps_the_checkpoints_projections() {
    let ops = step_ops(Architecture::Qwen3, Some(4));
    let layers = 2;
    // Per layer: q, k, v, o, gate, up, down; then the (tied) output projection.
    assert_eq!(ops.by_kind.get("QuantizedMatmul"), Some(&(7 * layers + 1)), "{:?}", ops.by_kind);
    assert_eq!(ops.total, ops.by_kind.values().sum::<usize>());
    assert!(ops.build_ms > 0.0 && ops.step_ms >= ops.build_ms, "{ops:?}");
}

#[test]
fn a_hybrid_step_joins_its_projections_and_runs_the_shared_expert_with_the_routed_ones() {
    let ops = step_ops(Architecture::Qwen3Next, Some(4));
    // tiny hybrid: 3 Gated DeltaNet layers (all input projections joined, out) and 1
    // attention layer (q, k, v and gate joined, o), each with a MoE block (router and
    // shared-expert gate joined), plus the output projection.
    let expected = 3 * 2 + 2 + 4 + 1;
    assert_eq!(ops.by_kind.get("QuantizedMatmul"), Some(&expected), "{:?}", ops.by_kind);
    // The experts, the shared one among them: gate/up joined and down, one gathered matmul
    // each; no arange for their row indices.
    assert_eq!(ops.by_kind.get("GatherQMM"), Some(&(4 * 2)), "{:?}", ops.by_kind);
}

#[test]
fn prefill_times_name_each_kind_of_layer_part() {
    let dir = common::make(&common::options(Architecture::Qwen3Next, "tiny", Some(4), 32, Dtype::Float32));
    let engine = Engine::load(dir.path()).unwrap();
    let t = engine::graph::prefill_times(&engine, 80).unwrap();
    assert_eq!(t.tokens, 80);
    let parts: Vec<&str> = t.by_part.keys().map(String::as_str).collect();
    assert_eq!(parts, ["attention", "gated delta", "moe"]);
    let sum: f64 = t.by_part.values().sum();
    assert!(t.by_part.values().all(|&ms| ms > 0.0) && sum <= t.total_ms, "{t:?}");
    // Each part's peak holds the model (in use before the prompt) and that part's work.
    assert_eq!(t.peak_mb_by_part.keys().collect::<Vec<_>>(), t.by_part.keys().collect::<Vec<_>>());
    assert!(t.before_mb > 0.0 && t.peak_mb_by_part.values().all(|&mb| mb > t.before_mb), "{t:?}");
    // The prompt paths split further, in the order they run, within their part's time.
    let laps: Vec<&str> = t.laps.iter().map(|(lap, _)| lap.as_str()).collect();
    assert_eq!(
        laps,
        [
            "gated delta: input projections",
            "gated delta: conv, q/k norms, gates",
            "gated delta: delta rule",
            "gated delta: gated norm, output projection",
            "moe: router",
            "moe: experts",
            "moe: shared expert",
            "moe: combine",
        ]
    );
    for part in ["gated delta", "moe"] {
        let within: f64 = t.laps.iter().filter(|(lap, _)| lap.starts_with(part)).map(|(_, ms)| ms).sum();
        assert!(within <= t.by_part[part], "{part}: laps {within} ms of {} ms", t.by_part[part]);
    }
}
