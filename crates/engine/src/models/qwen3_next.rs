//! Qwen3-Next: a hybrid of Gated DeltaNet layers (fused `in_proj_qkvz` / `in_proj_ba`
//! projections) and gated full attention every `full_attention_interval` layers, with
//! mixture-of-experts feed-forwards that add a shared expert.

use super::hybrid::{self, InputLayout};
use super::Transformer;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::Loader;

pub fn build(config: &ModelConfig, ld: &mut Loader) -> Result<Transformer> {
    hybrid::build(config, ld, InputLayout::Fused)
}
