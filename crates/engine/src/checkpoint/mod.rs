//! Project-made checkpoints: random weights in exactly the layout mlx-lm writes (config.json,
//! safetensors shards with an index, affine-quantized matrices, tokenizer files), so tests
//! and benchmarks run the real loading code without reaching the hub. Deterministic for a
//! seed: each tensor draws from its own key, derived from the seed and its name.

pub mod presets;
pub mod tokenizer_trainer;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::{ops, random, Array};
pub use mlx_rs::Dtype;
use serde_json::json;

pub use presets::Arch;

use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct MakeOptions {
    pub arch: Arch,
    pub preset: String,
    /// Affine quantization bits for matrices; `None` keeps them in `dtype`.
    pub bits: Option<i32>,
    pub group_size: i32,
    pub dtype: Dtype,
    /// Overrides the preset's `tie_word_embeddings`.
    pub tie_embeddings: Option<bool>,
    pub seed: u64,
    /// A new shard starts once one holds this many bytes.
    pub shard_bytes: usize,
}

impl MakeOptions {
    pub fn new(arch: Arch, preset: &str) -> Self {
        MakeOptions {
            arch,
            preset: preset.to_string(),
            bits: None,
            group_size: 64,
            dtype: Dtype::Bfloat16,
            tie_embeddings: None,
            seed: 0,
            shard_bytes: 4 << 30,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Made {
    pub dir: PathBuf,
    pub parameters: u64,
    pub bytes: u64,
    pub files: Vec<PathBuf>,
}

/// What a tensor is, which decides its initialisation and whether it is quantized.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// A projection [.., out, in]: N(0, 1/in).
    Matrix,
    /// Embedding table or output head: wide enough logits that greedy picks are clear.
    Table,
    /// The MoE router: quantized at 8 bits, as mlx-lm's qwen3_moe predicate does.
    Router,
    /// RMSNorm weight around 1.
    Norm,
}

struct TensorSpec {
    name: String,
    shape: Vec<i32>,
    kind: Kind,
}

fn tensor_specs(c: &serde_json::Value) -> Vec<TensorSpec> {
    let g = |k: &str| c[k].as_i64().unwrap_or(0) as i32;
    let (h, v, hd) = (g("hidden_size"), g("vocab_size"), g("head_dim"));
    let (nq, nkv, inter) = (g("num_attention_heads"), g("num_key_value_heads"), g("intermediate_size"));
    let mut t = Vec::new();
    let mut add = |name: String, shape: &[i32], kind: Kind| t.push(TensorSpec { name, shape: shape.to_vec(), kind });
    add("model.embed_tokens".into(), &[v, h], Kind::Table);
    let dense_only: Vec<i64> = c["mlp_only_layers"].as_array().map(|a| a.iter().filter_map(|x| x.as_i64()).collect()).unwrap_or_default();
    for i in 0..g("num_hidden_layers") {
        let p = format!("model.layers.{i}");
        add(format!("{p}.input_layernorm"), &[h], Kind::Norm);
        add(format!("{p}.post_attention_layernorm"), &[h], Kind::Norm);
        add(format!("{p}.self_attn.q_proj"), &[nq * hd, h], Kind::Matrix);
        add(format!("{p}.self_attn.k_proj"), &[nkv * hd, h], Kind::Matrix);
        add(format!("{p}.self_attn.v_proj"), &[nkv * hd, h], Kind::Matrix);
        add(format!("{p}.self_attn.o_proj"), &[h, nq * hd], Kind::Matrix);
        add(format!("{p}.self_attn.q_norm"), &[hd], Kind::Norm);
        add(format!("{p}.self_attn.k_norm"), &[hd], Kind::Norm);
        let (experts, step) = (g("num_experts"), g("decoder_sparse_step").max(1));
        if experts > 0 && !dense_only.contains(&(i as i64)) && (i + 1) % step == 0 {
            let mi = g("moe_intermediate_size");
            add(format!("{p}.mlp.gate"), &[experts, h], Kind::Router);
            add(format!("{p}.mlp.switch_mlp.gate_proj"), &[experts, mi, h], Kind::Matrix);
            add(format!("{p}.mlp.switch_mlp.up_proj"), &[experts, mi, h], Kind::Matrix);
            add(format!("{p}.mlp.switch_mlp.down_proj"), &[experts, h, mi], Kind::Matrix);
        } else {
            add(format!("{p}.mlp.gate_proj"), &[inter, h], Kind::Matrix);
            add(format!("{p}.mlp.up_proj"), &[inter, h], Kind::Matrix);
            add(format!("{p}.mlp.down_proj"), &[h, inter], Kind::Matrix);
        }
    }
    add("model.norm".into(), &[h], Kind::Norm);
    if !c["tie_word_embeddings"].as_bool().unwrap_or(false) {
        add("lm_head".into(), &[v, h], Kind::Table);
    }
    t
}

/// FNV-1a: a stable per-name key, independent of the order tensors are made in.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

fn random_tensor(spec: &TensorSpec, seed: u64, hidden: i32) -> Result<Array> {
    let key = random::key(seed ^ name_hash(&spec.name))?;
    let fan_in = *spec.shape.last().unwrap_or(&1) as f32;
    let x = match spec.kind {
        Kind::Matrix | Kind::Router => random::normal::<f32>(&spec.shape[..], 0.0, 1.0 / fan_in.sqrt(), &key)?,
        Kind::Table => random::normal::<f32>(&spec.shape[..], 0.0, 2.0 / (hidden as f32).sqrt(), &key)?,
        Kind::Norm => random::normal::<f32>(&spec.shape[..], 1.0, 0.1, &key)?,
    };
    Ok(x)
}

/// Writes a random checkpoint to `out` (created if needed).
pub fn make(opts: &MakeOptions, out: &Path) -> Result<Made> {
    let mut config = presets::config(opts.arch, &opts.preset)?;
    if let Some(tie) = opts.tie_embeddings {
        config["tie_word_embeddings"] = json!(tie);
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let hidden = config["hidden_size"].as_i64().unwrap_or(0) as i32;

    let mut quant = serde_json::Map::new();
    if let Some(bits) = opts.bits {
        quant.insert("group_size".into(), json!(opts.group_size));
        quant.insert("bits".into(), json!(bits));
        quant.insert("mode".into(), json!("affine"));
    }

    let mut shards = ShardWriter::new(out, opts.shard_bytes);
    let mut parameters = 0u64;
    for spec in tensor_specs(&config) {
        parameters += spec.shape.iter().map(|&d| d as u64).product::<u64>();
        let w = random_tensor(&spec, opts.seed, hidden)?.as_dtype(opts.dtype)?;
        let fan_in = *spec.shape.last().unwrap_or(&0);
        let bits = match (spec.kind, opts.bits) {
            (Kind::Norm, _) | (_, None) => None,
            (Kind::Router, Some(_)) => Some(8),
            (_, Some(bits)) => Some(bits),
        };
        match bits {
            Some(bits) if fan_in % opts.group_size == 0 => {
                if bits != opts.bits.unwrap_or(bits) {
                    quant.insert(spec.name.clone(), json!({"group_size": opts.group_size, "bits": bits}));
                }
                let (wq, scales, biases) = ops::quantize(&w, opts.group_size, bits)?;
                shards.add(format!("{}.weight", spec.name), wq)?;
                shards.add(format!("{}.scales", spec.name), scales)?;
                shards.add(format!("{}.biases", spec.name), biases)?;
            }
            _ => shards.add(format!("{}.weight", spec.name), w)?,
        }
    }
    let (files, bytes) = shards.finish()?;

    // Token ids: the trained vocabulary, then the special tokens.
    let vocab_size = config["vocab_size"].as_i64().unwrap_or(0) as usize;
    let tok_path = out.join("tokenizer.json");
    let tok_len = tokenizer_trainer::write_tokenizer(&tok_path, vocab_size.min(4096))?;
    let special_id = |i: usize| (tok_len - tokenizer_trainer::SPECIAL_TOKENS.len() + i) as u32;
    let (endoftext, im_end) = (special_id(0), special_id(2));

    config["eos_token_id"] = json!(im_end);
    config["torch_dtype"] = json!(dtype_name(opts.dtype));
    if opts.bits.is_some() {
        config["quantization"] = serde_json::Value::Object(quant.clone());
        config["quantization_config"] = serde_json::Value::Object(quant);
    }
    write_json(&out.join("config.json"), &config)?;
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": false,
            "bos_token": null,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 40960,
            "chat_template": tokenizer_trainer::CHAT_TEMPLATE,
        }),
    )?;
    write_json(
        &out.join("generation_config.json"),
        &json!({"eos_token_id": [im_end, endoftext], "do_sample": false}),
    )?;
    Ok(Made { dir: out.to_path_buf(), parameters, bytes, files })
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::Float32 => "float32",
        Dtype::Float16 => "float16",
        _ => "bfloat16",
    }
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::malformed(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

/// Collects tensors into shards of about `limit` bytes; writes `model.safetensors`, or
/// `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
struct ShardWriter {
    dir: PathBuf,
    limit: usize,
    current: BTreeMap<String, Array>,
    current_bytes: usize,
    written: Vec<(PathBuf, Vec<String>)>,
    total: u64,
}

impl ShardWriter {
    fn new(dir: &Path, limit: usize) -> Self {
        ShardWriter { dir: dir.to_path_buf(), limit, current: BTreeMap::new(), current_bytes: 0, written: vec![], total: 0 }
    }

    fn add(&mut self, name: String, array: Array) -> Result<()> {
        array.eval()?;
        self.current_bytes += array.nbytes();
        self.total += array.nbytes() as u64;
        self.current.insert(name, array);
        if self.current_bytes >= self.limit {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.current.is_empty() {
            return Ok(());
        }
        let path = self.dir.join(format!("shard-{}.tmp.safetensors", self.written.len()));
        let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
        Array::save_safetensors(self.current.iter(), &metadata, &path)
            .map_err(|e| Error::malformed(&path, format!("writing: {e}")))?;
        let names = std::mem::take(&mut self.current).into_keys().collect();
        self.written.push((path, names));
        self.current_bytes = 0;
        Ok(())
    }

    fn finish(mut self) -> Result<(Vec<PathBuf>, u64)> {
        self.flush()?;
        let n = self.written.len();
        let mut files = Vec::new();
        let mut weight_map = BTreeMap::new();
        for (i, (tmp, names)) in self.written.iter().enumerate() {
            let name = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
            let path = self.dir.join(&name);
            std::fs::rename(tmp, &path).map_err(|e| Error::io(&path, e))?;
            for t in names {
                weight_map.insert(t.clone(), name.clone());
            }
            files.push(path);
        }
        let index = self.dir.join("model.safetensors.index.json");
        if n > 1 {
            write_json(&index, &json!({"metadata": {"total_size": self.total}, "weight_map": weight_map}))?;
        } else if index.exists() {
            std::fs::remove_file(&index).map_err(|e| Error::io(&index, e))?;
        }
        Ok((files, self.total))
    }
}
