//! A long prompt's dequantized experts live one or two layers at a time (`FERRITE_LONG_EXPERTS`,
//! given to the engine's options as the CLI reads it, forces the form).

mod common;

use engine::checkpoint::{Architecture, Dtype};
use engine::{Engine, EngineOptions, GenerateRequest};

/// The options with `FERRITE_LONG_EXPERTS` set to `experts`, as the CLI reads the variable.
fn long_experts(experts: &str) -> engine::Result<EngineOptions> {
    EngineOptions::default().with_overrides(|name| (name == "FERRITE_LONG_EXPERTS").then(|| experts.to_string()))
}

/// Highest MLX memory above the loaded model's while a `tokens`-long prompt is read.
fn prompt_peak_above_model(dir: &std::path::Path, experts: &str, tokens: u32) -> (f64, String) {
    let engine = Engine::load_with(dir, &long_experts(experts).unwrap()).unwrap();
    mlx_rs::memory::clear_cache().unwrap();
    let model = mlx_rs::memory::active_memory().unwrap() as f64;
    let prompt: Vec<u32> = (0..tokens).map(|i| (i * 37 + 11) % 2000).collect();
    let (text, summary) =
        engine.generate_text(GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt, 2) }).unwrap();
    (summary.timings.peak_memory_bytes as f64 - model, text)
}

#[test]
fn dequantized_experts_exist_for_at_most_two_layers_at_once_and_unknown_forms_are_named() {
    // qwen3_moe "small" 16 layers deep: MoE layers of 16 experts (256 wide, 128 inner),
    // float32 (the CPU's gathered matmuls are float32-only).
    let mut options = common::options(Architecture::Qwen3Moe, "small", Some(4), 32, Dtype::Float32);
    options.layers = Some(16);
    let dir = common::make(&options);
    let one_layer = 16.0 * (2.0 * 128.0 * 256.0 + 256.0 * 128.0) * 4.0;
    let (quantized, text_q) = prompt_peak_above_model(dir.path(), "quantized", 128);
    let (dequantized, text_d) = prompt_peak_above_model(dir.path(), "dequantized", 128);
    assert_eq!(text_q, text_d, "the same tokens either way");
    let extra_layers = (dequantized - quantized) / one_layer;
    eprintln!(
        "peak above the model: quantized {:.1} MB, dequantized {:.1} MB ({extra_layers:.2} layers' experts more)",
        quantized / 1e6,
        dequantized / 1e6
    );
    assert!(extra_layers <= 2.5, "{extra_layers:.2} layers' dequantized experts at once");

    let err = long_experts("fastest").err().expect("an unknown form is refused").to_string();
    assert!(err.contains("FERRITE_LONG_EXPERTS") && err.contains("`fastest`"), "{err}");
}
