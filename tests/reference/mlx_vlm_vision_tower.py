"""A Qwen3.5 vision tower with random weights, made and run by mlx-vlm 0.7.10, for the parity
test of Ferrite's tower (crates/engine/tests/vision.rs). Writes to --out: `config.json` (its
`vision_config`), `model.safetensors` (the tower as Qwen publishes it: `model.visual.*`, the
patch convolution in PyTorch's layout) and `features.f32` (the tower's output for the patches
of --pixels, little-endian f32, in the grids of --grids)."""
import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_vlm.models.qwen3_5.config import VisionConfig
from mlx_vlm.models.qwen3_5.vision import VisionModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="the vision_config, as JSON")
    ap.add_argument("--pixels", type=Path, required=True)
    ap.add_argument("--grids", required=True, help="[[t, h, w], ...] as JSON")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = json.loads(args.config)
    mx.random.seed(args.seed)
    model = VisionModel(VisionConfig(**config))
    # LayerNorms away from their identity start, so that a wrong one shows.
    params = []
    for name, value in tree_flatten(model.parameters()):
        if "norm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            value = base + 0.2 * mx.random.normal(value.shape)
        params.append((name, value))
    model.update(tree_unflatten(params))
    dtype = getattr(mx, args.dtype)
    model.set_dtype(dtype)
    mx.eval(model.parameters())

    grids = json.loads(args.grids)
    rows = sum(t * h * w for t, h, w in grids)
    pixels = mx.array(np.fromfile(args.pixels, dtype="<f4").reshape(rows, -1)).astype(dtype)
    features, _ = model(pixels, mx.array(grids))
    np.asarray(features.astype(mx.float32)).astype("<f4").tofile(args.out / "features.f32")

    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name == "patch_embed.proj.weight":
            value = value.transpose(0, 4, 1, 2, 3)  # MLX's [H, T, P, P, C] to PyTorch's [H, C, T, P, P]
        weights[f"model.visual.{name}"] = value
    mx.save_safetensors(str(args.out / "model.safetensors"), weights)
    (args.out / "config.json").write_text(json.dumps({"vision_config": config}))


if __name__ == "__main__":
    main()
