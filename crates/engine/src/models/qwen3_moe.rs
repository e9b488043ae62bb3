//! Qwen3-MoE: sparse layers route each token to `num_experts_per_tok` of `num_experts`
//! SwiGLU experts; `mlp_only_layers` and `decoder_sparse_step` keep some layers dense.
//!
//! Experts are read stacked (`mlp.switch_mlp.{gate,up,down}_proj`, as mlx-community
//! publishes them) or one by one (`mlp.experts.{e}.*`, the Transformers layout), which is
//! stacked here as mlx-lm's `sanitize` does.

use mlx_rs::{ops, Array};

use super::{qwen3, Transformer};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::moe::{SwitchGlu, SwitchLinear};
use crate::layers::{FeedForward, Loader, SparseMoe};

pub fn build(config: &ModelConfig, ld: &mut Loader) -> Result<Transformer> {
    let c = config;
    Transformer::build(config, ld, |ld, layer, path| {
        if !c.is_moe_layer(layer) {
            return Ok(FeedForward::Dense(qwen3::mlp(ld, path, c.hidden_size, c.intermediate_size)?));
        }
        let (e, dim, hidden) = (c.num_experts, c.hidden_size, c.moe_intermediate_size);
        let mut proj = |name: &str, inp: i32, out: i32| -> Result<SwitchLinear> {
            if ld.weights.contains(&format!("{path}.experts.0.{name}.weight")) {
                stack_experts(ld, path, name, e)?;
            }
            ld.switch_linear(&format!("{path}.switch_mlp.{name}"), e, inp, out)
        };
        let experts = SwitchGlu {
            gate_proj: proj("gate_proj", dim, hidden)?,
            up_proj: proj("up_proj", dim, hidden)?,
            down_proj: proj("down_proj", hidden, dim)?,
        };
        Ok(FeedForward::Moe(SparseMoe {
            gate: ld.linear(&format!("{path}.gate"), dim, e, false)?,
            experts,
            top_k: c.num_experts_per_tok,
            norm_topk_prob: c.norm_topk_prob,
        }))
    })
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
