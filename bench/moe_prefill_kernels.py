"""How long one MoE layer's expert matmuls take for a prompt chunk, three ways, on the
default device: the gathered quantized matmul (what mlx-lm and Ferrite run), the same
after dequantizing every expert's weights once (a gathered bf16 matmul), and the dequantize
alone. Shapes default to the 35B-A3B hybrid (2048 tokens x top-8 of 256 experts, hidden
2048, expert width 512, 4-bit g64). Prints JSON.
"""

import argparse
import json
import time

import mlx.core as mx


def timed(f, reps):
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(f())
    return (time.perf_counter() - start) / reps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", help="activations and scales (CPU: float32)")
    a = p.parse_args()
    mx.random.seed(0)
    e, h, w = a.experts, a.hidden, a.width
    dt = getattr(mx, a.dtype)
    gate_up = mx.random.normal((e, 2 * w, h)).astype(dt)
    down = mx.random.normal((e, h, w)).astype(dt)
    qgu = mx.quantize(gate_up, 64, 4)
    qd = mx.quantize(down, 64, 4)
    del gate_up, down
    n = a.tokens * a.top_k
    idx = mx.sort(mx.random.randint(0, e, (n,)).astype(mx.uint32))
    x = mx.random.normal((n, 1, h)).astype(dt)
    mx.eval(qgu, qd, idx, x)

    def quantized():
        y = mx.gather_qmm(x, *qgu, rhs_indices=idx, transpose=True, group_size=64, bits=4, sorted_indices=True)
        g, u = mx.split(y, 2, axis=-1)
        return mx.gather_qmm(g * mx.sigmoid(g) * u, *qd, rhs_indices=idx, transpose=True, group_size=64, bits=4, sorted_indices=True)

    def dequantized():
        wgu = mx.dequantize(*qgu, group_size=64, bits=4)
        wd = mx.dequantize(*qd, group_size=64, bits=4)
        y = mx.gather_mm(x, wgu.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)
        g, u = mx.split(y, 2, axis=-1)
        return mx.gather_mm(g * mx.sigmoid(g) * u, wd.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)

    def dequantize_only():
        return [mx.dequantize(*qgu, group_size=64, bits=4), mx.dequantize(*qd, group_size=64, bits=4)]

    ref, alt = quantized(), dequantized()
    diff = mx.abs(ref.astype(mx.float32) - alt.astype(mx.float32)).max().item()
    scale = mx.abs(ref.astype(mx.float32)).max().item()
    print(json.dumps({
        "device": str(mx.default_device()), "tokens": a.tokens, "pairs": n,
        "gather_qmm_ms": timed(quantized, a.reps),
        "dequantize_then_gather_mm_ms": timed(dequantized, a.reps),
        "dequantize_only_ms": timed(dequantize_only, a.reps),
        "max_abs_diff": diff, "max_abs": scale,
    }))


if __name__ == "__main__":
    main()
