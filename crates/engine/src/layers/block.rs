use mlx_rs::Array;

use super::{Attention, GatedDeltaNet, Mlp, RmsNorm, SparseMoe};
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

    /// `x` [B, L, hidden], row i with its own cache `caches[i]` (see
    /// [`Attention::forward_rows`], [`GatedDeltaNet::forward_rows`]).
    pub fn forward_rows(&self, x: &Array, caches: &mut [&mut LayerCache]) -> Result<Array> {
        let wrong = || Error::Request("a layer was given the cache of another kind of layer".into());
        match self {
            Mixer::Attention(a) => {
                let mut kv = caches
                    .iter_mut()
                    .map(|c| match &mut **c {
                        LayerCache::Kv(kv) => Ok(kv),
                        LayerCache::Linear(_) => Err(wrong()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                a.forward_rows(x, &mut kv)
            }
            Mixer::Linear(l) => {
                let mut states = caches
                    .iter_mut()
                    .map(|c| match &mut **c {
                        LayerCache::Linear(state) => Ok(state),
                        LayerCache::Kv(_) => Err(wrong()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                l.forward_rows(x, &mut states)
            }
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
}

impl DecoderLayer {
    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array> {
        let h = x.add(self.mixer.forward(&self.input_layernorm.forward(x)?, cache)?)?;
        self.mlp.forward_plus(&self.post_attention_layernorm.forward(&h)?, &h)
    }

    /// `x` [B, L, hidden], row i a sequence with its own cache `caches[i]`: norms and
    /// feed-forward (dense or experts) for all rows at once, the mixer per row's state.
    pub fn forward_rows(&self, x: &Array, caches: &mut [&mut LayerCache]) -> Result<Array> {
        let h = x.add(self.mixer.forward_rows(&self.input_layernorm.forward(x)?, caches)?)?;
        self.mlp.forward_plus(&self.post_attention_layernorm.forward(&h)?, &h)
    }
}
