"""mlx-vlm 0.7.10's Qwen3.5 vision tower, the peer of `ferrite dev vision-tower` (bench/vision.sh).
  --make DIR: a tower of Qwen3-VL / Qwen3.5's shape (or --config) with random weights, saved as
    Qwen publishes it (config.json's vision_config, model.safetensors `model.visual.*`,
    preprocessor_config.json).
  --time DIR --patches FILE --grid T,H,W: mlx-vlm loads it and runs those patches --runs times
    after a warm-up; prints one JSON line with the seconds of each."""
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_vlm.models.qwen3_5.config import VisionConfig
from mlx_vlm.models.qwen3_5.vision import VisionModel

# Qwen3.5 / Qwen3-VL's tower (SigLIP-2 sized), before the text model's width.
QWEN3_5 = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
           "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 2048,
           "num_position_embeddings": 2304, "deepstack_visual_indexes": []}


def make(directory: Path, config: dict, dtype):
    directory.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    tower = VisionModel(VisionConfig(**config))
    tower.set_dtype(dtype)
    weights = {}
    for name, value in tree_flatten(tower.parameters()):
        if name == "patch_embed.proj.weight":
            value = value.transpose(0, 4, 1, 2, 3)
        weights[f"model.visual.{name}"] = value
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps({"vision_config": dict(config, model_type="qwen3_5")}))
    (directory / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))


def timed(directory: Path, patches: Path, grid, runs: int):
    config = json.loads((directory / "config.json").read_text())["vision_config"]
    config.pop("model_type", None)
    tower = VisionModel(VisionConfig(**config))
    weights = mx.load(str(directory / "model.safetensors"))
    weights = {k.removeprefix("model.visual."): v for k, v in weights.items()}
    tower.load_weights(list(tower.sanitize(weights).items()))
    mx.eval(tower.parameters())
    dtype = tower.patch_embed.proj.weight.dtype
    values = np.fromfile(patches, dtype="<f4")
    pixels = mx.array(values.reshape(grid[0] * grid[1] * grid[2], -1)).astype(dtype)
    seconds = []
    for run in range(runs + 1):
        started = time.perf_counter()
        out, _ = tower(pixels, mx.array([grid]))
        mx.eval(out)
        if run > 0:
            seconds.append(time.perf_counter() - started)
    print(json.dumps({"engine": "mlx-vlm", "grid": grid, "patches": int(pixels.shape[0]), "seconds": seconds}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make", type=Path)
    ap.add_argument("--config", help="a vision_config as JSON (default: Qwen3.5's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--time", type=Path)
    ap.add_argument("--patches", type=Path)
    ap.add_argument("--grid")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.make:
        make(args.make, json.loads(args.config) if args.config else QWEN3_5, getattr(mx, args.dtype))
    if args.time:
        timed(args.time, args.patches, [int(x) for x in args.grid.split(",")], args.runs)


if __name__ == "__main__":
    main()
