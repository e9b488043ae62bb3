//! DFlash block drafting (z-lab, "Block Diffusion for Flash Speculative Decoding"): a small
//! drafter writes a whole block of tokens in one forward pass, conditioned on hidden states
//! tapped from the target's layers; the target verifies the block in one pass.
//!
//! The format, as z-lab publishes drafters (`DFlashDraftModel`): a Qwen3 config whose
//! `dflash_config` (or its top level) gives `block_size`, `mask_token_id` and
//! `target_layer_ids`; tensors `fc` (taps × H → H), `hidden_norm`, Qwen3 decoder `layers.*`
//! and `norm`. It has no embeddings and no output head: it shares the target's.
//!
//! The context: the target's hidden states after layers `target_layer_ids`, concatenated,
//! through `fc` and `hidden_norm`, at every position the target has processed. Every layer
//! projects those same features to keys and values, which the drafter's cache keeps, one
//! position per target position, roped at it. The block: the last committed token (the
//! anchor, which the target has not processed yet) and `block_size - 1` mask tokens, embedded
//! by the target; each block position attends to the whole context and the whole block (the
//! drafter is not causal unless its config says `is_causal`); the output at mask position i,
//! through the target's head, drafts the token at i.

use std::path::{Path, PathBuf};

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array, Dtype};
use serde_json::Value;

use super::mtp::Trunk;
use super::qwen3::mlp;
use super::transformer::attention;
use crate::cache::{Cache, LayerCache};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::layers::sdpa::{self, Mask};
use crate::layers::{Attention, Joins, Linear, Loader, Mlp, RmsNorm};
use crate::weights::Weights;

/// The most tokens a block may hold (z-lab's drafters use 8 to 16).
pub const MAX_BLOCK: usize = 64;

/// What a drafter's config says beyond its Qwen3 shape.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterSpec {
    /// Tokens in a block: the anchor and `block_size - 1` drafts.
    pub block_size: usize,
    /// The token id the block's undrafted positions hold.
    pub mask_token: u32,
    /// The target's decoder layers whose outputs feed the drafter (0-based).
    pub target_layers: Vec<usize>,
    /// Whether block positions attend causally among themselves.
    pub causal: bool,
    /// Per layer: the sliding window of a `sliding_attention` layer.
    pub windows: Vec<Option<i32>>,
}

impl DrafterSpec {
    /// Reads the DFlash fields of `config.json` and checks them against `target`.
    pub fn parse(value: &Value, path: &Path, target: &ModelConfig) -> Result<Self> {
        let bad = |field: &str, message: String| Error::config(path, field.to_string(), message);
        let architectures: Vec<&str> =
            value["architectures"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        if architectures.iter().any(|a| a.starts_with("DFlash2")) {
            return Err(bad(
                "architectures",
                "DFlash2 drafters (attention and MLP convolutions, a candidate selector) are not supported; \
                 DFlashDraftModel is"
                    .into(),
            ));
        }
        if !architectures.contains(&"DFlashDraftModel") {
            return Err(bad("architectures", format!("{architectures:?} is not a DFlash drafter (DFlashDraftModel)")));
        }
        let field = |name: &str| value.get("dflash_config").and_then(|d| d.get(name)).or_else(|| value.get(name));
        let count = |name: &str| -> Result<u64> {
            field(name).and_then(Value::as_u64).ok_or_else(|| bad(name, "missing or not a whole number".into()))
        };
        let block_size = count("block_size")? as usize;
        if !(2..=MAX_BLOCK).contains(&block_size) {
            return Err(bad("block_size", format!("{block_size} is outside 2..={MAX_BLOCK}")));
        }
        let mask_token = count("mask_token_id")?;
        if mask_token >= target.vocab_size as u64 {
            return Err(bad(
                "mask_token_id",
                format!("{mask_token} is outside the target's vocabulary ({})", target.vocab_size),
            ));
        }
        let layers = target.num_hidden_layers as u64;
        let target_layers = field("target_layer_ids")
            .and_then(Value::as_array)
            .filter(|ids| !ids.is_empty())
            .ok_or_else(|| bad("target_layer_ids", "missing or empty".into()))?
            .iter()
            .map(|id| match id.as_u64() {
                Some(id) if id < layers => Ok(id as usize),
                _ => Err(bad("target_layer_ids", format!("{id} is not a layer of the target (it has {layers})"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let n_layers = value["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
        let window = value["sliding_window"].as_i64().filter(|&w| w > 0).map(|w| w as i32);
        let windows = match value.get("layer_types").and_then(Value::as_array) {
            None => vec![None; n_layers],
            Some(types) => types
                .iter()
                .map(|t| match (t.as_str(), window) {
                    (Some("full_attention"), _) => Ok(None),
                    (Some("sliding_attention"), Some(w)) => Ok(Some(w)),
                    (Some("sliding_attention"), None) => Err(bad("sliding_window", "a sliding layer needs one".into())),
                    _ => Err(bad("layer_types", format!("{t} is not full_attention or sliding_attention"))),
                })
                .collect::<Result<_>>()?,
        };
        if windows.len() != n_layers {
            return Err(bad("layer_types", format!("{} entries for {n_layers} layers", windows.len())));
        }
        Ok(DrafterSpec {
            block_size,
            mask_token: mask_token as u32,
            target_layers,
            causal: value["is_causal"] == true,
            windows,
        })
    }
}

struct DraftLayer {
    input_layernorm: RmsNorm,
    attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    window: Option<i32>,
}

pub struct BlockDrafter {
    pub dir: PathBuf,
    pub spec: DrafterSpec,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DraftLayer>,
    norm: RmsNorm,
    /// Keys and values one more context position adds to its cache (elements).
    kv_per_token: u64,
}

impl BlockDrafter {
    /// Loads the drafter in `dir` for `target` (whose hidden size it must have), its quantized
    /// matrices dequantized to `dequantize` when the target's are, its float tensors in
    /// `compute`, the dtype the target computes in.
    pub fn load(dir: &Path, target: &ModelConfig, dequantize: Option<Dtype>, compute: Dtype) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::small_file::read_text(&path, crate::small_file::JSON_CAP)?;
        let value: Value =
            serde_json::from_str(&text).map_err(|e| Error::malformed(&path, format!("not valid JSON: {e}")))?;
        let spec = DrafterSpec::parse(&value, &path, target)?;
        let c = ModelConfig::parse(&text, &path)?;
        if c.hidden_size != target.hidden_size {
            return Err(Error::config(
                &path,
                "hidden_size",
                format!(
                    "{} is not the target's ({}): the drafter reads its embeddings",
                    c.hidden_size, target.hidden_size
                ),
            ));
        }
        let mut weights = Weights::load(dir)?;
        in_dtype(&mut weights, compute)?;
        let mut ld = Loader {
            weights: &mut weights,
            quant: c.quant.as_ref(),
            config_path: path.clone(),
            joins: Joins::for_model(false),
            long_prompt_gather: Default::default(),
            dequantize,
            shard: None,
        };
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let taps = spec.target_layers.len() as i32;
        let fc = ld.linear("fc", taps * h, h, false)?;
        let hidden_norm = ld.rms_norm("hidden_norm", h, eps)?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                Ok(DraftLayer {
                    input_layernorm: ld.rms_norm(&format!("{p}.input_layernorm"), h, eps)?,
                    attn: attention(&c, &mut ld, &p, false)?,
                    post_attention_layernorm: ld.rms_norm(&format!("{p}.post_attention_layernorm"), h, eps)?,
                    mlp: mlp(&mut ld, &format!("{p}.mlp"), h, c.intermediate_size)?,
                    window: spec.windows.get(i as usize).copied().flatten(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = ld.rms_norm("norm", h, eps)?;
        weights.finish()?;
        let kv_per_token =
            2 * c.num_hidden_layers.max(0) as u64 * c.num_key_value_heads.max(0) as u64 * c.head_dim().max(0) as u64;
        Ok(BlockDrafter { dir: dir.to_path_buf(), spec, fc, hidden_norm, layers, norm, kv_per_token })
    }

    /// An empty context.
    pub fn new_cache(&self) -> Cache {
        Cache::kv(self.layers.len())
    }

    /// Drafts a block's tokens at most.
    pub fn max_drafts(&self) -> usize {
        self.spec.block_size - 1
    }

    /// Bytes one more context position takes in its cache, in the dtype `model` computes in.
    pub fn kv_bytes_per_token(&self, model: &dyn Trunk) -> Result<u64> {
        let item_bytes = model.embed(&Array::from_slice(&[0u32], &[1, 1]))?.item_size() as u64;
        Ok(self.kv_per_token * item_bytes)
    }

    /// Adds the target's taps [1, L, taps × H] at the next L positions to the context.
    pub fn extend(&self, taps: &Array, cache: &mut Cache) -> Result<()> {
        let context = self.context(taps)?;
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let kv = kv_of(state)?;
            let (_, k, v, _) = layer.attn.project(&context)?;
            let k = layer.attn.rope.forward(&k, kv.offset)?;
            kv.update_and_fetch(&k, &v)?;
        }
        Ok(())
    }

    /// The block anchored at `anchor`: first the target's `taps` at positions not yet in the
    /// context join it, then the block runs after them. Returns the logits [1, drafts, vocab]
    /// of its first `drafts` mask positions (lazy; the whole block runs, only those go through
    /// the output head); the cache then also holds the block's positions, which the caller
    /// rolls back (`cache.rollback(block_size)`).
    pub fn draft(
        &self,
        model: &dyn Trunk,
        taps: Option<&Array>,
        anchor: u32,
        drafts: usize,
        cache: &mut Cache,
    ) -> Result<Array> {
        let b = self.spec.block_size as i32;
        let context = taps.map(|t| self.context(t)).transpose()?;
        let mut ids = vec![self.spec.mask_token; self.spec.block_size];
        ids[0] = anchor;
        let mut x = model.embed(&Array::from_slice(&ids, &[1, b]))?;
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let kv = kv_of(state)?;
            let h = layer.input_layernorm.forward(&x)?;
            let input = match &context {
                Some(c) => ops::concatenate(&[c.clone(), h], 1)?,
                None => h,
            };
            let (q, k, v, _) = layer.attn.project(&input)?;
            let first = kv.offset;
            let q = layer.attn.rope.forward(&q.index((.., .., -b.., ..)), first + input.dim(1) - b)?;
            let k = layer.attn.rope.forward(&k, first)?;
            let (k, v) = kv.update_and_fetch(&k, &v)?;
            let keep = block_mask(kv.offset, b, self.spec.causal, layer.window)?;
            let mask = match (&keep, self.spec.causal) {
                (Some(keep), _) => Mask::Keep(keep),
                (None, true) => Mask::Causal,
                (None, false) => Mask::None,
            };
            let o = sdpa::attention(&q, &k, &v, layer.attn.scale(), mask)?;
            x = x.add(layer.attn.output(&o, None)?)?;
            x = x.add(layer.mlp.forward(&layer.post_attention_layernorm.forward(&x)?)?)?;
        }
        let drafts = drafts.clamp(1, self.max_drafts()) as i32;
        model.logits(&self.norm.forward(&x.index((.., 1..1 + drafts, ..)))?)
    }

    fn context(&self, taps: &Array) -> Result<Array> {
        self.hidden_norm.forward(&self.fc.forward(taps)?)
    }
}

/// Every float tensor in `dtype`. The drafter's inputs are the target's embeddings and hidden
/// states: a matrix stored in another float dtype (z-lab's drafters are bfloat16, the embedded
/// model computes in float32) would be converted on every pass, a copy and a launch per matrix.
fn in_dtype(weights: &mut Weights, dtype: Dtype) -> Result<()> {
    for name in weights.names() {
        weights.update(&name, |a| {
            let float = matches!(a.dtype(), Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32);
            if !float || a.dtype() == dtype {
                return Ok(a.clone());
            }
            let converted = a.as_dtype(dtype)?;
            converted.eval()?;
            Ok(converted)
        })?;
    }
    Ok(())
}

fn kv_of(state: &mut LayerCache) -> Result<&mut crate::cache::KvCache> {
    match state {
        LayerCache::Kv(kv) => Ok(kv),
        LayerCache::Linear(_) => Err(Error::Request("a block drafter's cache holds keys and values only".into())),
    }
}

/// Which keys each block query may see when a sliding window hides some ([queries, keys]:
/// key j is within the window of query i when i - j < window, and not after it when
/// causal); `None` when the window hides nothing.
fn block_mask(keys: i32, block: i32, causal: bool, window: Option<i32>) -> Result<Option<Array>> {
    let Some(window) = window.filter(|&w| keys > w) else { return Ok(None) };
    let first = keys - block;
    let key_pos = Array::from_iter(0..keys, &[1, keys]);
    let query_pos = Array::from_iter(first..keys, &[block, 1]);
    let mut keep = key_pos.gt(query_pos.subtract(Array::from_int(window))?)?;
    if causal {
        keep = keep.logical_and(key_pos.le(&query_pos)?)?;
    }
    Ok(Some(keep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_tensors_take_the_targets_dtype_and_packed_ones_stay() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/ferrite-code-20m-dflash");
        let mut weights = Weights::load(&dir).unwrap();
        assert!(
            weights.arrays().all(|(_, a)| a.dtype() == Dtype::Bfloat16),
            "the shipped drafter is stored in bfloat16"
        );
        weights.insert("packed".into(), Array::from_slice(&[1u32, 2, 3], &[3]));
        let before = weights.array("fc.weight").unwrap().as_dtype(Dtype::Float32).unwrap();

        in_dtype(&mut weights, Dtype::Float32).unwrap();
        for (name, a) in weights.arrays() {
            let want = if name == "packed" { Dtype::Uint32 } else { Dtype::Float32 };
            assert_eq!(a.dtype(), want, "{name}");
        }
        let after = weights.array("fc.weight").unwrap();
        assert!(before.eq_values(after).unwrap(), "converting from bfloat16 is exact");

        in_dtype(&mut weights, Dtype::Bfloat16).unwrap();
        assert_eq!(weights.array("fc.weight").unwrap().dtype(), Dtype::Bfloat16);
        assert_eq!(weights.array("packed").unwrap().as_slice::<u32>(), &[1, 2, 3]);
    }
}
