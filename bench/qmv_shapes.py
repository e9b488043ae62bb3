"""How fast one quantized matrix-vector product (a decode step's matmul) runs for each
weight shape of a model, and whether cutting the matrix into row blocks or column halves
changes that, on the default device. Prints JSON: per shape and form, microseconds per call
and the weight bytes read per second.

Why: a backend may pick its kernel by shape (MLX's CUDA backend, for instance, sends a
one-row product to its matrix-vector kernel only below some size and to a tiled matrix kernel
above it), so the same bytes can cost very different times. Shapes default to the 32B- and
8B-shaped dense Qwen3 (4-bit, group 64), their q/k/v and gate/up joined, and their output
head; each whole, in row blocks, in column parts and as a two-row product. Compare
`--per-eval 1` (a round trip per product) with e.g. `--per-eval 32`.
"""

import argparse
import json
import time

import mlx.core as mx

# (name, out_features, in_features)
SHAPES = {
    "32b": [("q", 8192, 5120), ("kv", 1024, 5120), ("qkv", 10240, 5120), ("o", 5120, 8192), ("gate", 25600, 5120),
            ("gate_up", 51200, 5120), ("down", 5120, 25600), ("head", 151936, 5120)],
    "8b": [("q", 4096, 4096), ("kv", 1024, 4096), ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate", 12288, 4096), ("gate_up", 24576, 4096),
           ("down", 4096, 12288), ("head", 151936, 4096)],
}


def per_call_us(f, calls, per_eval):
    """Time `calls` products, `per_eval` of them evaluated together: 1 adds a host round trip
    to each; more run back to back on the device's stream, as a decode step's matmuls do."""
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(max(1, calls // per_eval)):
        mx.eval([f() for _ in range(per_eval)])
    return (time.perf_counter() - start) / (max(1, calls // per_eval) * per_eval) * 1e6


def forms(x, q, rows_block, cols_parts):
    """The whole matrix, its row blocks (outputs concatenated: exact), its column parts
    (partial products added: rounding differs), and the row doubled (a two-row product, the
    first row kept). Parts are cut once, as a loader would."""
    w, s, b = q
    n, k = w.shape[0], x.shape[-1]
    mm = lambda x, w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    cuts = list(range(0, n, rows_block)) + [n]
    row_parts = [tuple(mx.contiguous(t[a:z]) for t in q) for a, z in zip(cuts, cuts[1:])]
    step = k // cols_parts
    wstep, gstep = step * 4 // 32, step // 64
    col_parts = [(mx.contiguous(w[:, i * wstep:(i + 1) * wstep]), mx.contiguous(s[:, i * gstep:(i + 1) * gstep]),
                  mx.contiguous(b[:, i * gstep:(i + 1) * gstep])) for i in range(cols_parts)]
    mx.eval(row_parts, col_parts)

    def whole():
        return mm(x, w, s, b)

    def row_blocks():
        return mx.concatenate([mm(x, *p) for p in row_parts], axis=-1)

    def col_sum():
        out = None
        for i, p in enumerate(col_parts):
            y = mm(x[..., i * step:(i + 1) * step], *p)
            out = y if out is None else out + y
        return out

    x2 = mx.concatenate([x, x], axis=-2)

    def two_rows():
        # The same row twice: a backend may send a two-row product to another kernel.
        return mm(x2, w, s, b)[..., :1, :]

    return {"whole": whole, "row_blocks": row_blocks, "col_parts": col_sum, "two_rows": two_rows}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(SHAPES), nargs="+", default=["8b", "32b"])
    p.add_argument("--rows-block", type=int, default=16384)
    p.add_argument("--cols-parts", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--per-eval", type=int, default=1, help="products evaluated together (see per_call_us)")
    p.add_argument("--dtype", default="bfloat16", help="activations and scales (CPU: float32)")
    a = p.parse_args()
    dt = getattr(mx, a.dtype)
    mx.random.seed(0)
    out = {"device": str(mx.default_device()), "per_eval": a.per_eval, "rows_block": a.rows_block, "cols_parts": a.cols_parts, "shapes": []}
    for model in a.model:
        for name, n, k in SHAPES[model]:
            q = mx.quantize(mx.random.normal((n, k)).astype(dt), 64, 4)
            x = mx.random.normal((1, 1, k)).astype(dt)
            mx.eval(q, x)
            nbytes = sum(t.nbytes for t in q)
            row = {"model": model, "name": name, "out": n, "in": k, "mb": round(nbytes / 1e6, 1)}
            fs = forms(x, q, a.rows_block, a.cols_parts)
            ref = fs["whole"]()
            for form, f in fs.items():
                if form == "row_blocks" and n <= a.rows_block:
                    continue
                if form == "col_parts" and k % (64 * a.cols_parts):
                    continue
                us = per_call_us(f, a.calls, a.per_eval)
                diff = mx.abs(f().astype(mx.float32) - ref.astype(mx.float32)).max().item()
                row[form] = {"us": round(us, 1), "gb_s": round(nbytes / us / 1e3, 1), "max_diff": diff}
            out["shapes"].append(row)
            print(json.dumps(row), flush=True)
            del q
    print(json.dumps(out))


if __name__ == "__main__":
    main()
