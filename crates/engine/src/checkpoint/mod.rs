//! Project-made checkpoints: random weights in exactly the layout mlx-lm writes (config.json,
//! safetensors shards with an index, affine-quantized matrices, tokenizer files), so tests
//! and benchmarks run the real loading code without reaching the hub. Deterministic for a
//! seed: each tensor draws from its own key, derived from the seed and its name.

pub mod drafter;
pub mod presets;
pub mod tensors;
pub mod tokenizer_trainer;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub use mlx_rs::Dtype;
use mlx_rs::{ops, random, Array};
use serde_json::json;

pub use presets::Architecture;
pub use tensors::Layout;
use tensors::{Kind, TensorSpec};

use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct MakeOptions {
    pub arch: Architecture,
    pub preset: String,
    /// Affine quantization bits for matrices; `None` keeps them in `dtype`.
    pub bits: Option<i32>,
    pub group_size: i32,
    pub dtype: Dtype,
    /// Overrides the preset's `tie_word_embeddings`.
    pub tie_embeddings: Option<bool>,
    /// Overrides the preset's number of decoder layers (a deeper or shallower model of the
    /// same shapes).
    pub layers: Option<i32>,
    pub seed: u64,
    /// A new shard starts once one holds this many bytes.
    pub shard_bytes: usize,
    pub layout: Layout,
    /// Hybrid models: also write a multi-token-prediction head (`mtp.*`).
    pub mtp: bool,
}

impl MakeOptions {
    pub fn new(arch: Architecture, preset: &str) -> Self {
        MakeOptions {
            arch,
            preset: preset.to_string(),
            bits: None,
            group_size: 64,
            dtype: Dtype::Bfloat16,
            tie_embeddings: None,
            layers: None,
            seed: 0,
            shard_bytes: 4 << 30,
            layout: Layout::Mlx,
            mtp: false,
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

/// FNV-1a: a stable per-name key, independent of the order tensors are made in.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

fn random_tensor(spec: &TensorSpec, seed: u64, hidden: i32) -> Result<Array> {
    let key = random::key(seed ^ name_hash(&spec.name))?;
    let shape = &spec.shape[..];
    let fan_in = *spec.shape.last().unwrap_or(&1) as f32;
    let normal = |mean: f32, std: f32| random::normal::<f32>(shape, mean, std, &key);
    Ok(match spec.kind {
        Kind::Matrix | Kind::Router => normal(0.0, 1.0 / fan_in.sqrt())?,
        Kind::Table => normal(0.0, 2.0 / (hidden as f32).sqrt())?,
        Kind::Norm | Kind::DtBias => normal(1.0, 0.1)?,
        Kind::NormOffset => normal(0.0, 0.1)?,
        Kind::Conv => normal(0.0, 1.0 / (spec.shape.iter().product::<i32>() as f32 / spec.shape[0] as f32).sqrt())?,
        Kind::ALog => ops::log(random::uniform::<f32, f32>(1.0, 16.0, shape, &key)?)?,
    })
}

/// Writes a random checkpoint to `out` (created if needed).
pub fn make(opts: &MakeOptions, out: &Path) -> Result<Made> {
    let mut config = presets::config(opts.arch, &opts.preset)?;
    if let Some(tie) = opts.tie_embeddings {
        config["tie_word_embeddings"] = json!(tie);
    }
    if let Some(layers) = opts.layers {
        if layers < 1 {
            return Err(Error::Request(format!("a checkpoint needs at least one layer (asked for {layers})")));
        }
        presets::set_layers(&mut config, opts.arch, layers.into());
    }
    if opts.mtp {
        presets::add_mtp_head(&mut config, opts.arch)?;
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let parsed = crate::config::ModelConfig::parse(&config.to_string(), &out.join("config.json"))?;
    let hidden = parsed.hidden_size;

    let Written { files, bytes, parameters, quant } =
        write_tensors(tensors::tensor_specs(&parsed, opts.layout), opts, out, hidden)?;

    // Token ids: the trained vocabulary, then the special tokens.
    let vocab_size = parsed.vocab_size as usize;
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
    write_tokenizer_config(out)?;
    write_json(&out.join("generation_config.json"), &json!({"eos_token_id": [im_end, endoftext], "do_sample": false}))?;
    Ok(Made { dir: out.to_path_buf(), parameters, bytes, files })
}

/// What [`write_tensors`] wrote.
struct Written {
    files: Vec<PathBuf>,
    bytes: u64,
    parameters: u64,
    /// The config's quantization block.
    quant: serde_json::Map<String, serde_json::Value>,
}

/// Writes `specs` as random tensors (quantized as `opts` say) into `out`'s safetensors files.
fn write_tensors(specs: Vec<TensorSpec>, opts: &MakeOptions, out: &Path, hidden: i32) -> Result<Written> {
    let mut quant = serde_json::Map::new();
    if let Some(bits) = opts.bits {
        quant.insert("group_size".into(), json!(opts.group_size));
        quant.insert("bits".into(), json!(bits));
        quant.insert("mode".into(), json!("affine"));
    }

    let mut shards = ShardWriter::new(out, opts.shard_bytes);
    let mut parameters = 0u64;
    for spec in specs {
        parameters += spec.shape.iter().map(|&d| d as u64).product::<u64>();
        let dtype = if spec.kind == Kind::ALog { Dtype::Float32 } else { opts.dtype };
        let w = random_tensor(&spec, opts.seed, hidden)?.as_dtype(dtype)?;
        if spec.raw {
            shards.add(spec.name.clone(), w)?;
            continue;
        }
        let fan_in = *spec.shape.last().unwrap_or(&0);
        let bits = match (spec.kind, opts.bits) {
            (_, None) => None,
            (kind, _) if !kind.quantizable() => None,
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
    Ok(Written { files, bytes, parameters, quant })
}

/// `tokenizer_config.json` for a tokenizer from [`tokenizer_trainer`]: the chat template and
/// the special tokens' roles.
pub fn write_tokenizer_config(out: &Path) -> Result<()> {
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
    )
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
        ShardWriter {
            dir: dir.to_path_buf(),
            limit,
            current: BTreeMap::new(),
            current_bytes: 0,
            written: vec![],
            total: 0,
        }
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
            let name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            };
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
