"""The peer side of bench/distributed.sh: mlx-lm's own tensor-parallel generation (its
`sharded_load`, which calls the model's `shard()`: qwen3 and qwen3_moe in mlx-lm 0.32) on the
same checkpoint and prompt text, run under mlx.launch, timed as bench/mlx_lm_decode.py times:

    mlx.launch --backend ring -n 2 bench/mlx_lm_sharded.py --model DIR --prompt-file F

Each rank prints one JSON line (rank 0's timings are the run's); memory is what the rank holds
after loading its part (MLX active memory).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import sharded_load

from mlx_lm_decode import one_run  # the same timing as bench/decode.sh's peer


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=1)
    a = p.parse_args()

    group = mx.distributed.init()
    model, tokenizer = sharded_load(a.model, tensor_group=group)
    held = mx.get_active_memory()
    prompt = mx.array(tokenizer.encode(Path(a.prompt_file).read_text()), dtype=mx.uint32)
    runs = [one_run(model, prompt, a.gen_tokens) for _ in range(a.runs + 1)][1:]
    print(json.dumps({
        "engine": "mlx-lm",
        "rank": group.rank(),
        "ranks": group.size(),
        "prompt_tokens": len(prompt),
        "tokens": a.gen_tokens,
        "decode_tps": statistics.median(r[0] for r in runs),
        "ttft_ms": 1e3 * statistics.median(r[2] for r in runs),
        "held_mb": held / 1e6,
    }), flush=True)


if __name__ == "__main__":
    main()
