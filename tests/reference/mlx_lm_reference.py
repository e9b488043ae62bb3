"""Runs mlx-lm (the reference implementation) on a checkpoint and writes what Ferrite's
reference tests compare against: the logits of every prompt position and a greedy
continuation with the logits of each of its steps.

    python mlx_lm_reference.py --model DIR --prompt-ids 1,2,3 --steps 32 --out ref.safetensors [--dequantize]

--dequantize runs the model as mlx-lm's own `dequantize_model` leaves it, in float32: the form
Ferrite's CPU backend loads small quantized models in.
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model, load_model


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", required=True)
    p.add_argument("--dequantize", action="store_true")
    a = p.parse_args()

    # strict=False: checkpoints that carry an MTP head keep mtp.* tensors mlx-lm does not use.
    model, _ = load_model(Path(a.model), strict=False)
    if a.dequantize:
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
    cache = make_prompt_cache(model)
    prompt = mx.array([[int(t) for t in a.prompt_ids.split(",")]])

    logits = model(prompt, cache=cache)
    prompt_logits = logits.astype(mx.float32)
    tokens, step_logits = [], []
    y = mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(a.steps):
        tokens.append(y.item())
        logits = model(y[:, None], cache=cache)
        step_logits.append(logits[0, -1].astype(mx.float32))
        y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.save_safetensors(
        a.out,
        {
            "prompt_logits": prompt_logits[0],
            "step_logits": mx.stack(step_logits),
            "tokens": mx.array(tokens, dtype=mx.int32),
        },
    )


if __name__ == "__main__":
    main()
