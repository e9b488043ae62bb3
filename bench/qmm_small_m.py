"""How MLX's quantized matmul scales with the rows it multiplies (a verify pass multiplies
its d + 1 positions at once; a plain step one): seconds per call for M = 1..16 rows against
the same weights, 4-bit (group 64) and bf16, the dense 8B shape's projections. One JSON line
per shape, dtype and M.
    python3 bench/qmm_small_m.py [--rounds 50]
"""
import argparse
import json
import time

import mlx.core as mx


def timed(fn, rounds):
    for _ in range(3):
        mx.eval(fn())
    began = time.perf_counter()
    for _ in range(rounds):
        mx.eval(fn())
    return (time.perf_counter() - began) / rounds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args()
    mx.random.seed(0)
    for out_dim, in_dim in [(12288, 4096), (4096, 12288)]:
        w = (mx.random.normal((out_dim, in_dim)) * 0.02).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, wq, scales, biases)
        for m in [1, 2, 3, 4, 5, 8, 12, 16, 32]:
            x = mx.random.normal((1, m, in_dim)).astype(mx.bfloat16)
            mx.eval(x)
            q = timed(lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4), args.rounds)
            d = timed(lambda: x @ w.T, args.rounds)
            print(json.dumps({"shape": [out_dim, in_dim], "m": m, "q4_ms": q * 1e3, "bf16_ms": d * 1e3,
                              "device": str(mx.default_device()), "mlx": mx.__version__}), flush=True)


if __name__ == "__main__":
    main()
