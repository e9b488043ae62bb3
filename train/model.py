"""The embedded model in PyTorch: a Qwen3.5-style hybrid (Gated DeltaNet layers with one gated
full-attention layer every `full_attention_interval`) and its one-layer MTP head, computing
what Ferrite's engine (crates/engine/src/layers, models/mtp.rs) and mlx-lm compute, with
parameters named as in the MLX checkpoint so export is a rename-free save.

The delta rule runs in chunks of 64 positions (the WY form of delta_chunked.rs), which is
exact and trains fast; `delta_rule_steps` is the position-by-position reference.
"""
import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 8192
    hidden_size: int = 384
    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    intermediate_size: int = 1152
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1_000_000.0
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 48
    linear_value_head_dim: int = 48
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192

    def layer_types(self):
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)]

    def hf_config(self, eos_token_id: int) -> dict:
        """config.json as mlx-lm and Ferrite read a Qwen3.5 checkpoint."""
        text = {k: v for k, v in asdict(self).items() if k not in ("partial_rotary_factor", "rope_theta")}
        text.update({
            "model_type": "qwen3_5_text", "hidden_act": "silu", "attention_bias": False,
            "layer_types": self.layer_types(), "mtp_num_hidden_layers": 1, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
        })
        return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": text, "tie_word_embeddings": True, "eos_token_id": eos_token_id}


def rms_norm(x, weight, eps):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype) if weight is not None else y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope(x, dims, base, offset=0):
    """MLX's non-traditional RoPE on the first `dims` features: pairs (i, i + dims/2)."""
    t = x.shape[-2]
    half = dims // 2
    freqs = base ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / dims)
    pos = torch.arange(offset, offset + t, device=x.device, dtype=torch.float32)
    ang = pos[:, None] * freqs[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2, rest = x[..., :half].float(), x[..., half:dims].float(), x[..., dims:]
    r1 = x1 * cos - x2 * sin
    r2 = x1 * sin + x2 * cos
    return torch.cat([r1.to(x.dtype), r2.to(x.dtype), rest], -1)


class Mlp(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Gated full attention: q_proj yields queries and a per-channel output gate."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        h, hd = c.num_attention_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * h * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def forward(self, x):
        c = self.c
        b, t, _ = x.shape
        qg = self.q_proj(x).view(b, t, c.num_attention_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(b, t, -1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        dims = int(c.head_dim * c.partial_rotary_factor)
        q, k = rope(q, dims, c.rope_theta), rope(k, dims, c.rope_theta)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=c.head_dim ** -0.5)
        o = o.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(o * torch.sigmoid(gate))


CHUNK = 64


def delta_rule_chunked(q, k, v, log_g, beta):
    """q, k [B,T,H,Dk] (repeated to the value heads), v [B,T,H,Dv], log_g (log of the decay),
    beta [B,T,H]; zero initial state. Returns y [B,T,H,Dv] (f32). See delta_chunked.rs for
    the algebra. The decay comes in log space: a decay that underflows to 0 would make
    log(0) - log(0) a NaN."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    n = (t + CHUNK - 1) // CHUNK
    pad = n * CHUNK - t

    def chunks(x):
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad)) if pad else x.float()
        return x.transpose(1, 2).reshape(b, h, n, CHUNK, x.shape[-1])

    def per_pos(x, value):
        x = F.pad(x.float(), (0, 0, 0, pad), value=value) if pad else x.float()
        return x.transpose(1, 2).reshape(b, h, n, CHUNK)

    q, k, v = chunks(q), chunks(k), chunks(v)
    beta = per_pos(beta, 0.0)
    log_g = per_pos(log_g, 0.0)
    lc = log_g.cumsum(-1)
    diff = lc[..., :, None] - lc[..., None, :]
    incl = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril(-1)
    m_incl = torch.where(incl, diff, 0.0).exp() * incl
    m_strict = torch.where(strict, diff, 0.0).exp() * strict
    kt = k.transpose(-1, -2)
    L = beta[..., None] * m_strict * (k @ kt)
    eye = torch.eye(CHUNK, device=q.device)
    neg = -L
    inv = eye + neg
    power, span = neg, 2
    while span < CHUNK:
        power = power @ power
        inv = inv @ (eye + power)
        span *= 2
    gamma = lc.exp()
    w = inv @ (beta[..., None] * v)
    k_prime = inv @ ((beta * gamma)[..., None] * k)
    attn = m_incl * (q @ kt)
    last = lc[..., -1:]
    to_end = (last - lc).exp()
    gamma_c = last.exp()
    s = q.new_zeros(b, h, dv, dk)
    ys = []
    for ci in range(n):
        st = s.transpose(-1, -2)
        u = w[:, :, ci] - k_prime[:, :, ci] @ st
        ys.append(gamma[:, :, ci, :, None] * (q[:, :, ci] @ st) + attn[:, :, ci] @ u)
        s = gamma_c[:, :, ci, :, None] * s + (u * to_end[:, :, ci, :, None]).transpose(-1, -2) @ k[:, :, ci]
    y = torch.stack(ys, 2).reshape(b, h, n * CHUNK, dv)[:, :, :t]
    return y.transpose(1, 2)


def delta_rule_steps(q, k, v, log_g, beta):
    """The same rule position by position (the reference the chunked form is checked against)."""
    b, t, h, dk = q.shape
    g = log_g.exp()
    s = q.new_zeros(b, h, v.shape[-1], dk, dtype=torch.float32)
    ys = []
    for i in range(t):
        s = s * g[:, i, :, None, None]
        kv = (s * k[:, i, :, None, :]).sum(-1)
        delta = (v[:, i] - kv) * beta[:, i, :, None]
        s = s + k[:, i, :, None, :] * delta[..., None]
        ys.append((s * q[:, i, :, None, :]).sum(-1))
    return torch.stack(ys, 1)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.conv_dim = 2 * nk * dk + nv * dv
        self.in_proj_qkv = nn.Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, nv * dv, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, nv, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, nv, bias=False)
        # MLX layout: [channels, kernel, 1].
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, c.linear_conv_kernel_dim, 1).uniform_(-0.5, 0.5))
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.log(torch.empty(nv).uniform_(1, 16)))
        self.norm = RMSNorm(dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(nv * dv, c.hidden_size, bias=False)

    def forward(self, x, steps=False):
        c = self.c
        b, t, _ = x.shape
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(b, t, nv, dv)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        a = self.in_proj_a(x).float()
        kernel = c.linear_conv_kernel_dim
        w = self.conv1d.weight[:, :, 0].to(qkv.dtype)  # [C, K]
        conv = F.conv1d(F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), w[:, None, :], groups=self.conv_dim)
        conv = F.silu(conv.transpose(1, 2))
        q = conv[..., :nk * dk].reshape(b, t, nk, dk)
        k = conv[..., nk * dk:2 * nk * dk].reshape(b, t, nk, dk)
        v = conv[..., 2 * nk * dk:].reshape(b, t, nv, dv)
        inv = dk ** -0.5
        q = (inv * inv) * rms_norm(q, None, 1e-6 * inv * inv)
        k = inv * rms_norm(k, None, 1e-6 * inv * inv)
        log_g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())
        r = nv // nk
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        rule = delta_rule_steps if steps else delta_rule_chunked
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = rule(q.float(), k.float(), v.float(), log_g, beta)
        y = y.to(x.dtype)
        out = F.silu(z.float()) * self.norm(y).float()
        return self.out_proj(out.to(x.dtype).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config, kind: str):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)
        if kind == "full_attention":
            self.self_attn = Attention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)

    def forward(self, x, steps=False):
        mixer = self.self_attn if hasattr(self, "self_attn") else None
        h = self.input_layernorm(x)
        h = mixer(h) if mixer is not None else self.linear_attn(h, steps)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Trunk(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, kind) for kind in c.layer_types())
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LanguageModel(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.model = Trunk(c)


class Mtp(nn.Module):
    """h' = layer(fc([norm_e(embed(next token)), norm_h(h)])); logits = lm_head(norm(h'))."""

    def __init__(self, c: Config):
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(c, "full_attention")])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.config = c
        self.language_model = LanguageModel(c)
        self.mtp = Mtp(c)
        self.reset_parameters()

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc.weight") or "embed_tokens" in name:
                nn.init.normal_(p, 0.0, std)
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.num_hidden_layers))

    def hidden(self, ids, steps=False):
        """The trunk's final-normed hidden states (what Ferrite's `hidden` returns)."""
        m = self.language_model.model
        x = m.embed_tokens(ids)
        for layer in m.layers:
            x = layer(x, steps)
        return m.norm(x)

    def logits(self, h):
        return F.linear(h, self.language_model.model.embed_tokens.weight)

    def mtp_hidden(self, h, next_ids):
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.language_model.model.embed_tokens(next_ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(h)], -1))
        for layer in m.layers:
            x = layer(x)
        return x

    def mtp_logits(self, x):
        return self.logits(self.mtp.norm(x))

    def forward(self, ids, steps=False):
        """Trunk logits at every position, and the MTP head's logits for the token after next
        at positions 0..T-2 (fed each position's hidden state and the token that follows)."""
        h = self.hidden(ids, steps)
        return self.logits(h), self.mtp_logits(self.mtp_hidden(h[:, :-1], ids[:, 1:]))
