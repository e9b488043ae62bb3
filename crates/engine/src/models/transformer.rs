//! The decoder-only trunk of the Qwen3 family: embeddings, pre-norm decoder layers, final
//! norm and the output projection (or the tied embedding table).

use mlx_rs::Array;

use super::language_model::LanguageModel;
use super::mtp::{MtpHead, Trunk};
use crate::batch_cache::BatchCache;
use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::distributed::schedule;
use crate::error::Result;
use crate::layers::attention::Rope;
use crate::layers::parallel::Split;
use crate::layers::switch::SORT_FROM;
use crate::layers::{Attention, DecoderLayer, Embedding, FeedForward, JoinGroup, Linear, Loader, Mixer, RmsNorm};

pub struct Transformer {
    pub config: ModelConfig,
    pub embed_tokens: Embedding,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `None` when the embeddings are tied.
    pub lm_head: Option<Linear>,
    pub mtp: Option<MtpHead>,
}

impl Transformer {
    /// Builds the trunk; for each layer `mixer(loader, index, path)` builds its attention (or
    /// linear-attention) part and `ffn(loader, index, path)` its feed-forward.
    pub fn build(
        config: &ModelConfig,
        ld: &mut Loader,
        mut mixer: impl FnMut(&mut Loader, i32, &str) -> Result<Mixer>,
        mut ffn: impl FnMut(&mut Loader, i32, &str) -> Result<FeedForward>,
    ) -> Result<Self> {
        let c = config;
        let (dim, eps) = (c.hidden_size, c.rms_norm_eps);
        let embed_tokens = ld.embedding("model.embed_tokens", c.vocab_size, dim)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers as usize);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(DecoderLayer {
                input_layernorm: ld.rms_norm(&format!("{p}.input_layernorm"), dim, eps)?,
                mixer: mixer(ld, i, &p)?,
                post_attention_layernorm: ld.rms_norm(&format!("{p}.post_attention_layernorm"), dim, eps)?,
                mlp: ffn(ld, i, &p)?,
                sum: ld.all_sum(),
            });
        }
        let norm = ld.rms_norm("model.norm", dim, eps)?;
        let lm_head = if c.tie_word_embeddings {
            // Some tied checkpoints still carry a copy; mlx-lm drops it too.
            ld.weights.drop_prefix("lm_head.");
            None
        } else {
            Some(ld.linear("lm_head", dim, c.vocab_size, false)?)
        };
        Ok(Transformer { config: config.clone(), embed_tokens, layers, norm, lm_head, mtp: None })
    }
}

/// Full attention at `{path}.self_attn`; `output_gate` for the hybrids' gated attention.
pub fn attention(c: &ModelConfig, ld: &mut Loader, path: &str, output_gate: bool) -> Result<Attention> {
    let (dim, hd, eps, bias) = (c.hidden_size, c.head_dim(), c.rms_norm_eps, c.attention_bias);
    let a = format!("{path}.self_attn");
    // Split across ranks, each holds a contiguous part of the query heads and the key/value
    // heads they read (grouped-query attention keeps its grouping).
    let (first, heads) = ld.part(c.num_attention_heads, "attention heads")?;
    let (first_kv, kv_heads) = ld.part(c.num_key_value_heads, "key/value heads")?;
    let q_rows = if output_gate { 2 * hd } else { hd };
    let q_split = ld.split(|| Split::Rows(Split::unit_rows(0, first, heads, q_rows)));
    let q = ld.linear_split(&format!("{a}.q_proj"), dim, c.num_attention_heads * q_rows, bias, q_split)?;
    let kv_split = ld.split(|| Split::Rows(Split::unit_rows(0, first_kv, kv_heads, hd)));
    let kv_width = c.num_key_value_heads * hd;
    let k = ld.linear_split(&format!("{a}.k_proj"), dim, kv_width, bias, kv_split.clone())?;
    let v = ld.linear_split(&format!("{a}.v_proj"), dim, kv_width, bias, kv_split)?;
    // A gated q_proj holds [q (head_dim), gate (head_dim)] per head: split into the two, so
    // each comes out of the joined matmul contiguous.
    let parts = if output_gate {
        let rows =
            |start: i32| (0..heads).flat_map(move |h| (0..hd).map(move |i| h * 2 * hd + start + i)).collect::<Vec<_>>();
        vec![q.take_rows(&rows(0))?, k, v, q.take_rows(&rows(hd))?]
    } else {
        vec![q, k, v]
    };
    Ok(Attention {
        qkv: ld.projections(JoinGroup::Attention, parts)?,
        o_proj: ld.linear_split(
            &format!("{a}.o_proj"),
            c.num_attention_heads * hd,
            dim,
            bias,
            ld.split(|| Split::Columns { start: first * hd, count: heads * hd }),
        )?,
        q_norm: ld.rms_norm(&format!("{a}.q_norm"), hd, eps)?,
        k_norm: ld.rms_norm(&format!("{a}.k_norm"), hd, eps)?,
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: hd,
        rope: Rope { dims: c.rope_dims(), base: c.rope_theta(), scale: c.rope_scale()? },
        output_gate,
    })
}

/// From this many positions on, a model with MoE layers evaluates its input layer by layer.
const EACH_LAYER_FROM: i32 = SORT_FROM as i32;

impl Transformer {
    fn has_moe(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.mlp, FeedForward::Moe(_)))
    }
}

impl Trunk for Transformer {
    fn logits(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed_tokens.as_linear(h),
        }
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.embed_tokens.forward(tokens)
    }
}

impl Transformer {
    /// The trunk over `tokens`: its final hidden states and the outputs of layers `taps`.
    fn run(&self, tokens: &Array, cache: &mut Cache, taps: &[usize]) -> Result<(Array, Vec<Array>)> {
        self.run_embedded(self.embed_tokens.forward(tokens)?, cache, taps)
    }

    /// [`Transformer::run`] from the input embeddings [B, L, H] (an image's rows already in
    /// place).
    fn run_embedded(&self, embeddings: Array, cache: &mut Cache, taps: &[usize]) -> Result<(Array, Vec<Array>)> {
        let mut tapped = Vec::with_capacity(taps.len());
        let mut h = embeddings;
        // A long input's MoE layers may dequantize their experts (`Gather::SortedDequantized`).
        // Left in one graph, MLX schedules those weight-only dequantizations ahead of the
        // activations that wait for them: ten of the 35B-A3B's 40 layers' (16 GB) were alive
        // at once on a 2048-token chunk. Evaluated layer by layer instead, one layer running
        // while the next is built, at most two layers' exist.
        let layerwise = h.dim(1) >= EACH_LAYER_FROM && self.has_moe();
        let mut running: Option<Array> = None;
        for (i, (layer, state)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            h = layer.forward(&h, state)?;
            if taps.contains(&i) {
                tapped.push((i, h.clone()));
            }
            if layerwise {
                schedule(self.is_split(), std::iter::once(&h).chain(state.state()))?;
                if let Some(previous) = running.replace(h.clone()) {
                    previous.eval()?; // scheduled already: this waits for it
                }
            }
        }
        // In the order asked for (a drafter's `target_layer_ids` need not be sorted).
        let outputs = taps
            .iter()
            .map(|t| tapped.iter().find(|(i, _)| i == t).map(|(_, h)| h.clone()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| crate::error::Error::Request(format!("taps {taps:?} name a layer the model lacks")))?;
        Ok((self.norm.forward(&h)?, outputs))
    }
}

impl LanguageModel for Transformer {
    fn hidden(&self, tokens: &Array, cache: &mut Cache) -> Result<Array> {
        Ok(self.run(tokens, cache, &[])?.0)
    }

    fn hidden_tapped(&self, tokens: &Array, cache: &mut Cache, taps: &[usize]) -> Result<(Array, Array)> {
        let (hidden, outputs) = self.run(tokens, cache, taps)?;
        Ok((hidden, mlx_rs::ops::concatenate(&outputs, -1)?))
    }

    fn hidden_embedded(&self, embeddings: &Array, cache: &mut Cache) -> Result<Array> {
        Ok(self.run_embedded(embeddings.clone(), cache, &[])?.0)
    }

    fn hidden_tapped_embedded(&self, embeddings: &Array, cache: &mut Cache, taps: &[usize]) -> Result<(Array, Array)> {
        let (hidden, outputs) = self.run_embedded(embeddings.clone(), cache, taps)?;
        Ok((hidden, mlx_rs::ops::concatenate(&outputs, -1)?))
    }

    fn hidden_batch(&self, tokens: &Array, cache: &mut BatchCache) -> Result<Array> {
        if cache.rows() != tokens.dim(0) as usize || tokens.dim(1) != 1 {
            return Err(crate::error::Error::Request(format!(
                "a batch of {} rows was given tokens of shape {:?} (one a row)",
                cache.rows(),
                tokens.shape()
            )));
        }
        if cache.layers.len() != self.layers.len() {
            return Err(crate::error::Error::Request("a batch cache of another model".into()));
        }
        let step = cache.step()?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            h = layer.forward_batch(&h, state, &step)?;
        }
        cache.advance();
        self.norm.forward(&h)
    }

    fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    fn mtp(&self) -> Option<&MtpHead> {
        self.mtp.as_ref()
    }

    fn is_split(&self) -> bool {
        self.layers.first().is_some_and(|l| l.sum.is_split())
    }

    fn new_cache(&self) -> Cache {
        Cache { layers: self.layers.iter().map(|l| l.mixer.new_cache()).collect() }
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }
}
