#!/usr/bin/env python3
"""Writes the target's own continuations of corpus text, for train/drafter.py's `--generated`.

At inference a drafter reads the target's hidden states over text the target wrote itself
(the prompt aside), and a greedy target's text is not the corpus' text: it repeats, settles
into its own habits, and is what the drafter must predict. So the drafter also trains on
rows made here: `--prompt` tokens from a random place in a corpus file (train.bin or
heldout.bin: u16 ids), then `--seq - --prompt` tokens the target chose (greedy by default,
as bench/acceptance.sh and `ferrite bench --spec` decode), batched, with mlx-lm's caches.

Output: `--rows` rows of `--seq` u16 ids, one after another (row r at r * seq), and a
`.json` beside it saying how they were made. Runs with MLX (third_party/venv); on this CPU
for a smoke run, on the GPU for the real one (bench/gpu/checks.sh drafter-train).
"""
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def continue_rows(model, prompts, new_tokens, temp, key):
    """prompts [N, P] -> [N, P + new_tokens]: each row continued by the target."""
    cache = make_prompt_cache(model)
    logits = model(prompts, cache=cache)[:, -1]
    chosen = []
    for i in range(new_tokens):
        if temp > 0:
            key, sub = mx.random.split(key)
            token = mx.random.categorical(logits.astype(mx.float32) / temp, key=sub)
        else:
            token = mx.argmax(logits, axis=-1)
        chosen.append(token)
        if i + 1 < new_tokens:
            logits = model(token[:, None], cache=cache)[:, -1]
        # Evaluating each step keeps the graph small; the steps are what the GPU runs anyway.
        mx.eval(token, logits)
    return mx.concatenate([prompts, mx.stack(chosen, axis=1)], axis=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("assets/models/ferrite-code-20m"))
    ap.add_argument("--source", type=Path, required=True, help="u16 ids the prompts are cut from")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=512, help="tokens a row: prompt and continuation")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32,
                    help="rows continued at once (on MLX 0.32.4's CUDA build, 96 and more stopped in a decode"
                         " step: cudaGraphAddKernelNode ... invalid argument)")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=0,
                    help="stop starting batches after this long (the first always runs) and write the rows made"
                         " (0: --rows, however long)")
    args = ap.parse_args()
    if not 0 < args.prompt < args.seq:
        ap.error("--prompt must be between 0 and --seq")

    model, _ = load(str(args.target))
    data = np.fromfile(args.source, dtype="<u2")
    if len(data) <= args.prompt:
        raise SystemExit(f"{args.source}: {len(data)} tokens, fewer than a prompt of {args.prompt}")
    rng = np.random.default_rng(args.seed)
    key = mx.random.key(args.seed)
    rows, made_rows, started = [], 0, time.time()
    while made_rows < args.rows and not (made_rows and args.seconds and time.time() - started > args.seconds):
        n = min(args.batch, args.rows - made_rows)
        starts = rng.integers(0, len(data) - args.prompt, size=n)
        prompts = mx.array(np.stack([data[s : s + args.prompt] for s in starts]).astype(np.int32))
        key, sub = mx.random.split(key)
        rows.append(np.array(continue_rows(model, prompts, args.seq - args.prompt, args.temp, sub)))
        made_rows += n
        print(f"{made_rows} rows ({time.time() - started:.0f} s)", flush=True)
    out = np.concatenate(rows).astype("<u2")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out.tofile(args.out)
    made = {"target": str(args.target), "source": str(args.source), "rows": len(out), "seq": args.seq,
            "prompt": args.prompt, "temp": args.temp, "seed": args.seed}
    args.out.with_suffix(".json").write_text(json.dumps(made, indent=2) + "\n")
    print(f"wrote {args.out}: {len(out)} rows of {args.seq} ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
