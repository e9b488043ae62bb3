//! Qwen3 (dense): every layer has a SwiGLU MLP.

use super::transformer::attention;
use super::Transformer;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::{FeedForward, JoinGroup, Loader, Mixer, Mlp};

pub fn build(config: &ModelConfig, ld: &mut Loader) -> Result<Transformer> {
    Transformer::build(
        config,
        ld,
        |ld, _, p| Ok(Mixer::Attention(attention(config, ld, p, false)?)),
        |ld, _, p| {
            let path = &format!("{p}.mlp");
            Ok(FeedForward::Dense(mlp(ld, path, config.hidden_size, config.intermediate_size)?))
        },
    )
}

pub fn mlp(ld: &mut Loader, path: &str, dim: i32, hidden: i32) -> Result<Mlp> {
    let gate = ld.linear(&format!("{path}.gate_proj"), dim, hidden, false)?;
    let up = ld.linear(&format!("{path}.up_proj"), dim, hidden, false)?;
    Ok(Mlp::new(
        ld.projections(JoinGroup::Mlp, vec![gate, up])?,
        ld.linear(&format!("{path}.down_proj"), hidden, dim, false)?,
    ))
}
