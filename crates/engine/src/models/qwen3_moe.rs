//! Qwen3-MoE: sparse layers route each token to `num_experts_per_tok` of `num_experts`
//! SwiGLU experts; `mlp_only_layers` and `decoder_sparse_step` keep some layers dense.
//!
//! Experts are read stacked (`mlp.switch_mlp.{gate,up,down}_proj`, as mlx-community
//! publishes them) or one by one (`mlp.experts.{e}.*`, the Transformers layout), which is
//! stacked here as mlx-lm's `sanitize` does.

use mlx_rs::{ops, Array};

use super::transformer::attention;
use super::{qwen3, Transformer};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::parallel::Split;
use crate::layers::switch::SwitchGlu;
use crate::layers::{FeedForward, Loader, Mixer, Projections, SparseMoe};

pub fn build(config: &ModelConfig, ld: &mut Loader) -> Result<Transformer> {
    let c = config;
    Transformer::build(
        config,
        ld,
        |ld, _, p| Ok(Mixer::Attention(attention(c, ld, p, false)?)),
        |ld, layer, p| {
            let path = &format!("{p}.mlp");
            if !c.is_moe_layer(layer) {
                return Ok(FeedForward::Dense(qwen3::mlp(ld, path, c.hidden_size, c.intermediate_size)?));
            }
            let (e, dim, hidden) = (c.num_experts, c.hidden_size, c.moe_intermediate_size);
            stack_expert_layouts(ld, path, e)?;
            let experts = switch_glu(ld, path, e, dim, hidden)?;
            Ok(FeedForward::Moe(Box::new(SparseMoe {
                router: Projections::Separate(vec![ld.linear(&format!("{path}.gate"), dim, e, false)?]),
                experts,
                top_k: c.num_experts_per_tok,
                norm_topk_prob: c.norm_topk_prob(),
                shared: None,
            })))
        },
    )
}

/// The experts of the MoE block at `path` (`switch_mlp.{gate,up,down}_proj`, stacked).
pub fn switch_glu(ld: &mut Loader, path: &str, experts: i32, dim: i32, hidden: i32) -> Result<SwitchGlu> {
    // Split across ranks, every expert keeps a part of its hidden width (as mlx-lm shards).
    let (first, count) = ld.part(hidden, "expert hidden units")?;
    let rows = ld.split(|| Split::Rows(Split::unit_rows(0, first, count, 1)));
    let columns = ld.split(|| Split::Columns { start: first, count });
    let mut proj = |name: &str, inp: i32, out: i32, split: Option<Split>| {
        ld.switch_linear(&format!("{path}.switch_mlp.{name}"), experts, inp, out, split)
    };
    let gate = proj("gate_proj", dim, hidden, rows.clone())?;
    let up = proj("up_proj", dim, hidden, rows)?;
    let down = proj("down_proj", hidden, dim, columns)?;
    SwitchGlu::new(gate, up, down, count, ld.long_prompt_gather.clone())
}

/// Rewrites the Transformers expert layouts of the MoE block at `path` into mlx-lm's stacked
/// `{path}.switch_mlp.{gate,up,down}_proj.*`: one tensor per expert (`experts.{i}.*`), or
/// Qwen3.5's fused `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj`.
pub fn stack_expert_layouts(ld: &mut Loader, path: &str, experts: i32) -> Result<()> {
    let fused = format!("{path}.experts.gate_up_proj");
    if ld.weights.contains(&fused) {
        let gate_up = ld.weights.take(&fused, None)?;
        let halves = gate_up.split_equal(2, -2)?;
        ld.weights.insert(format!("{path}.switch_mlp.gate_proj.weight"), halves[0].clone());
        ld.weights.insert(format!("{path}.switch_mlp.up_proj.weight"), halves[1].clone());
        let down = ld.weights.take(&format!("{path}.experts.down_proj"), None)?;
        ld.weights.insert(format!("{path}.switch_mlp.down_proj.weight"), down);
    }
    for name in ["gate_proj", "up_proj", "down_proj"] {
        stack_experts(ld, path, name, experts)?;
    }
    Ok(())
}

/// Moves `{path}.experts.{i}.{name}.*` into one stacked `{path}.switch_mlp.{name}.*`.
fn stack_experts(ld: &mut Loader, path: &str, name: &str, experts: i32) -> Result<()> {
    for part in ["weight", "scales", "biases"] {
        if !ld.weights.contains(&format!("{path}.experts.0.{name}.{part}")) {
            continue;
        }
        let parts: Vec<Array> = (0..experts)
            .map(|i| ld.weights.take(&format!("{path}.experts.{i}.{name}.{part}"), None))
            .collect::<Result<_>>()?;
        let stacked = ops::stack(&parts, 0)?;
        ld.weights.insert(format!("{path}.switch_mlp.{name}.{part}"), stacked);
    }
    Ok(())
}
