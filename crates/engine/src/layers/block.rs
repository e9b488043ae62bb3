use mlx_rs::Array;

use super::parallel::AllSum;
use super::{Attention, GatedDeltaNet, Mlp, RmsNorm, SparseMoe};
use crate::batch_cache::{BatchLayer, Step};
use crate::cache::LayerCache;
use crate::error::{Error, Result};

/// What mixes information across positions: softmax attention over a KV cache, or a
/// Gated DeltaNet over a recurrent state.
#[derive(Debug, Clone)]
pub enum Mixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

impl Mixer {
    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array> {
        match (self, cache) {
            (Mixer::Attention(a), LayerCache::Kv(kv)) => a.forward(x, kv),
            (Mixer::Linear(l), LayerCache::Linear(state)) => l.forward(x, state),
            _ => Err(Error::Request("a layer was given the cache of another kind of layer".into())),
        }
    }

    /// One decode step of a batch: `x` [rows, 1, hidden], the rows' state stacked in `layer`
    /// (see [`crate::batch_cache`]).
    pub fn forward_batch(&self, x: &Array, layer: &mut BatchLayer, step: &Step) -> Result<Array> {
        match (self, layer) {
            (Mixer::Attention(a), BatchLayer::Kv(kv)) => a.forward_batch(x, kv, step),
            // A Gated DeltaNet's state has one shape whatever a sequence's length: the stacked
            // states step like one sequence's.
            (Mixer::Linear(l), BatchLayer::Linear(state)) => l.forward(x, state),
            _ => Err(Error::Request("a layer was given the cache of another kind of layer".into())),
        }
    }

    pub fn new_cache(&self) -> LayerCache {
        match self {
            Mixer::Attention(_) => LayerCache::Kv(Default::default()),
            Mixer::Linear(_) => LayerCache::Linear(Default::default()),
        }
    }
}

#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Moe(Box<SparseMoe>),
}

impl FeedForward {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Moe(moe) => moe.forward(x),
        }
    }

    /// `residual + ffn(x)` (a MoE block adds the residual inside its compiled combine).
    pub fn forward_plus(&self, x: &Array, residual: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => Ok(residual.add(mlp.forward(x)?)?),
            FeedForward::Moe(moe) => moe.forward_plus(x, Some(residual)),
        }
    }
}

/// A pre-norm decoder layer: `h = x + attn(norm(x)); out = h + ffn(norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub mixer: Mixer,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: FeedForward,
    /// Split across ranks, the mixer's and the feed-forward's outputs are this rank's part of
    /// the sum: summed across the group before each residual.
    pub sum: AllSum,
}

impl DecoderLayer {
    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array> {
        let mixed = self.mixer.forward(&self.input_layernorm.forward(x)?, cache)?;
        let h = x.add(self.sum.apply(mixed)?)?;
        self.feed_forward_plus(&h)
    }

    /// `h + ffn(norm(h))`, the feed-forward's partial outputs summed first when split.
    fn feed_forward_plus(&self, h: &Array) -> Result<Array> {
        let normed = self.post_attention_layernorm.forward(h)?;
        if self.sum.is_split() {
            return Ok(h.add(self.sum.apply(self.mlp.forward(&normed)?)?)?);
        }
        self.mlp.forward_plus(&normed, h)
    }

    /// One decode step of a batch (rows in `layer`, see [`crate::batch_cache`]): norms and
    /// feed-forward (dense or experts) for all rows at once, and the mixer too.
    pub fn forward_batch(&self, x: &Array, layer: &mut BatchLayer, step: &Step) -> Result<Array> {
        let mixed = self.mixer.forward_batch(&self.input_layernorm.forward(x)?, layer, step)?;
        let h = x.add(self.sum.apply(mixed)?)?;
        self.feed_forward_plus(&h)
    }
}
