#!/usr/bin/env python3
"""Writes the MLX checkpoint of a trained model (train/train.py's OUT folder): every matrix
whose rows split into groups of 64 quantized by MLX itself (affine, --bits, group 64, f32
scales and biases), norms, the conv kernel and the decay parameters kept in f32; the
tokenizer and its chat template; config.json with the quantization block; and a trimmed copy
of the training code's reference logits for the parity test. Runs with MLX (third_party/venv).
"""
import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx

GROUP = 64
KEEP = ("norm.weight", "layernorm.weight", "conv1d.weight", "A_log", "dt_bias")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trained", type=Path, required=True, help="train.py's output folder")
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", type=int, default=8, help="0 keeps f32 weights")
    ap.add_argument("--reference-positions", type=int, default=32)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    weights = {}
    for f in sorted(args.trained.glob("weights-*.safetensors")):
        weights.update(mx.load(str(f)))
    out = {}
    for name, w in sorted(weights.items()):
        w = w.astype(mx.float32)
        quantize = args.bits > 0 and name.endswith(".weight") and w.ndim == 2 and not name.endswith(KEEP) and w.shape[-1] % GROUP == 0
        if quantize:
            base = name[: -len(".weight")]
            wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=args.bits)
            out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = wq, scales, biases
        else:
            out[name] = w
    mx.save_safetensors(str(args.out / "model.safetensors"), out, metadata={"format": "mlx"})

    config = json.loads((args.trained / "config.json").read_text())
    config["torch_dtype"] = "float32"
    if args.bits > 0:
        quant = {"group_size": GROUP, "bits": args.bits, "mode": "affine"}
        config["quantization"] = quant
        config["quantization_config"] = quant
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = config["eos_token_id"]
    tok = json.loads((args.tokenizer / "tokenizer.json").read_text())
    endoftext = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
    (args.out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, endoftext], "do_sample": False}) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.tokenizer / f, args.out / f)

    ref = mx.load(str(args.trained / "reference.safetensors"))
    n = args.reference_positions
    mx.save_safetensors(str(args.out.parent / f"{args.out.name}.reference.safetensors"),
                        {"ids": ref["ids"][:n], "logits": ref["logits"][:n], "mtp_logits": ref["mtp_logits"][: n - 1]})
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out}: {len(out)} tensors, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
