//! Qwen3.5 (`qwen3_5`, dense, and `qwen3_5_moe`): the text model of Qwen3.5, the same hybrid
//! as Qwen3-Next with split Gated DeltaNet projections (`in_proj_qkv`, `in_proj_z`,
//! `in_proj_b`, `in_proj_a`). Its config nests the text model under `text_config`
//! (config.rs reads it) and its weights under a language-model prefix (hybrid.rs maps it).

use super::hybrid::{self, InputLayout};
use super::Transformer;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::Loader;

pub fn build(config: &ModelConfig, ld: &mut Loader) -> Result<Transformer> {
    hybrid::build(config, ld, InputLayout::Split)
}
