//! What Qwen3-Next and Qwen3.5 share: Gated DeltaNet layers between gated full-attention
//! layers, MoE with a shared expert, and the fix-ups that read Transformers-layout
//! checkpoints (as Qwen publishes them) as well as mlx-community's converted ones.

use mlx_rs::Array;

use super::qwen3;
use super::transformer::{attention, Transformer};
use super::MtpHead;
use crate::config::{ModelConfig, Quantization};
use crate::error::Result;
use crate::layers::gated_delta::fused_input_rows;
use crate::layers::moe::SharedExpert;
use crate::layers::parallel::Split;
use crate::layers::{DecoderLayer, FeedForward, GatedDeltaNet, JoinGroup, Loader, Mixer, SparseMoe};
use crate::weights::Weights;

/// How a hybrid checkpoint packs its Gated DeltaNet input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputLayout {
    Fused,
    Split,
}

pub fn build(c: &ModelConfig, ld: &mut Loader, layout: InputLayout) -> Result<Transformer> {
    let mut model = Transformer::build(
        c,
        ld,
        |ld, i, p| {
            Ok(if c.is_linear_layer(i) {
                Mixer::Linear(gated_delta(c, ld, &format!("{p}.linear_attn"), layout)?)
            } else {
                Mixer::Attention(attention(c, ld, p, true)?)
            })
        },
        |ld, i, p| feed_forward(c, ld, i, &format!("{p}.mlp")),
    )?;
    // The MTP head's layers are gated full-attention layers with the trunk's feed-forward kind.
    let moe_layer = (0..c.num_hidden_layers).find(|&i| c.is_moe_layer(i)).unwrap_or(-1);
    model.mtp = MtpHead::load(c, ld, |ld, p| {
        Ok(DecoderLayer {
            input_layernorm: ld.rms_norm(&format!("{p}.input_layernorm"), c.hidden_size, c.rms_norm_eps)?,
            mixer: Mixer::Attention(attention(c, ld, p, true)?),
            post_attention_layernorm: ld.rms_norm(
                &format!("{p}.post_attention_layernorm"),
                c.hidden_size,
                c.rms_norm_eps,
            )?,
            mlp: feed_forward(c, ld, moe_layer.max(0), &format!("{p}.mlp"))?,
            sum: ld.all_sum(),
        })
    })?;
    match &model.mtp {
        Some(_) => tracing::info!("MTP head loaded ({} layer(s)): speculative decoding available", MtpHead::depth(c)),
        None => tracing::info!("no MTP head (no mtp.* tensors): plain decoding only"),
    }
    Ok(model)
}

fn gated_delta(c: &ModelConfig, ld: &mut Loader, p: &str, layout: InputLayout) -> Result<GatedDeltaNet> {
    let (h, nk, nv) = (c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv, kernel) = (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim);
    let (key_dim, value_dim) = (nk * dk, nv * dv);
    let channels = 2 * key_dim + value_dim;
    // Split across ranks, each holds a contiguous part of the key heads and the value heads
    // that read them, with their conv channels, gates and recurrent state.
    let (k0, nk_here) = ld.part(nk, "linear-attention key heads")?;
    let (v0, nv_here) = ld.part(nv, "linear-attention value heads")?;
    let units = |offset: i32, first: i32, count: i32, width: i32| Split::unit_rows(offset, first, count, width);
    // Channels (q, k, v) in the conv's order.
    let qkv_rows =
        || [units(0, k0, nk_here, dk), units(key_dim, k0, nk_here, dk), units(2 * key_dim, v0, nv_here, dv)].concat();
    let inputs = match layout {
        InputLayout::Fused => {
            // Each key head's block: [q, k, its value heads' v, their z] and [b, a].
            let r = nv / nk;
            let qkvz_split = ld.split(|| Split::Rows(units(0, k0, nk_here, 2 * dk + 2 * r * dv)));
            let ba_split = ld.split(|| Split::Rows(units(0, k0, nk_here, 2 * r)));
            let qkvz =
                ld.linear_split(&format!("{p}.in_proj_qkvz"), h, 2 * key_dim + 2 * value_dim, false, qkvz_split)?;
            let ba = ld.linear_split(&format!("{p}.in_proj_ba"), h, 2 * nv, false, ba_split)?;
            let ([qkv, z], [b, a]) = fused_input_rows(nk_here, nv_here, dk, dv);
            vec![qkvz.take_rows(&qkv)?, qkvz.take_rows(&z)?, ba.take_rows(&b)?, ba.take_rows(&a)?]
        }
        InputLayout::Split => {
            let value_rows = |width: i32| ld.split(|| Split::Rows(units(0, v0, nv_here, width)));
            let (z_rows, gate_rows) = (value_rows(dv), value_rows(1));
            vec![
                ld.linear_split(&format!("{p}.in_proj_qkv"), h, channels, false, ld.split(|| Split::Rows(qkv_rows())))?,
                ld.linear_split(&format!("{p}.in_proj_z"), h, value_dim, false, z_rows)?,
                ld.linear_split(&format!("{p}.in_proj_b"), h, nv, false, gate_rows.clone())?,
                ld.linear_split(&format!("{p}.in_proj_a"), h, nv, false, gate_rows)?,
            ]
        }
    };
    let inputs = ld.projections(JoinGroup::Other, inputs)?;
    let split = ld.shard.is_some();
    let channel_rows = split.then(qkv_rows);
    let head_rows = split.then(|| units(0, v0, nv_here, 1));
    Ok(GatedDeltaNet {
        inputs,
        conv_weight: ld.tensor_rows(&format!("{p}.conv1d.weight"), &[channels, kernel, 1], channel_rows.as_deref())?,
        dt_bias: ld.tensor_rows(&format!("{p}.dt_bias"), &[nv], head_rows.as_deref())?,
        a_log: ld.tensor_rows(&format!("{p}.A_log"), &[nv], head_rows.as_deref())?,
        norm: ld.rms_norm(&format!("{p}.norm"), dv, c.rms_norm_eps)?,
        out_proj: ld.linear_split(
            &format!("{p}.out_proj"),
            value_dim,
            h,
            false,
            ld.split(|| Split::Columns { start: v0 * dv, count: nv_here * dv }),
        )?,
        num_k_heads: nk_here,
        num_v_heads: nv_here,
        head_k_dim: dk,
        head_v_dim: dv,
        kernel,
    })
}

fn feed_forward(c: &ModelConfig, ld: &mut Loader, i: i32, p: &str) -> Result<FeedForward> {
    let h = c.hidden_size;
    if !c.is_moe_layer(i) {
        return Ok(FeedForward::Dense(qwen3::mlp(ld, p, h, c.intermediate_size)?));
    }
    let (e, mi) = (c.num_experts, c.moe_intermediate_size);
    super::qwen3_moe::stack_expert_layouts(ld, p, e)?;
    let experts = super::qwen3_moe::switch_glu(ld, p, e, h, mi)?;
    let mut experts = experts;
    let router = ld.linear(&format!("{p}.gate"), h, e, false)?;
    let (router, shared) = if c.shared_expert_intermediate_size > 0 {
        let shared_gate = ld.linear(&format!("{p}.shared_expert_gate"), h, 1, false)?;
        let mlp = qwen3::mlp(ld, &format!("{p}.shared_expert"), h, c.shared_expert_intermediate_size)?;
        (vec![router, shared_gate], Some(SharedExpert::take_in_shared(&mut experts, mlp)?))
    } else {
        (vec![router], None)
    };
    Ok(FeedForward::Moe(Box::new(SparseMoe {
        router: ld.projections(JoinGroup::Other, router)?,
        experts,
        top_k: c.num_experts_per_tok,
        norm_topk_prob: c.norm_topk_prob(),
        shared,
    })))
}

/// Where Qwen (`model.language_model`) and mlx-lm (`language_model.model`) put Qwen3.5's
/// text model, mapped to the names the trunk uses.
const PREFIXES: [(&str, &str); 3] =
    [("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")];

/// Reads both published layouts as one. Qwen3.5 nests the text model (`model.language_model.*`
/// from Qwen, `language_model.model.*` from mlx-lm) beside a vision tower that is dropped.
/// Transformers-layout checkpoints (conv1d weights [C, 1, K]) store RMSNorm weights as
/// offsets from 1 and the conv kernel last; mlx-lm's converter rewrites both, and so does this.
pub fn normalize_layout(weights: &mut Weights, quant: Option<&mut Quantization>) -> Result<()> {
    for (from, to) in PREFIXES {
        weights.rename_prefix(from, to);
    }
    // Per-layer quantization overrides name modules by their path in the checkpoint.
    if let Some(q) = quant {
        q.overrides = std::mem::take(&mut q.overrides)
            .into_iter()
            .map(|(k, v)| {
                let k = PREFIXES
                    .iter()
                    .find_map(|(from, to)| k.strip_prefix(from).map(|r| format!("{to}{r}")))
                    .unwrap_or(k);
                (k, v)
            })
            .collect();
    }
    let vision = weights.drop_prefix("model.visual.") + weights.drop_prefix("vision_tower.");
    if vision > 0 {
        tracing::debug!("{}: {vision} vision-tower tensors left to the vision tower", weights.dir().display());
    }
    let names = weights.names();
    let mut transformers_layout = false;
    for name in names.iter().filter(|n| n.ends_with("conv1d.weight")) {
        let mut moved = false;
        weights.update(name, |w| {
            moved = w.dim(-1) != 1;
            Ok(if moved { w.swap_axes(1, 2)? } else { w.clone() })
        })?;
        transformers_layout |= moved;
    }
    if transformers_layout {
        const NORMS: [&str; 5] = [
            ".input_layernorm.weight",
            ".post_attention_layernorm.weight",
            "model.norm.weight",
            ".q_norm.weight",
            ".k_norm.weight",
        ];
        const MTP_NORMS: [&str; 3] =
            ["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"];
        for name in names.iter().filter(|n| NORMS.iter().any(|s| n.ends_with(s)) || MTP_NORMS.contains(&n.as_str())) {
            weights.update(name, |w| {
                Ok(if w.ndim() == 1 { w.add(Array::from_f32(1.0).as_dtype(w.dtype())?)? } else { w.clone() })
            })?;
        }
    }
    Ok(())
}
