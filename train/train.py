#!/usr/bin/env python3
"""Trains Ferrite's embedded model (train/model.py) on the token ids train/corpus.py and
`ferrite dev tokenize` made: next-token loss on the trunk plus the MTP head's loss on the
token after next, jointly. Deterministic for a seed and a step count on one GPU.

Writes OUT/weights-*.safetensors (bf16, in shards small enough to travel), OUT/config.json,
OUT/train_log.json (losses, held-out perplexities, tokens seen, time) and
OUT/reference.safetensors (the training code's own logits on a held-out window, for the
export parity check).
"""
import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model import Config, Model

MTP_WEIGHT = 0.5


def batches(ids: np.ndarray, batch: int, seq: int, gen: torch.Generator):
    n = len(ids) - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen).tolist()
        yield torch.from_numpy(np.stack([ids[s:s + seq + 1].astype(np.int64) for s in starts]))


def losses(model, seqs):
    x = seqs[:, :-1]
    logits, mtp = model(x)
    v = logits.shape[-1]
    trunk = F.cross_entropy(logits.float().reshape(-1, v), seqs[:, 1:].reshape(-1))
    # MTP at position i predicts token i + 2.
    head = F.cross_entropy(mtp.float().reshape(-1, v), seqs[:, 2:].reshape(-1))
    return trunk, head


@torch.no_grad()
def evaluate(model, ids, seq, device, windows=64):
    model.eval()
    stride = max(1, (len(ids) - seq - 1) // windows)
    tot_t = tot_m = 0.0
    for w in range(windows):
        s = w * stride
        seqs = torch.from_numpy(ids[s:s + seq + 1].astype(np.int64))[None].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            t, m = losses(model, seqs)
        tot_t += t.item()
        tot_m += m.item()
    model.train()
    return math.exp(tot_t / windows), math.exp(tot_m / windows)


def save_weights(model, out: Path, shard_bytes=14 << 20, dtype=torch.float32):
    tensors = {k: v.detach().to(dtype).cpu().contiguous() for k, v in model.state_dict().items()}
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        if current and size + t.numel() * t.element_size() > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * t.element_size()
    shards.append(current)
    for i, shard in enumerate(shards):
        save_file(shard, str(out / f"weights-{i:02d}.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True, help="folder with train.bin, heldout.bin, tokenizer/")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)

    train_ids = np.fromfile(args.data / "train.bin", dtype=np.uint16)
    held_ids = np.fromfile(args.data / "heldout.bin", dtype=np.uint16)
    tok = json.loads((args.data / "tokenizer" / "tokenizer.json").read_text())
    vocab = max(max(tok["model"]["vocab"].values()), max(t["id"] for t in tok["added_tokens"])) + 1
    im_end = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    config = Config(vocab_size=vocab)
    model = Model(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters; {len(train_ids) / 1e6:.2f}M train tokens, {len(held_ids) / 1e3:.0f}k held out", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen)
    log = {"config": config.__dict__, "args": {k: str(v) for k, v in vars(args).items()}, "parameters": params,
           "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)), "evals": []}
    started = time.time()
    for step in range(args.steps):
        seqs = next(data).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            trunk, head = losses(model, seqs)
        loss = trunk + MTP_WEIGHT * head
        if not torch.isfinite(loss):
            raise SystemExit(f"step {step}: the loss is {loss.item()}; stopping rather than training on NaN")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"step {step} loss {trunk.item():.3f} mtp {head.item():.3f} {time.time() - started:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ppl, mtp_ppl = evaluate(model, held_ids, args.seq, device)
            log["evals"].append({"step": step + 1, "heldout_ppl": ppl, "heldout_mtp_ppl": mtp_ppl,
                                 "train_loss": trunk.item(), "seconds": time.time() - started})
            print(f"eval step {step + 1}: held-out perplexity {ppl:.2f}, MTP (token after next) {mtp_ppl:.2f}", flush=True)
    log["seconds"] = time.time() - started
    log["tokens_seen"] = args.steps * args.batch * args.seq

    model.eval()
    # The weights travel in bf16 (what the export quantizes); the reference logits are those
    # of exactly these rounded weights.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    save_weights(model, args.out, dtype=torch.bfloat16)
    (args.out / "config.json").write_text(json.dumps(config.hf_config(im_end), indent=2) + "\n")
    # Parity reference: the training code's logits on the first held-out window, in f32.
    ref = torch.from_numpy(held_ids[:64].astype(np.int64))[None].to(device)
    with torch.no_grad():
        logits, mtp = model.float()(ref)
    save_file({"ids": ref[0].int().cpu(), "logits": logits[0].float().cpu().contiguous(),
               "mtp_logits": mtp[0].float().cpu().contiguous()}, str(args.out / "reference.safetensors"))
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"done in {log['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
