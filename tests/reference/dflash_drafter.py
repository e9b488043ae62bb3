"""The block logits train/drafter.py's drafter computes, for the parity test of Ferrite's
block drafter (crates/engine/tests/block_draft.rs): the target's taps over the prompt (run by
mlx-lm), the positions before the anchor as context, the block anchored at `--anchor`.
Writes `logits` [block - 1, vocab] (f32) to --out."""
import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "train"))
from drafter import Drafter, target_pass, text_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--anchor", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, _ = load(args.target)
    inner, head = text_model(model)
    c = json.loads((args.drafter / "config.json").read_text())
    d = c["dflash_config"]
    taps, b, mask_token = d["target_layer_ids"], c["block_size"], d["mask_token_id"]
    drafter = Drafter(c["hidden_size"], len(taps), c["num_hidden_layers"], c["num_attention_heads"],
                      c["num_key_value_heads"], c["head_dim"], c["intermediate_size"], c["rms_norm_eps"],
                      c["rope_theta"])
    drafter.load_weights(str(args.drafter / "model.safetensors"))
    ids = [int(t) for t in args.prompt_ids.split(",")]
    a = args.anchor
    tapped, _ = target_pass(inner, head, mx.array([ids]), taps)
    x = inner.embed_tokens(mx.array([[ids[a]] + [mask_token] * (b - 1)]))
    ctx_pos = mx.arange(a)[None]
    blk_pos = (a + mx.arange(b))[None]
    keep = mx.ones((1, 1, b, a + b), dtype=mx.bool_)
    out = drafter(tapped[:, :a], x, ctx_pos, blk_pos, keep)
    logits = head(out[:, 1:]).astype(mx.float32)[0]
    mx.save_safetensors(args.out, {"logits": logits})


if __name__ == "__main__":
    main()
