//! A DFlash block drafter for a project-made target, in the layout z-lab publishes drafters
//! (`DFlashDraftModel`: a Qwen3 config with `dflash_config`; `fc`, `hidden_norm`, `layers.*`,
//! `norm`; no embeddings or output head), with random weights: what the engine's block
//! drafting is tested on when no drafter can be downloaded.

use std::path::Path;

use serde_json::json;

use super::tensors::{layer_specs, Kind, TensorSpec};
use super::{dtype_name, write_json, write_tensors, Made, MakeOptions, Written};
use crate::config::ModelConfig;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct DrafterOptions {
    /// Dtype, quantization, seed and shard size of the tensors (its architecture and preset
    /// are not read: the drafter's shape follows the target's).
    pub tensors: MakeOptions,
    pub layers: i32,
    pub block_size: usize,
    /// The target's layers whose outputs feed the drafter.
    pub target_layers: Vec<usize>,
    pub causal: bool,
    /// Every layer a sliding-attention layer of this window (`None`: full attention).
    pub sliding_window: Option<i32>,
    /// The MLPs' width (`None`: twice the hidden size).
    pub intermediate_size: Option<i32>,
}

impl DrafterOptions {
    /// Blocks of 8 read from the target's second and last layers, as z-lab spreads them.
    pub fn new(target: &ModelConfig, tensors: MakeOptions) -> Self {
        let last = (target.num_hidden_layers.max(1) - 1) as usize;
        let mut target_layers = vec![1.min(last), last];
        target_layers.dedup();
        DrafterOptions {
            tensors,
            layers: 1,
            block_size: 8,
            target_layers,
            causal: false,
            sliding_window: None,
            intermediate_size: None,
        }
    }
}

/// The target layers a z-lab drafter of `draft_layers` layers reads from a target of
/// `target_layers`: its middle one for a single layer, else from the second layer to the
/// fourth from last, evenly spread.
pub fn spread_taps(target_layers: usize, draft_layers: usize) -> Vec<usize> {
    if draft_layers <= 1 || target_layers < 5 {
        return vec![target_layers / 2];
    }
    let (start, end) = (1.0, (target_layers - 3) as f64);
    let step = (end - start) / (draft_layers - 1) as f64;
    (0..draft_layers).map(|i| (start + i as f64 * step).round() as usize).collect()
}

/// Writes a drafter for the target whose config is `target` into `out`.
pub fn make_drafter(target: &ModelConfig, opts: &DrafterOptions, out: &Path) -> Result<Made> {
    if opts.layers < 1 {
        return Err(Error::Request(format!("a drafter needs at least one layer (asked for {})", opts.layers)));
    }
    let (h, hd) = (target.hidden_size, target.head_dim());
    let layer_type = if opts.sliding_window.is_some() { "sliding_attention" } else { "full_attention" };
    let mut config = json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,
        "num_hidden_layers": opts.layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": hd,
        "intermediate_size": opts.intermediate_size.unwrap_or(2 * h),
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta(),
        "vocab_size": target.vocab_size,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "is_causal": opts.causal,
        "block_size": opts.block_size,
        "num_target_layers": target.num_hidden_layers,
        "layer_types": vec![layer_type; opts.layers as usize],
        "dflash_config": {
            "mask_token_id": target.vocab_size - 1,
            "target_layer_ids": opts.target_layers,
        },
        "torch_dtype": dtype_name(opts.tensors.dtype),
    });
    if let Some(window) = opts.sliding_window {
        config["sliding_window"] = json!(window);
        config["use_sliding_window"] = json!(true);
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let parsed = ModelConfig::parse(&config.to_string(), &out.join("config.json"))?;
    let spec = |name: &str, shape: &[i32], kind: Kind| TensorSpec {
        name: name.into(),
        shape: shape.to_vec(),
        kind,
        raw: false,
    };
    let taps = opts.target_layers.len() as i32;
    let mut specs = vec![spec("fc", &[h, taps * h], Kind::Matrix), spec("hidden_norm", &[h], Kind::Norm)];
    for i in 0..opts.layers {
        layer_specs(&parsed, &mut specs, &format!("layers.{i}"), false, false, false);
    }
    specs.push(spec("norm", &[h], Kind::Norm));
    let Written { files, bytes, parameters, quant } = write_tensors(specs, &opts.tensors, out, h)?;
    if opts.tensors.bits.is_some() {
        config["quantization"] = serde_json::Value::Object(quant.clone());
        config["quantization_config"] = serde_json::Value::Object(quant);
    }
    write_json(&out.join("config.json"), &config)?;
    Ok(Made { dir: out.to_path_buf(), parameters, bytes, files })
}
