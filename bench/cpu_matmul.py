"""One matmul through MLX on the CPU in three weight forms: f32 (BLAS), bf16 (MLX's own
kernel) and 8-bit quantized (MLX's own kernel, group size 64), at prefill sizes and one row,
in GFLOP/s (best of 5 after a warm-up). Run it with the venv's stock wheel and again with
OpenBLAS preloaded to see what the BLAS and its kernels change:

    third_party/venv/bin/python bench/cpu_matmul.py
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        OPENBLAS_CORETYPE=Prescott|SkylakeX third_party/venv/bin/python bench/cpu_matmul.py
"""

import time

import mlx.core as mx

SHAPES = [(2048, 384, 1152), (1, 384, 1152), (1, 384, 8192), (2048, 384, 8192)]


def best_of(f, n=5):
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    for m, k, n in SHAPES:
        x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
        xb, wb = x.astype(mx.bfloat16), w.astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, 64, 8)
        mx.eval(x, w, xb, wb, wq, scales, biases)
        flops = 2 * m * k * n
        forms = {
            "f32": lambda: mx.eval(x @ w.T),
            "bf16": lambda: mx.eval(xb @ wb.T),
            "q8": lambda: mx.eval(mx.quantized_matmul(x, wq, scales, biases, True, 64, 8)),
        }
        cells = [f"{name} {flops / best_of(f) / 1e9:6.2f}" for name, f in forms.items()]
        print(f"{m}x{k}x{n}: " + "  ".join(cells) + "  GFLOP/s")


if __name__ == "__main__":
    main()
