//! Model shapes for project-made checkpoints: `tiny` for tests (milliseconds per token on a
//! laptop CPU) up to the shapes of real Qwen3 models for benchmarks.

use serde_json::{json, Value};

use crate::error::{Error, Result};

pub use crate::architecture::Architecture;

/// Preset names for each architecture, smallest first.
pub fn names(arch: Architecture) -> &'static [&'static str] {
    match arch {
        Architecture::Qwen3 => &["tiny", "small", "0.6b", "8b", "32b"],
        Architecture::Qwen3Moe => &["tiny", "small", "30b-a3b"],
        Architecture::Qwen3Next => &["tiny", "small", "35b-a3b", "80b-a3b"],
        Architecture::Qwen35 | Architecture::Qwen35Moe => &["tiny", "small"],
    }
}

/// A hybrid (Gated DeltaNet + gated attention) config from a dense base: `nk`/`nv` linear
/// key/value heads of `dk`/`dv` dims; MoE (8 experts, top 2, with a shared expert) for
/// qwen3_next and qwen3_5_moe; Qwen3.5 nests the text model under `text_config`.
fn hybrid(arch: Architecture, base: Value, nk: i32, nv: i32, dk: i32, dv: i32) -> Value {
    let mut c = base;
    let h = c["hidden_size"].as_i64().unwrap_or(64);
    c["linear_num_key_heads"] = json!(nk);
    c["linear_num_value_heads"] = json!(nv);
    c["linear_key_head_dim"] = json!(dk);
    c["linear_value_head_dim"] = json!(dv);
    c["linear_conv_kernel_dim"] = json!(4);
    c["full_attention_interval"] = json!(4);
    c["partial_rotary_factor"] = json!(0.25);
    if arch != Architecture::Qwen35 {
        c["num_experts"] = json!(8);
        c["num_experts_per_tok"] = json!(2);
        c["moe_intermediate_size"] = json!(h / 2);
        c["shared_expert_intermediate_size"] = json!(h / 2);
        c["decoder_sparse_step"] = json!(1);
        c["mlp_only_layers"] = json!([]);
        c["norm_topk_prob"] = json!(true);
    }
    match arch {
        Architecture::Qwen3Next => {
            c["model_type"] = json!(Architecture::Qwen3Next.model_type());
            c["architectures"] = json!(["Qwen3NextForCausalLM"]);
            c
        }
        _ => {
            let layers = c["num_hidden_layers"].as_i64().unwrap_or(4);
            c["layer_types"] = layer_pattern(layers);
            let theta = c["rope_theta"].clone();
            let tie = c["tie_word_embeddings"].clone();
            if let Some(obj) = c.as_object_mut() {
                for moved in ["rope_theta", "partial_rotary_factor", "tie_word_embeddings"] {
                    obj.remove(moved);
                }
            }
            let top = arch.model_type();
            c["model_type"] = json!(format!("{top}_text"));
            c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]});
            json!({
                "model_type": top,
                "architectures": [if arch == Architecture::Qwen35 { "Qwen3_5ForConditionalGeneration" } else { "Qwen3_5MoeForConditionalGeneration" }],
                "tie_word_embeddings": if tie.is_null() { json!(false) } else { tie },
                "text_config": c,
            })
        }
    }
}

/// Real Qwen3-Next expert counts on a hybrid config (the `hybrid` defaults are tiny ones).
fn next_shape(mut c: Value, experts: i32, top_k: i32) -> Value {
    c["num_experts"] = json!(experts);
    c["num_experts_per_tok"] = json!(top_k);
    c["moe_intermediate_size"] = json!(512);
    c["shared_expert_intermediate_size"] = json!(512);
    c["rope_theta"] = json!(10_000_000.0);
    c
}

/// The `config.json` fields of a preset (without quantization and eos ids).
pub fn config(arch: Architecture, preset: &str) -> Result<Value> {
    // (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied)
    let dense = |h: i32, l: i32, q: i32, kv: i32, hd: i32, i: i32, v: i32, tie: bool| {
        json!({
            "model_type": Architecture::Qwen3.model_type(), "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": h, "num_hidden_layers": l, "num_attention_heads": q,
            "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": i,
            "vocab_size": v, "tie_word_embeddings": tie, "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0, "max_position_embeddings": 40960,
            "attention_bias": false, "hidden_act": "silu",
        })
    };
    let moe = |base: Value, experts: i32, top_k: i32, moe_i: i32| {
        let mut c = base;
        c["model_type"] = json!(Architecture::Qwen3Moe.model_type());
        c["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        c["num_experts"] = json!(experts);
        c["num_experts_per_tok"] = json!(top_k);
        c["moe_intermediate_size"] = json!(moe_i);
        c["decoder_sparse_step"] = json!(1);
        c["mlp_only_layers"] = json!([]);
        c["norm_topk_prob"] = json!(true);
        c
    };
    let config = match (arch, preset) {
        (Architecture::Qwen3, "tiny") => dense(64, 2, 4, 2, 16, 128, 512, true),
        (Architecture::Qwen3, "small") => dense(256, 4, 8, 4, 32, 768, 2048, false),
        (Architecture::Qwen3, "0.6b") => dense(1024, 28, 16, 8, 128, 3072, 151936, true),
        (Architecture::Qwen3, "8b") => dense(4096, 36, 32, 8, 128, 12288, 151936, false),
        (Architecture::Qwen3, "32b") => dense(5120, 64, 64, 8, 128, 25600, 151936, false),
        (Architecture::Qwen3Moe, "tiny") => {
            // One dense layer (mlp_only_layers) so both feed-forward kinds are exercised.
            let mut c = moe(dense(64, 3, 4, 2, 16, 128, 512, false), 8, 2, 32);
            c["mlp_only_layers"] = json!([1]);
            c
        }
        (Architecture::Qwen3Moe, "small") => moe(dense(256, 4, 8, 4, 32, 768, 2048, false), 16, 4, 128),
        (Architecture::Qwen3Moe, "30b-a3b") => moe(dense(2048, 48, 32, 4, 128, 6144, 151936, false), 128, 8, 768),
        (Architecture::Qwen3Next | Architecture::Qwen35 | Architecture::Qwen35Moe, "tiny") => {
            hybrid(arch, dense(64, 4, 4, 2, 16, 128, 512, false), 2, 4, 16, 16)
        }
        (Architecture::Qwen3Next | Architecture::Qwen35 | Architecture::Qwen35Moe, "small") => {
            hybrid(arch, dense(256, 8, 8, 2, 32, 768, 2048, false), 4, 8, 32, 32)
        }
        // Qwen3-Next-80B-A3B's shapes (512 experts, top 10) and a 40-layer, 256-expert variant
        // (the hybrid 35B-A3B shape of shared/gpu-runtime's reference figures).
        (Architecture::Qwen3Next, "80b-a3b") => {
            next_shape(hybrid(arch, dense(2048, 48, 16, 2, 256, 5120, 151936, false), 16, 32, 128, 128), 512, 10)
        }
        (Architecture::Qwen3Next, "35b-a3b") => {
            next_shape(hybrid(arch, dense(2048, 40, 16, 2, 256, 5120, 151936, false), 16, 32, 128, 128), 256, 8)
        }
        _ => {
            return Err(Error::Request(format!(
                "unknown preset `{preset}` for {arch:?} (known: {})",
                names(arch).join(", ")
            )))
        }
    };
    Ok(config)
}

/// A hybrid's layer kinds, every fourth a full attention layer (as `full_attention_interval`).
fn layer_pattern(layers: i64) -> Value {
    json!((0..layers).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect::<Vec<_>>())
}

/// Sets a config's number of decoder layers where its architecture keeps it (Qwen3.5's in
/// `text_config`), with its layer pattern when it lists one.
pub fn set_layers(config: &mut Value, arch: Architecture, layers: i64) {
    let text = match arch {
        Architecture::Qwen35 | Architecture::Qwen35Moe => &mut config["text_config"],
        _ => config,
    };
    text["num_hidden_layers"] = json!(layers);
    if text.get("layer_types").is_some() {
        text["layer_types"] = layer_pattern(layers);
    }
}

/// Declares a one-layer MTP head in a hybrid config, under the key its architecture uses.
pub fn add_mtp_head(config: &mut Value, arch: Architecture) -> Result<()> {
    match arch {
        Architecture::Qwen3Next => config["num_nextn_predict_layers"] = json!(1),
        Architecture::Qwen35 | Architecture::Qwen35Moe => config["text_config"]["mtp_num_hidden_layers"] = json!(1),
        _ => return Err(Error::Request(format!("{arch:?} has no MTP head (hybrid models only)"))),
    }
    Ok(())
}
