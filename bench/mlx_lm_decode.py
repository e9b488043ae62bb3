"""The peer side of bench/decode.sh: mlx-lm's own generation loop (generate_step, greedy)
on the same checkpoint and prompt ids as `ferrite bench`, timed the same way, as JSON.

Decode tok/s = (tokens - 1) / (time from the first token to the last); prompt tok/s = prompt
tokens / time to the first token. One warm-up run, then the median of --runs.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def one_run(model, prompt, n):
    start = time.perf_counter()
    first = last = None
    count = 0
    for count, (token, _) in enumerate(generate_step(prompt, model, max_tokens=n), start=1):
        last = time.perf_counter()
        if first is None:
            first = last
    assert count == n, f"generated {count} tokens, wanted {n}"
    return (n - 1) / (last - first), len(prompt) / (first - start), first - start


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mac-like", action="store_true",
                   help="run hybrids' recurrence on mlx-lm's Metal kernel ported to CUDA (bench/mlx_lm_mac_like.py), as on a Mac")
    a = p.parse_args()
    engine = "mlx-lm"
    if a.mac_like:
        import mlx_lm_mac_like

        if not mlx_lm_mac_like.install():
            raise SystemExit("--mac-like needs a CUDA GPU")
        mlx_lm_mac_like.check()
        engine = "mlx-lm-mac-like"

    model, _ = load_model(Path(a.model), strict=False)
    prompt = mx.array(json.loads(Path(a.prompt_ids).read_text()), dtype=mx.uint32)
    runs = [one_run(model, prompt, a.gen_tokens) for _ in range(a.runs + 1)][1:]
    print(json.dumps({
        "engine": engine,
        "backend": str(mx.default_device()),
        "prompt_tokens": len(prompt),
        "gen_tokens": a.gen_tokens,
        "decode_tps": statistics.median(r[0] for r in runs),
        "prompt_tps": statistics.median(r[1] for r in runs),
        "ttft_s": statistics.median(r[2] for r in runs),
        "peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
