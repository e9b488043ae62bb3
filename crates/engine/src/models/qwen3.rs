//! Qwen3 (dense): every layer has a SwiGLU MLP.

use super::transformer::attention;
use super::Transformer;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::parallel::Split;
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

/// A SwiGLU MLP; split across ranks, each holds a part of its hidden width.
pub fn mlp(ld: &mut Loader, path: &str, dim: i32, hidden: i32) -> Result<Mlp> {
    let (first, count) = ld.part(hidden, "MLP hidden units")?;
    let rows = ld.split(|| Split::Rows(Split::unit_rows(0, first, count, 1)));
    let gate = ld.linear_split(&format!("{path}.gate_proj"), dim, hidden, false, rows.clone())?;
    let up = ld.linear_split(&format!("{path}.up_proj"), dim, hidden, false, rows)?;
    let columns = ld.split(|| Split::Columns { start: first, count });
    Ok(Mlp::new(
        ld.projections(JoinGroup::Mlp, vec![gate, up])?,
        ld.linear_split(&format!("{path}.down_proj"), hidden, dim, false, columns)?,
    ))
}
