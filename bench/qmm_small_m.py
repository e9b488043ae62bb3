"""How a quantized matmul scales with the rows it multiplies (a verify pass multiplies its
d + 1 positions at once; a plain step one), on the dense 8B shape's projections, 4-bit with
groups of 64:
  - `mlx_ms`: MLX's `quantized_matmul` (its own choice of kernel for each row count);
  - `rows_c4_ms`, `rows_c8_ms`: the engine's few-rows kernel (crates/engine/src/layers/
    qmm_rows.cu, the text the engine launches) with 4 or 8 output columns a warp;
  - `mma_ms`: the engine's tensor-core kernel (qmm_mma.cu), all 16 rows in one `mma`;
  - `mlx_pad16_ms`: MLX's on the rows padded with zeros to 16 (its GEMM for every row count);
  - `bf16_ms`: the same product on bfloat16 weights.
Each time is milliseconds a call, 20 calls evaluated together (launch overhead amortised as
in a model's graph). Also checks MLX's and the kernel's outputs against float32 (`mlx_err`,
`rows_c*_err`: max |a - b| / (1 + max |b|)) and that a row's output does not depend on the other rows (`rows_same_as_one_row`).
One JSON line per shape and row count.
    python3 bench/qmm_small_m.py [--rounds 10]
"""
import argparse
import json
import pathlib
import time

import mlx.core as mx

LAYERS = pathlib.Path(__file__).resolve().parent.parent / "crates/engine/src/layers"
SOURCE = (LAYERS / "qmm_rows.cu").read_text()
MMA_SOURCE = (LAYERS / "qmm_mma.cu").read_text()
BATCH = 20


def timed(fn, rounds):
    mx.eval([fn() for _ in range(BATCH)])
    began = time.perf_counter()
    for _ in range(rounds):
        mx.eval([fn() for _ in range(BATCH)])
    return (time.perf_counter() - began) / rounds / BATCH


def bucket(m):
    return next(b for b in (1, 2, 4, 8, 16) if m <= b)


def rows_kernel():
    kernel = mx.fast.cuda_kernel(name="ferrite_qmm_rows", input_names=["x", "w", "scales", "biases"],
                                 output_names=["y"], source=SOURCE)

    def run(x2, wq, scales, biases, columns):
        n = wq.shape[0]
        warps = n // columns
        per_block = 4 if warps % 4 == 0 else 1
        return kernel(inputs=[x2, wq, scales, biases],
                      template=[("InT", x2.dtype), ("Bits", 4), ("GroupSize", 64), ("C", columns),
                                ("MaxRows", bucket(x2.shape[0]))],
                      grid=(32, warps, 1), threadgroup=(32, per_block, 1),
                      output_shapes=[(x2.shape[0], n)], output_dtypes=[x2.dtype])[0]
    return run


def mma_kernel():
    kernel = mx.fast.cuda_kernel(name="ferrite_qmm_mma", input_names=["x", "w", "scales", "biases"],
                                 output_names=["y"], source=MMA_SOURCE)

    def run(x2, wq, scales, biases):
        n = wq.shape[0]
        return kernel(inputs=[x2, wq, scales, biases],
                      template=[("InT", x2.dtype), ("Bits", 4), ("GroupSize", 64)],
                      grid=(32, 4 * (n // 8), 1), threadgroup=(32, 4, 1),
                      output_shapes=[(x2.shape[0], n)], output_dtypes=[x2.dtype])[0]
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    mx.random.seed(0)
    rows = rows_kernel()
    mma = mma_kernel()
    for out_dim, in_dim in [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]:
        w = (mx.random.normal((out_dim, in_dim)) * 0.02).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, wq, scales, biases)
        xs = mx.random.normal((16, in_dim)).astype(mx.bfloat16)
        one_row = rows(xs[:1], wq, scales, biases, 4)
        mma_one_row = mma(xs[:1], wq, scales, biases)  # lazy: a failure shows in the rows below
        pad16_one_row = mx.quantized_matmul(mx.pad(xs[:1], [(0, 15), (0, 0)]), wq, scales, biases, transpose=True,
                                            group_size=64, bits=4)[:1]
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]:
            x = xs[:m]
            mx.eval(x)
            line = {"shape": [out_dim, in_dim], "m": m}
            mlx = lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
            line["mlx_ms"] = timed(mlx, args.rounds) * 1e3
            # The reference in float32: the dequantized weights times x.
            deq = mx.dequantize(wq, scales, biases, group_size=64, bits=4).astype(mx.float32)
            expected = x.astype(mx.float32) @ deq.T
            rel = lambda got: (mx.max(mx.abs(got.astype(mx.float32) - expected)) / (1 + mx.max(mx.abs(expected)))).item()
            line["mlx_err"] = rel(mlx())
            # MLX's GEMM on the rows padded with zeros to 16: one kernel for every row count, so
            # a row would give the same bits in a plain step and in any verify pass (checked).
            padded = lambda: mx.quantized_matmul(mx.pad(x, [(0, 16 - m), (0, 0)]), wq, scales, biases, transpose=True,
                                                 group_size=64, bits=4)[:m]
            line["mlx_pad16_ms"] = timed(padded, args.rounds) * 1e3
            line["mlx_pad16_same_as_one_row"] = mx.array_equal(padded()[:1], pad16_one_row).item()
            try:
                for columns in (4, 8):
                    got = rows(x, wq, scales, biases, columns)
                    line[f"rows_c{columns}_err"] = rel(got)
                    line[f"rows_c{columns}_ms"] = timed(lambda: rows(x, wq, scales, biases, columns), args.rounds) * 1e3
                line["rows_same_as_one_row"] = mx.array_equal(rows(x, wq, scales, biases, 8)[:1], one_row).item()
            except Exception as e:  # a compile error or a refused launch: say it, keep measuring MLX
                line["rows_error"] = str(e)[:2000]
            try:
                line["mma_err"] = rel(mma(x, wq, scales, biases))
                line["mma_ms"] = timed(lambda: mma(x, wq, scales, biases), args.rounds) * 1e3
                line["mma_same_as_one_row"] = mx.array_equal(mma(x, wq, scales, biases)[:1], mma_one_row).item()
            except Exception as e:
                line["mma_error"] = str(e)[:2000]
            line["bf16_ms"] = timed(lambda: x @ w.T, args.rounds) * 1e3
            line.update(device=str(mx.default_device()), mlx=mx.__version__)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
