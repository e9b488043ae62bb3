"""Greedy tokens from mlx-lm's own generation loop with its repetition, presence and frequency
penalties (its logits processors, default 20-token context), for Ferrite's penalty tests.

    python mlx_lm_penalties.py --model DIR --prompt-ids 1,2,3 --steps 24 \
        --repetition 1.3 --presence 0.5 --frequency 0.25     # prints the ids, comma-separated
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repetition", type=float, default=None)
    p.add_argument("--presence", type=float, default=None)
    p.add_argument("--frequency", type=float, default=None)
    a = p.parse_args()

    model, _ = load_model(Path(a.model), strict=False)
    processors = make_logits_processors(
        repetition_penalty=a.repetition, presence_penalty=a.presence, frequency_penalty=a.frequency
    )
    prompt = mx.array([int(t) for t in a.prompt_ids.split(",")], dtype=mx.uint32)
    greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)
    tokens = [t for t, _ in generate_step(prompt, model, max_tokens=a.steps, sampler=greedy, logits_processors=processors)]
    print(",".join(str(t) for t in tokens))


if __name__ == "__main__":
    main()
