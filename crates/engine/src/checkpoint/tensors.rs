//! The tensors of a checkpoint: names, shapes and how each is initialised, in mlx-lm's
//! layout or in the Transformers layout Qwen publishes (hybrid models only).

use crate::architecture::Architecture;
use crate::config::ModelConfig;

/// Which naming and storage conventions to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// As mlx-lm's converter (and mlx-community) writes checkpoints.
    #[default]
    Mlx,
    /// As Qwen publishes hybrid models for Transformers: RMSNorm weights as offsets from 1,
    /// conv1d kernels [C, 1, K], unstacked (Qwen3-Next) or fused (Qwen3.5) experts, and the
    /// Qwen3.5 text model under `model.language_model`.
    Transformers,
}

/// What a tensor is, which decides its initialisation and whether it is quantized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// A projection [.., out, in]: N(0, 1/in).
    Matrix,
    /// Embedding table or output head: wide enough logits that greedy picks are clear.
    Table,
    /// MoE router or shared-expert gate: 8 bits when quantized, as mlx-lm's predicate says.
    Router,
    /// RMSNorm weight around 1.
    Norm,
    /// RMSNorm weight stored as an offset from 1 (Transformers layout of the hybrids).
    NormOffset,
    /// Depthwise conv kernel: N(0, 1/kernel); never quantized.
    Conv,
    /// Gated DeltaNet `dt_bias`: around 1.
    DtBias,
    /// Gated DeltaNet `A_log`: log of U(1, 16), kept in f32 as mlx-lm keeps it.
    ALog,
}

impl Kind {
    pub fn quantizable(self) -> bool {
        matches!(self, Kind::Matrix | Kind::Table | Kind::Router)
    }
}

pub struct TensorSpec {
    /// Module path; the tensor is `{name}.weight` (plus `.scales`/`.biases` when quantized)
    /// unless `raw`, when it is `name` itself.
    pub name: String,
    pub shape: Vec<i32>,
    pub kind: Kind,
    pub raw: bool,
}

pub fn tensor_specs(c: &ModelConfig, layout: Layout) -> Vec<TensorSpec> {
    let hf = layout == Layout::Transformers && c.is_hybrid();
    // Qwen3.5 nests its text model: Qwen writes `model.language_model.*` and `lm_head`,
    // mlx-lm `language_model.model.*` and `language_model.lm_head`.
    let nested = c.architecture.is_qwen3_5();
    let (root, head) = match (nested, hf) {
        (true, true) => ("model.language_model", "lm_head"),
        (true, false) => ("language_model.model", "language_model.lm_head"),
        _ => ("model", "lm_head"),
    };
    let norm = if hf { Kind::NormOffset } else { Kind::Norm };
    let h = c.hidden_size;
    let spec = |name: String, shape: &[i32], kind: Kind| TensorSpec { name, shape: shape.to_vec(), kind, raw: false };
    let mut t = vec![spec(format!("{root}.embed_tokens"), &[c.vocab_size, h], Kind::Table)];
    for i in 0..c.num_hidden_layers {
        layer_specs(c, &mut t, &format!("{root}.layers.{i}"), c.is_linear_layer(i), c.is_moe_layer(i), hf);
    }
    t.push(spec(format!("{root}.norm"), &[h], norm));
    if !c.tie_word_embeddings {
        t.push(spec(head.into(), &[c.vocab_size, h], Kind::Table));
    }
    let mtp_layers = c.num_nextn_predict_layers.or(c.mtp_num_hidden_layers).unwrap_or(0);
    if c.is_hybrid() && mtp_layers > 0 {
        t.push(spec("mtp.fc".into(), &[h, 2 * h], Kind::Matrix));
        for n in ["mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"] {
            t.push(spec(n.into(), &[h], norm));
        }
        for i in 0..mtp_layers {
            layer_specs(c, &mut t, &format!("mtp.layers.{i}"), false, c.num_experts > 0, hf);
        }
    }
    // Parameters that are tensors of their own, not modules with a `.weight`.
    for s in &mut t {
        if matches!(s.kind, Kind::DtBias | Kind::ALog)
            || s.name.contains(".experts.gate_up_proj")
            || s.name.contains(".experts.down_proj")
        {
            s.raw = true;
        }
    }
    t
}

/// The tensors of one decoder layer at path `p`.
pub(super) fn layer_specs(c: &ModelConfig, t: &mut Vec<TensorSpec>, p: &str, linear: bool, moe: bool, hf: bool) {
    let norm = if hf { Kind::NormOffset } else { Kind::Norm };
    let (h, hd) = (c.hidden_size, c.head_dim());
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let mut add =
        |name: String, shape: &[i32], kind: Kind| t.push(TensorSpec { name, shape: shape.to_vec(), kind, raw: false });
    add(format!("{p}.input_layernorm"), &[h], norm);
    add(format!("{p}.post_attention_layernorm"), &[h], norm);
    if linear {
        let a = format!("{p}.linear_attn");
        let (nk, nv, dk, dv) =
            (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd) = (nk * dk, nv * dv);
        if c.architecture == Architecture::Qwen3Next {
            add(format!("{a}.in_proj_qkvz"), &[2 * kd + 2 * vd, h], Kind::Matrix);
            add(format!("{a}.in_proj_ba"), &[2 * nv, h], Kind::Matrix);
        } else {
            add(format!("{a}.in_proj_qkv"), &[2 * kd + vd, h], Kind::Matrix);
            add(format!("{a}.in_proj_z"), &[vd, h], Kind::Matrix);
            add(format!("{a}.in_proj_b"), &[nv, h], Kind::Matrix);
            add(format!("{a}.in_proj_a"), &[nv, h], Kind::Matrix);
        }
        let (ch, k) = (2 * kd + vd, c.linear_conv_kernel_dim);
        let conv_shape = if hf { [ch, 1, k] } else { [ch, k, 1] };
        add(format!("{a}.conv1d"), &conv_shape, Kind::Conv);
        add(format!("{a}.norm"), &[dv], Kind::Norm);
        add(format!("{a}.out_proj"), &[h, vd], Kind::Matrix);
        add(format!("{a}.dt_bias"), &[nv], Kind::DtBias);
        add(format!("{a}.A_log"), &[nv], Kind::ALog);
    } else {
        let a = format!("{p}.self_attn");
        let q_width = nq * hd * if c.is_hybrid() { 2 } else { 1 };
        add(format!("{a}.q_proj"), &[q_width, h], Kind::Matrix);
        add(format!("{a}.k_proj"), &[nkv * hd, h], Kind::Matrix);
        add(format!("{a}.v_proj"), &[nkv * hd, h], Kind::Matrix);
        add(format!("{a}.o_proj"), &[h, nq * hd], Kind::Matrix);
        add(format!("{a}.q_norm"), &[hd], norm);
        add(format!("{a}.k_norm"), &[hd], norm);
    }
    let m = format!("{p}.mlp");
    if moe {
        let (e, mi) = (c.num_experts, c.moe_intermediate_size);
        add(format!("{m}.gate"), &[e, h], Kind::Router);
        match (hf, c.architecture) {
            (true, Architecture::Qwen3Next) => {
                for x in 0..e {
                    add(format!("{m}.experts.{x}.gate_proj"), &[mi, h], Kind::Matrix);
                    add(format!("{m}.experts.{x}.up_proj"), &[mi, h], Kind::Matrix);
                    add(format!("{m}.experts.{x}.down_proj"), &[h, mi], Kind::Matrix);
                }
            }
            (true, _) => {
                add(format!("{m}.experts.gate_up_proj"), &[e, 2 * mi, h], Kind::Matrix);
                add(format!("{m}.experts.down_proj"), &[e, h, mi], Kind::Matrix);
            }
            (false, _) => {
                add(format!("{m}.switch_mlp.gate_proj"), &[e, mi, h], Kind::Matrix);
                add(format!("{m}.switch_mlp.up_proj"), &[e, mi, h], Kind::Matrix);
                add(format!("{m}.switch_mlp.down_proj"), &[e, h, mi], Kind::Matrix);
            }
        }
        let si = c.shared_expert_intermediate_size;
        if si > 0 {
            add(format!("{m}.shared_expert.gate_proj"), &[si, h], Kind::Matrix);
            add(format!("{m}.shared_expert.up_proj"), &[si, h], Kind::Matrix);
            add(format!("{m}.shared_expert.down_proj"), &[h, si], Kind::Matrix);
            add(format!("{m}.shared_expert_gate"), &[1, h], Kind::Router);
        }
    } else {
        let inter = c.intermediate_size;
        add(format!("{m}.gate_proj"), &[inter, h], Kind::Matrix);
        add(format!("{m}.up_proj"), &[inter, h], Kind::Matrix);
        add(format!("{m}.down_proj"), &[h, inter], Kind::Matrix);
    }
}
