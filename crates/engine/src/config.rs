//! `config.json` of an MLX checkpoint: the fields the Qwen3 family uses, the quantization
//! block (with per-layer overrides), and checks that name the field that is wrong.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::architecture::Architecture;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// As written in `config.json` (messages, `/v1/status`); [`ModelConfig::architecture`]
    /// is what the code decides on.
    pub model_type: String,
    /// Set by [`ModelConfig::parse`] from `model_type`.
    #[serde(skip)]
    pub architecture: Architecture,
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    /// Dense MLP width (absent in configs whose every layer is MoE).
    #[serde(default)]
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    #[serde(default)]
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    #[serde(default)]
    pub max_position_embeddings: Option<i32>,
    #[serde(default)]
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,

    // Mixture of experts (qwen3_moe).
    #[serde(default)]
    pub num_experts: i32,
    #[serde(default)]
    pub num_experts_per_tok: i32,
    #[serde(default)]
    pub moe_intermediate_size: i32,
    #[serde(default = "one")]
    pub decoder_sparse_step: i32,
    #[serde(default)]
    pub mlp_only_layers: Vec<i32>,
    /// Defaults differ by architecture: see [`ModelConfig::norm_topk_prob`].
    #[serde(default, rename = "norm_topk_prob")]
    pub norm_topk_prob_field: Option<bool>,
    /// Hybrid models: a shared expert beside the routed ones.
    #[serde(default)]
    pub shared_expert_intermediate_size: i32,

    // Hybrid models (qwen3_next, qwen3_5): Gated DeltaNet layers between full-attention ones.
    #[serde(default)]
    pub linear_num_value_heads: i32,
    #[serde(default)]
    pub linear_num_key_heads: i32,
    #[serde(default)]
    pub linear_key_head_dim: i32,
    #[serde(default)]
    pub linear_value_head_dim: i32,
    #[serde(default)]
    pub linear_conv_kernel_dim: i32,
    #[serde(default = "four")]
    pub full_attention_interval: i32,
    /// Per layer `linear_attention` or `full_attention`; overrides the interval.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Fraction of each attention head that gets rotary embeddings.
    #[serde(default)]
    pub partial_rotary_factor: Option<f32>,
    /// Layers of the MTP head (Qwen3-Next / Qwen3.5 name it differently).
    #[serde(default)]
    pub num_nextn_predict_layers: Option<i32>,
    #[serde(default)]
    pub mtp_num_hidden_layers: Option<i32>,
    /// Transformers >= 5 nests rope_theta / partial_rotary_factor here (Qwen3.5).
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,

    /// mlx-lm writes `quantization` (and a copy as `quantization_config`, which some
    /// converters write alone).
    #[serde(default)]
    pub quantization: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub quantization_config: Option<serde_json::Map<String, serde_json::Value>>,

    /// Filled in by [`ModelConfig::load`], not read from the file.
    #[serde(skip)]
    pub path: PathBuf,
    #[serde(skip)]
    pub quant: Option<Quantization>,
}

fn one() -> i32 {
    1
}

fn four() -> i32 {
    4
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeScaling {
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub factor: Option<f32>,
}

/// Affine quantization of a linear or embedding layer, as `mx.quantize` writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
}

/// The checkpoint's quantization: the default spec and per-module overrides
/// (`None` = that module is kept in floating point).
#[derive(Debug, Clone)]
pub struct Quantization {
    pub default: QuantSpec,
    pub overrides: HashMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The spec for the module at `path` (e.g. `model.layers.0.mlp.gate`).
    pub fn spec_for(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(spec) => *spec,
            None => Some(self.default),
        }
    }
}

impl ModelConfig {
    /// Reads and checks `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if path.exists() {
            crate::weights::inside_model(dir, &path)?;
        }
        let text = crate::small_file::read_text(&path, crate::small_file::JSON_CAP)?;
        Self::parse(&text, &path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::malformed(path, format!("not valid JSON: {e}")))?;
        let (value, prefix) = flatten_text_config(value);
        let mut config: ModelConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let field = format!("{prefix}{}", e.path());
            Error::config(path, field, e.into_inner().to_string())
        })?;
        config.path = path.to_path_buf();
        config.architecture =
            Architecture::from_model_type(&config.model_type).ok_or_else(|| Error::UnknownArchitecture {
                path: path.to_path_buf(),
                model_type: config.model_type.clone(),
                supported: Architecture::known(),
            })?;
        config.quant = config
            .quantization
            .as_ref()
            .or(config.quantization_config.as_ref())
            .map(|block| parse_quantization(block, path))
            .transpose()?;
        config.validate()?;
        Ok(config)
    }

    pub fn head_dim(&self) -> i32 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn rope_theta(&self) -> f32 {
        let nested = self.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(|t| t.as_f64());
        self.rope_theta.or(nested.map(|t| t as f32)).unwrap_or(1_000_000.0)
    }

    /// How the rotary frequencies split over time, height and width for image tokens
    /// (`rope_parameters.mrope_section`; Qwen3.5's [11, 11, 10] when absent).
    pub fn mrope_section(&self) -> [usize; 3] {
        let given = self.rope_parameters.as_ref().and_then(|p| p.get("mrope_section")).and_then(|s| s.as_array());
        match given.map(|s| s.iter().filter_map(|x| x.as_u64()).map(|x| x as usize).collect::<Vec<_>>()) {
            Some(s) if s.len() == 3 => [s[0], s[1], s[2]],
            _ => [11, 11, 10],
        }
    }

    /// Rotary dimensions per head (all of them unless `partial_rotary_factor` says less).
    pub fn rope_dims(&self) -> i32 {
        let nested =
            self.rope_parameters.as_ref().and_then(|p| p.get("partial_rotary_factor")).and_then(|f| f.as_f64());
        let factor = self.partial_rotary_factor.or(nested.map(|f| f as f32)).unwrap_or(1.0);
        (self.head_dim() as f32 * factor) as i32
    }

    /// Qwen3.5 normalises the top-k router weights by default, the others do not.
    pub fn norm_topk_prob(&self) -> bool {
        self.norm_topk_prob_field.unwrap_or(self.architecture.is_qwen3_5())
    }

    /// A Qwen3-Next / Qwen3.5 hybrid (Gated DeltaNet + gated full attention).
    pub fn is_hybrid(&self) -> bool {
        self.architecture.is_hybrid()
    }

    /// Whether layer `i` of a hybrid model is a Gated DeltaNet layer.
    pub fn is_linear_layer(&self, i: i32) -> bool {
        if !self.is_hybrid() {
            return false;
        }
        match &self.layer_types {
            Some(types) => types.get(i as usize).is_some_and(|t| t == "linear_attention"),
            None => (i + 1) % self.full_attention_interval.max(1) != 0,
        }
    }

    /// RoPE position scale for `mx.fast.rope` (1 / factor for linear scaling).
    pub fn rope_scale(&self) -> Result<f32> {
        let Some(scaling) = &self.rope_scaling else {
            return Ok(1.0);
        };
        match scaling.rope_type.as_deref() {
            None | Some("default") => Ok(1.0),
            Some("linear") => Ok(1.0 / scaling.factor.unwrap_or(1.0)),
            Some(other) => Err(Error::config(
                &self.path,
                "rope_scaling.rope_type",
                format!("`{other}` is not supported (supported: default, linear)"),
            )),
        }
    }

    pub fn is_moe_layer(&self, layer: i32) -> bool {
        if self.architecture.is_qwen3_5() {
            return self.num_experts > 0;
        }
        self.num_experts > 0
            && !self.mlp_only_layers.contains(&layer)
            && (layer + 1) % self.decoder_sparse_step.max(1) == 0
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
            ("head_dim", self.head_dim()),
        ];
        for (field, value) in positive {
            if value <= 0 {
                return Err(Error::config(&self.path, field, format!("must be > 0, got {value}")));
            }
        }
        self.check_bounds()?;
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(Error::config(
                &self.path,
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads = {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.is_hybrid() {
            let linear = [
                ("linear_num_value_heads", self.linear_num_value_heads),
                ("linear_num_key_heads", self.linear_num_key_heads),
                ("linear_key_head_dim", self.linear_key_head_dim),
                ("linear_value_head_dim", self.linear_value_head_dim),
                ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ];
            for (field, value) in linear {
                if value <= 0 {
                    return Err(Error::config(&self.path, field, format!("a hybrid model needs it > 0, got {value}")));
                }
            }
            if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
                return Err(Error::config(
                    &self.path,
                    "linear_num_value_heads",
                    "must be a multiple of linear_num_key_heads",
                ));
            }
            if let Some(types) = &self.layer_types {
                if types.len() != self.num_hidden_layers as usize {
                    return Err(Error::config(
                        &self.path,
                        "layer_types",
                        format!("has {} entries for {} layers", types.len(), self.num_hidden_layers),
                    ));
                }
            }
        }
        if (0..self.num_hidden_layers).any(|i| !self.is_moe_layer(i)) && self.intermediate_size <= 0 {
            return Err(Error::config(&self.path, "intermediate_size", "dense layers need intermediate_size > 0"));
        }
        if self.architecture == Architecture::Qwen3Moe || (self.is_hybrid() && self.num_experts > 0) {
            if self.num_experts <= 0 {
                return Err(Error::config(&self.path, "num_experts", "qwen3_moe needs num_experts > 0"));
            }
            if self.num_experts_per_tok <= 0 || self.num_experts_per_tok > self.num_experts {
                return Err(Error::config(
                    &self.path,
                    "num_experts_per_tok",
                    format!("must be in 1..={}, got {}", self.num_experts, self.num_experts_per_tok),
                ));
            }
            if self.moe_intermediate_size <= 0 {
                return Err(Error::config(&self.path, "moe_intermediate_size", "must be > 0"));
            }
        }
        self.rope_scale()?;
        Ok(())
    }
}

/// The largest value each size field may have. Config files come from the hub: untrusted. A
/// value past these (all well above any released model) would size allocations of hundreds of
/// gigabytes or overflow the i32 shape arithmetic MLX uses, so it is refused by name.
const BOUNDS: [(&str, i64); 18] = [
    ("hidden_size", 1 << 16),
    ("num_hidden_layers", 1 << 10),
    ("intermediate_size", 1 << 18),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("vocab_size", 1 << 22),
    ("max_position_embeddings", 1 << 24),
    ("num_experts", 1 << 12),
    ("num_experts_per_tok", 1 << 8),
    ("moe_intermediate_size", 1 << 18),
    ("shared_expert_intermediate_size", 1 << 18),
    ("linear_num_value_heads", 1 << 10),
    ("linear_num_key_heads", 1 << 10),
    ("linear_key_head_dim", 1 << 12),
    ("linear_value_head_dim", 1 << 12),
    ("linear_conv_kernel_dim", 1 << 6),
    ("mtp_num_hidden_layers", 1 << 4),
];

impl ModelConfig {
    fn value_of(&self, field: &str) -> i64 {
        let v = match field {
            "hidden_size" => self.hidden_size,
            "num_hidden_layers" => self.num_hidden_layers,
            "intermediate_size" => self.intermediate_size,
            "num_attention_heads" => self.num_attention_heads,
            "num_key_value_heads" => self.num_key_value_heads,
            "head_dim" => self.head_dim(),
            "vocab_size" => self.vocab_size,
            "max_position_embeddings" => self.max_position_embeddings.unwrap_or(0),
            "num_experts" => self.num_experts,
            "num_experts_per_tok" => self.num_experts_per_tok,
            "moe_intermediate_size" => self.moe_intermediate_size,
            "shared_expert_intermediate_size" => self.shared_expert_intermediate_size,
            "linear_num_value_heads" => self.linear_num_value_heads,
            "linear_num_key_heads" => self.linear_num_key_heads,
            "linear_key_head_dim" => self.linear_key_head_dim,
            "linear_value_head_dim" => self.linear_value_head_dim,
            "linear_conv_kernel_dim" => self.linear_conv_kernel_dim,
            "mtp_num_hidden_layers" => self.mtp_num_hidden_layers.or(self.num_nextn_predict_layers).unwrap_or(0),
            _ => 0,
        };
        v as i64
    }

    /// Every size field within [`BOUNDS`], and the products the layers compute within i32.
    fn check_bounds(&self) -> Result<()> {
        for (field, most) in BOUNDS {
            let value = self.value_of(field);
            if value > most {
                return Err(Error::config(
                    &self.path,
                    field,
                    format!("{value} is beyond what Ferrite loads (at most {most})"),
                ));
            }
            if value < 0 {
                return Err(Error::config(&self.path, field, format!("must not be negative, got {value}")));
            }
        }
        let products = [
            ("num_attention_heads", self.value_of("num_attention_heads") * self.value_of("head_dim")),
            (
                "linear_num_value_heads",
                self.value_of("linear_num_value_heads") * self.value_of("linear_value_head_dim"),
            ),
            ("num_experts", self.value_of("num_experts") * self.value_of("moe_intermediate_size")),
        ];
        for (field, product) in products {
            if product > i32::MAX as i64 / 4 {
                return Err(Error::config(
                    &self.path,
                    field,
                    format!("gives a dimension of {product}: beyond what Ferrite loads"),
                ));
            }
        }
        Ok(())
    }
}

/// Qwen3.5 configs describe the text model under `text_config` (beside a vision tower we do
/// not run); its fields are read as if they stood at the top, with the top-level
/// `model_type`, quantization and other settings winning. Returns the prefix for error paths.
fn flatten_text_config(value: serde_json::Value) -> (serde_json::Value, &'static str) {
    let serde_json::Value::Object(mut top) = value else {
        return (value, "");
    };
    let Some(serde_json::Value::Object(mut text)) = top.remove("text_config") else {
        return (serde_json::Value::Object(top), "");
    };
    top.remove("vision_config");
    for (k, v) in top {
        if k == "model_type" || !text.contains_key(&k) {
            text.insert(k, v);
        }
    }
    (serde_json::Value::Object(text), "text_config.")
}

fn parse_quantization(block: &serde_json::Map<String, serde_json::Value>, path: &Path) -> Result<Quantization> {
    let unsupported = |detail: String| Error::UnsupportedQuantization { path: path.to_path_buf(), detail };
    if let Some(mode) = block.get("mode").and_then(|m| m.as_str()) {
        if mode != "affine" {
            return Err(unsupported(format!("mode `{mode}` (only affine is supported)")));
        }
    }
    let spec = |value: &serde_json::Value, at: &str| -> Result<QuantSpec> {
        let field = |name: &str| {
            value
                .get(name)
                .and_then(|v| v.as_i64())
                .ok_or_else(|| Error::config(path, format!("{at}.{name}"), "missing or not an integer"))
        };
        let spec = QuantSpec { group_size: field("group_size")? as i32, bits: field("bits")? as i32 };
        if ![2, 3, 4, 5, 6, 8].contains(&spec.bits) {
            return Err(unsupported(format!("{at}: {} bits (supported: 2, 3, 4, 5, 6, 8)", spec.bits)));
        }
        if ![32, 64, 128].contains(&spec.group_size) {
            return Err(unsupported(format!("{at}: group size {} (supported: 32, 64, 128)", spec.group_size)));
        }
        Ok(spec)
    };
    let root = serde_json::Value::Object(block.clone());
    let default = spec(&root, "quantization")?;
    let mut overrides = HashMap::new();
    for (key, value) in block {
        match value {
            serde_json::Value::Object(_) => {
                overrides.insert(key.clone(), Some(spec(value, &format!("quantization.{key}"))?));
            }
            serde_json::Value::Bool(false) => {
                overrides.insert(key.clone(), None);
            }
            _ => {}
        }
    }
    Ok(Quantization { default, overrides })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,
        "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
        "rms_norm_eps":1e-6,"vocab_size":256,"rope_theta":1000000,"tie_word_embeddings":true}"#;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::parse(text, Path::new("m/config.json"))
    }

    #[test]
    fn parses_a_qwen3_config() {
        let c = parse(TINY).unwrap();
        assert_eq!(c.head_dim(), 16);
        assert!(c.quant.is_none());
        assert!(!c.is_moe_layer(0));
    }

    #[test]
    fn names_the_bad_field() {
        let text = TINY.replace("\"hidden_size\":64", "\"hidden_size\":\"wide\"");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("m/config.json") && err.contains("hidden_size"), "{err}");
    }

    #[test]
    fn rejects_unknown_architecture_and_bad_json() {
        let err = parse(&TINY.replace("\"qwen3\"", "\"llama\"")).unwrap_err().to_string();
        assert!(err.contains("unknown architecture `llama`"), "{err}");
        let err = parse("{\"model_type\": ").unwrap_err().to_string();
        assert!(err.contains("not valid JSON"), "{err}");
    }

    #[test]
    fn reads_quantization_with_overrides() {
        let text = TINY.replace(
            "\"tie_word_embeddings\":true",
            r#""tie_word_embeddings":true,"quantization":{"group_size":64,"bits":4,
               "model.layers.0.mlp.gate":{"group_size":64,"bits":8},"lm_head":false}"#,
        );
        let q = parse(&text).unwrap().quant.unwrap();
        assert_eq!(q.spec_for("model.layers.1.mlp.up_proj"), Some(QuantSpec { group_size: 64, bits: 4 }));
        assert_eq!(q.spec_for("model.layers.0.mlp.gate"), Some(QuantSpec { group_size: 64, bits: 8 }));
        assert_eq!(q.spec_for("lm_head"), None);
        let bad = text.replace("\"bits\":4", "\"bits\":7");
        assert!(parse(&bad).unwrap_err().to_string().contains("7 bits"));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        const QWEN3_NEXT: &str = r#"{"model_type":"qwen3_next","hidden_size":64,"num_hidden_layers":4,
            "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
            "rms_norm_eps":1e-6,"vocab_size":256,"rope_theta":1000000,"tie_word_embeddings":false,
            "full_attention_interval":2,"linear_num_value_heads":4,"linear_num_key_heads":2,
            "linear_key_head_dim":16,"linear_value_head_dim":16,"linear_conv_kernel_dim":4,"num_experts":4,
            "num_experts_per_tok":2,"moe_intermediate_size":32,"shared_expert_intermediate_size":32,
            "decoder_sparse_step":1,"partial_rotary_factor":0.25,"max_position_embeddings":4096}"#;

        /// The fields of a hybrid MoE config with any integer (or another type) in each.
        fn config() -> impl Strategy<Value = serde_json::Value> {
            let base: serde_json::Value = serde_json::from_str(QWEN3_NEXT).unwrap();
            let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
            let value = prop_oneof![
                any::<i64>().prop_map(serde_json::Value::from),
                (-4i64..70000).prop_map(serde_json::Value::from),
                any::<f64>()
                    .prop_map(|f| serde_json::Number::from_f64(f).map(serde_json::Value::Number).unwrap_or_default()),
                Just(serde_json::Value::Null),
                "\\PC{0,8}".prop_map(serde_json::Value::from),
            ];
            prop::collection::vec((prop::sample::select(keys), value), 0..6).prop_map(move |edits| {
                let mut c = base.clone();
                for (k, v) in edits {
                    c[k] = v;
                }
                c
            })
        }

        proptest! {
            /// Any values: a config or an error naming config.json; never a panic. What parses
            /// stays within the bounds the layers' shape arithmetic relies on.
            #[test]
            fn any_values_parse_or_are_named(c in config()) {
                match ModelConfig::parse(&c.to_string(), Path::new("m/config.json")) {
                    Ok(config) => {
                        for (field, most) in BOUNDS {
                            prop_assert!(config.value_of(field) <= most, "{field}");
                        }
                        prop_assert!(config.head_dim() > 0 && config.num_hidden_layers > 0);
                    }
                    Err(e) => prop_assert!(e.to_string().contains("m/config.json"), "{e}"),
                }
            }
        }
    }
}
