#!/usr/bin/env python3
"""Checks before training (run on the training machine): the chunked delta rule equals the
step-by-step one; a tiny random model is written with its own logits (so Ferrite can be
compared with this code before any GPU time goes into training); the real configuration's
time per training step."""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model import Config, Model, delta_rule_chunked, delta_rule_steps
from train import losses, save_weights
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    b, t, h, dk, dv = 2, 150, 4, 16, 8
    q = F.normalize(torch.randn(b, t, h, dk, device=dev), dim=-1)
    k = F.normalize(torch.randn(b, t, h, dk, device=dev), dim=-1)
    v = torch.randn(b, t, h, dv, device=dev)
    g = torch.rand(b, t, h, device=dev) * 0.95 + 0.05
    beta = torch.rand(b, t, h, device=dev)
    log_g = g.log()
    print("chunked vs steps, max |dy|:", (delta_rule_chunked(q, k, v, log_g, beta) - delta_rule_steps(q, k, v, log_g, beta)).abs().max().item(), flush=True)

    tiny = Config(vocab_size=512, hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                  head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    m = Model(tiny).to(dev)
    with torch.no_grad():
        # Norm weights away from 1 and A_log/dt_bias varied, so every parameter is exercised.
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        logits, mtp = m(ids)
        steps, _ = m(ids, steps=True)
    print("model chunked vs steps, max |dlogit|:", (logits - steps).abs().max().item(), flush=True)
    out = args.out / "tiny"
    out.mkdir(parents=True, exist_ok=True)
    save_weights(m, out)
    (out / "config.json").write_text(json.dumps(tiny.hf_config(2), indent=2))
    save_file({"ids": ids[0].int().cpu(), "logits": logits[0].cpu().contiguous(), "mtp_logits": mtp[0].cpu().contiguous()}, str(out / "reference.safetensors"))

    model = Model(Config()).to(dev)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    for i in range(13):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.time()
        seqs = torch.randint(0, 8192, (args.batch, args.seq + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a, c = losses(model, seqs)
        (a + 0.5 * c).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    print(f"{(time.time() - t0) / 10:.3f} s per step of {args.batch}x{args.seq}", flush=True)


if __name__ == "__main__":
    main()
