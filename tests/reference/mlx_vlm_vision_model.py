"""A Qwen3.5 checkpoint that sees, run by mlx-vlm 0.7.10, for the parity test of Ferrite's
image prompts (crates/engine/tests/vision.rs). --dir holds a text-only Qwen3.5 checkpoint in
the Transformers layout (Ferrite's checkpoint maker writes it); this adds a vision tower with
random weights made by mlx-vlm (`model.visual.*`, into model.safetensors) and its config, then
loads the whole checkpoint with mlx-vlm's loader and writes to --out: `prefill.f32` (the
logits of every prompt position, [L, vocab]) and `step.f32` (the logits after one more
token, --next, [vocab]), little-endian f32; and `greedy.json`, the --greedy tokens greedy
decoding gives after the prompt."""
import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_vlm.models.qwen3_5.config import VisionConfig
from mlx_vlm.models.qwen3_5.vision import VisionModel
from mlx_vlm.utils import load_model


def add_tower(directory: Path, vision: dict, tokens: dict, seed: int, dtype=mx.float32):
    mx.random.seed(seed)
    tower = VisionModel(VisionConfig(**vision))
    params = []
    for name, value in tree_flatten(tower.parameters()):
        if "norm" in name:
            value = (1.0 if name.endswith("weight") else 0.0) + 0.2 * mx.random.normal(value.shape)
        params.append((name, value))
    tower.update(tree_unflatten(params))
    weights = mx.load(str(directory / "model.safetensors"))
    for name, value in tree_flatten(tower.parameters()):
        if name == "patch_embed.proj.weight":
            value = value.transpose(0, 4, 1, 2, 3)  # MLX's [H, T, P, P, C] to PyTorch's
        weights[f"model.visual.{name}"] = value.astype(dtype)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    config = json.loads((directory / "config.json").read_text())
    config["vision_config"] = dict(vision, model_type="qwen3_5")
    config.update(tokens)
    (directory / "config.json").write_text(json.dumps(config))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--vision", required=True, help="the vision_config, as JSON")
    ap.add_argument("--tokens", help="the prompt's token ids, as JSON")
    ap.add_argument("--image-token", type=int, required=True)
    ap.add_argument("--vision-start", type=int, required=True)
    ap.add_argument("--vision-end", type=int, required=True)
    ap.add_argument("--pixels", type=Path)
    ap.add_argument("--grids")
    ap.add_argument("--next", type=int)
    ap.add_argument("--greedy", type=int, default=8)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tower-only", action="store_true", help="only add the tower (a server test's model)")
    ap.add_argument("--tower-dtype", default="float32", help="the tower's weights' dtype")
    args = ap.parse_args()
    ids = {
        "image_token_id": args.image_token,
        "video_token_id": args.image_token + 1,
        "vision_start_token_id": args.vision_start,
        "vision_end_token_id": args.vision_end,
    }
    add_tower(args.dir, json.loads(args.vision), ids, seed=3, dtype=getattr(mx, args.tower_dtype))
    if args.tower_only:
        return

    model = load_model(args.dir)
    grids = json.loads(args.grids)
    rows = sum(t * h * w for t, h, w in grids)
    pixels = mx.array(np.fromfile(args.pixels, dtype="<f4").reshape(rows, -1))
    tokens = mx.array([json.loads(args.tokens)], dtype=mx.int32)
    cache = model.language_model.make_cache()
    out = model(tokens, pixels, cache=cache, image_grid_thw=mx.array(grids))
    logits = getattr(out, "logits", out)
    np.asarray(logits[0].astype(mx.float32)).astype("<f4").tofile(args.out / "prefill.f32")
    first = int(mx.argmax(logits[0, -1]).item())
    out = model.language_model(mx.array([[args.next]], dtype=mx.int32), cache=cache)
    logits = getattr(out, "logits", out)
    np.asarray(logits[0, -1].astype(mx.float32)).astype("<f4").tofile(args.out / "step.f32")

    # Greedy decoding from the prompt, on a fresh cache.
    cache = model.language_model.make_cache()
    out = model(tokens, pixels, cache=cache, image_grid_thw=mx.array(grids))
    token = int(mx.argmax(getattr(out, "logits", out)[0, -1]).item())
    assert token == first
    greedy = [token]
    while len(greedy) < args.greedy:
        out = model.language_model(mx.array([[token]], dtype=mx.int32), cache=cache)
        token = int(mx.argmax(getattr(out, "logits", out)[0, -1]).item())
        greedy.append(token)
    (args.out / "greedy.json").write_text(json.dumps(greedy))


if __name__ == "__main__":
    main()
