//! The multi-token-prediction head of the hybrid models: from the trunk's hidden state at
//! position p and the token at p + 1 it predicts the token at p + 2, sharing the trunk's
//! embeddings and output head:
//!
//! `h' = layers(fc(concat[norm_e(embed(token)), norm_h(h)]))`, logits = `lm_head(norm(h'))`.
//!
//! Applied again on its own output it drafts deeper. Its attention layers keep their own KV
//! cache, over the same positions as the trunk.

use mlx_rs::{ops, Array};

use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::layers::{DecoderLayer, Linear, Loader, Mixer, RmsNorm};

/// What the head reads from the trunk it drafts for: the token embeddings and the output
/// layer it shares. Every language model is one (`LanguageModel: Trunk`).
pub trait Trunk {
    /// Token embeddings.
    fn embed(&self, tokens: &Array) -> Result<Array>;
    /// Output logits for final hidden states.
    fn logits(&self, hidden: &Array) -> Result<Array>;
}

pub struct MtpHead {
    pub fc: Linear,
    pub pre_fc_norm_embedding: RmsNorm,
    pub pre_fc_norm_hidden: RmsNorm,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
}

impl MtpHead {
    /// Layers in the head: `num_nextn_predict_layers` (Qwen3-Next) or
    /// `mtp_num_hidden_layers` (Qwen3.5).
    pub fn depth(c: &ModelConfig) -> i32 {
        c.num_nextn_predict_layers.or(c.mtp_num_hidden_layers).unwrap_or(1)
    }

    /// Builds the head from `mtp.*` if the checkpoint has one; a head whose shapes do not fit
    /// the trunk is an error naming the tensor.
    pub fn load(
        c: &ModelConfig,
        ld: &mut Loader,
        mut layer: impl FnMut(&mut Loader, &str) -> Result<DecoderLayer>,
    ) -> Result<Option<Self>> {
        if !ld.weights.contains("mtp.fc.weight") {
            return Ok(None);
        }
        let h = c.hidden_size;
        let wrap = |e: Error| match e {
            Error::Shape { file, name, expected, found } => Error::Malformed {
                path: file,
                message: format!(
                    "the MTP head does not fit the trunk: `{name}` has shape {found:?}, the config needs {expected:?}"
                ),
            },
            Error::MissingTensor { dir, name } => {
                Error::Malformed { path: dir, message: format!("the MTP head is incomplete: `{name}` is missing") }
            }
            other => other,
        };
        let mut build = || -> Result<Self> {
            Ok(MtpHead {
                fc: ld.linear("mtp.fc", 2 * h, h, false)?,
                pre_fc_norm_embedding: ld.rms_norm("mtp.pre_fc_norm_embedding", h, c.rms_norm_eps)?,
                pre_fc_norm_hidden: ld.rms_norm("mtp.pre_fc_norm_hidden", h, c.rms_norm_eps)?,
                layers: (0..Self::depth(c)).map(|i| layer(ld, &format!("mtp.layers.{i}"))).collect::<Result<_>>()?,
                norm: ld.rms_norm("mtp.norm", h, c.rms_norm_eps)?,
            })
        };
        build().map(Some).map_err(wrap)
    }

    pub fn new_cache(&self) -> Cache {
        Cache { layers: self.layers.iter().map(|l| l.mixer.new_cache()).collect() }
    }

    /// Hidden states [B, L, H] (before the head's final norm) for trunk hidden states `hidden`
    /// at positions p..p+L and the tokens at p+1..p+L+1.
    pub fn forward(&self, model: &dyn Trunk, hidden: &Array, tokens: &Array, cache: &mut Cache) -> Result<Array> {
        let e = self.pre_fc_norm_embedding.forward(&model.embed(tokens)?)?;
        let h = self.pre_fc_norm_hidden.forward(hidden)?;
        let mut x = self.fc.forward(&ops::concatenate(&[e, h], -1)?)?;
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.forward(&x, state)?;
        }
        Ok(x)
    }

    /// Logits for the head's hidden states.
    pub fn logits(&self, model: &dyn Trunk, x: &Array) -> Result<Array> {
        model.logits(&self.norm.forward(x)?)
    }

    pub fn is_attention_only(&self) -> bool {
        self.layers.iter().all(|l| matches!(l.mixer, Mixer::Attention(_)))
    }
}
