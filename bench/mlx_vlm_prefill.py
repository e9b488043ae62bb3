"""mlx-vlm 0.7.10 running a whole prompt with a picture, the peer of `ferrite dev vision-prefill`
(bench/vision_prefill.sh): loads the checkpoint in --dir with mlx-vlm's loader and runs its model
over --tokens (the image token already repeated for the picture) and --patches (Ferrite's
processor's, little-endian f32) on a fresh cache, --runs times after a warm-up, each until the
last position's logits are evaluated; prints one JSON line with the seconds of each and each
prompt's greedy first token (Ferrite's must be the same)."""
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_vlm.utils import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--patches", type=Path, required=True)
    ap.add_argument("--grid", required=True, help="T,H,W of the picture's patches")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    grid = [int(x) for x in args.grid.split(",")]
    model = load_model(args.dir)
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    rows = grid[0] * grid[1] * grid[2]
    pixels = mx.array(np.fromfile(args.patches, dtype="<f4").reshape(rows, -1)).astype(dtype)
    tokens = json.loads(args.tokens.read_text())
    seconds, first = [], []
    for run in range(args.runs + 1):
        ids = mx.array([[1 + run] + tokens[1:]], dtype=mx.int32)
        mx.eval(ids, pixels)
        started = time.perf_counter()
        cache = model.language_model.make_cache()
        out = model(ids, pixels, cache=cache, image_grid_thw=mx.array([grid]))
        logits = getattr(out, "logits", out)
        token = mx.argmax(logits[0, -1])
        mx.eval(token)
        first.append(int(token.item()))
        if run > 0:
            seconds.append(time.perf_counter() - started)
    print(json.dumps({"engine": "mlx-vlm", "grid": grid, "prompt_tokens": len(tokens), "first": first,
                      "seconds": seconds}))


if __name__ == "__main__":
    main()
