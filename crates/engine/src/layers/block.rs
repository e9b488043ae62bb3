use mlx_rs::Array;

use super::{Attention, Mlp, RmsNorm, SparseMoe};
use crate::cache::KvCache;
use crate::error::Result;

#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

impl FeedForward {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Moe(moe) => moe.forward(x),
        }
    }
}

/// A pre-norm decoder layer: `h = x + attn(norm(x)); out = h + ffn(norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: FeedForward,
}

impl DecoderLayer {
    pub fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let h = x.add(self.self_attn.forward(&self.input_layernorm.forward(x)?, cache)?)?;
        let r = self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(r)?)
    }
}
