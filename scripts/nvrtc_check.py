#!/usr/bin/env python3
"""Compiles the engine's CUDA kernel sources with NVRTC on a machine without a GPU, wrapped
the way MLX's `fast::cuda_kernel` wraps them (the signature from the inputs and outputs,
template arguments as constants), so a compile error shows here and not on the device.

    pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12   # into any venv
    python scripts/nvrtc_check.py

It only compiles (nothing runs without a GPU); what a kernel computes is checked at load on the
device, against the operations path (`engine::layers::delta_check`)."""
import ctypes
import pathlib
import re
import sys

import nvidia.cuda_nvrtc
import nvidia.cuda_runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
TYPES = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half", "i32": "int32_t", "u32": "uint32_t", "bool": "bool"}
HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;  // MLX's device headers bring the fixed-width types
typedef unsigned int uint32_t;
struct Shape { int d[10]; __device__ int operator[](int i) const { return d[i]; } };
namespace mlx { namespace core { namespace cu {
"""

# (file, its source constant, kernel name, inputs as (name, dtype, has_shape), outputs as
# (name, dtype), template; a list of values compiles each)
KERNELS = [
    (
        "crates/engine/src/layers/delta_cuda.rs",
        "SOURCE",
        "ferrite_gated_delta",
        [("q", "T", True), ("k", "T", False), ("v", "T", False), ("g", "f32", False),
         ("beta", "f32", False), ("state_in", "f32", False)],
        [("y", "T"), ("state_out", "f32")],
        {"InT": "T", "Dk": 128, "Dv": 128, "Hk": 2, "Hv": 4, "Capture": [False, True]},
    ),
    (
        "crates/engine/src/layers/delta_fused.rs",
        "SOURCE",
        "ferrite_gated_delta_step",
        [("proj", "T", True), ("tail", "T", False), ("conv_w", "T", False), ("a_log", "f32", False),
         ("dt_bias", "T", False), ("norm_w", "T", False), ("state_in", "f32", False)],
        [("y_out", "T"), ("tail_out", "T"), ("state_out", "f32")],
        {"InT": "T", "Dk": 128, "Dv": 128, "Hk": 2, "Hv": 4, "K": 4, "Warps": 8, "Capture": [False, True]},
    ),
    (
        "crates/engine/src/layers/moe_cuda.rs",
        "ROUTE_SOURCE",
        "ferrite_moe_route",
        [("logits", "T", False)],
        [("ids", "u32"), ("weights", "T")],
        {"InT": "T", "E": 512, "K": 10, "Shared": [False, True], "SharedId": 512, "Normalize": True},
    ),
    (
        "crates/engine/src/layers/moe_cuda.rs",
        "COMBINE_SOURCE",
        "ferrite_moe_combine",
        [("y", "T", False), ("weights", "T", False), ("residual", "T", False)],
        [("moe_out", "T")],
        {"InT": "T", "D": 2048, "K": 10, "Shared": [False, True]},
    ),
    # The Mac-like peer's port of mlx-lm's Metal kernel (its MASK spelled out as `true`).
    (
        "bench/mlx_lm_mac_like.py",
        "_SOURCE",
        "mlx_lm_gated_delta_step",
        [("q", "T", False), ("k", "T", False), ("v", "T", False), ("g", "f32", False),
         ("beta", "T", False), ("state_in", "f32", False), ("T_in", "i32", False)],
        [("y", "T"), ("state_out", "f32")],
        {"InT": "T", "StT": "f32", "Dk": 128, "Dv": 128, "Hk": 2, "Hv": 4},
    ),
]


def source_of(path, constant):
    text = (ROOT / path).read_text()
    name = re.escape(constant)
    found = re.search(rf'const {name}: &str = r#"(.*?)"#;', text, re.S) or re.search(rf'{name} = """(.*?)"""', text, re.S)
    if not found:
        sys.exit(f"{path}: no kernel source string")
    return found.group(1).replace("MASK", "true")


def variants(template):
    """Every combination of the template's listed values, as plain dicts."""
    combos = [{}]
    for key, value in template.items():
        combos = [{**c, key: v} for c in combos for v in (value if isinstance(value, list) else [value])]
    return combos


def wrap(name, body, inputs, outputs, template, dtype):
    t = lambda d: TYPES[dtype] if d == "T" else TYPES[d]
    params = []
    for arg, d, has_shape in inputs:
        params.append(f"const {t(d)}* {arg}")
        if has_shape:
            params.append(f"const __grid_constant__ Shape {arg}_shape")
    params += [f"{t(d)}* {arg}" for arg, d in outputs]
    consts = []
    for key, value in template.items():
        if isinstance(value, str):
            consts.append(f"  using {key} = {t(value)};")
        elif isinstance(value, bool):
            consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        else:
            consts.append(f"  constexpr int {key} = {value};")
    return (HEADER + f"__global__ void {name}(\n    " + ",\n    ".join(params) + ") {\n"
            + "\n".join(consts) + "\n" + body + "\n}\n}}}\n")


def compile_source(lib, src, name, includes):
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed ({rc})")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    # Compiled for the H200 (sm_90) with ptxas's report: a block's threads times the registers
    # each uses must fit the SM's 64K registers, or the launch fails ("too many resources").
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"--ptxas-options=-v"] + [f"-I{i}".encode() for i in includes]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main():
    nvrtc_dir = pathlib.Path(nvidia.cuda_nvrtc.__path__[0]) / "lib"
    lib = ctypes.CDLL(str(next(nvrtc_dir.glob("libnvrtc.so*"))))
    includes = [pathlib.Path(nvidia.cuda_runtime.__path__[0]) / "include"]
    failed = 0
    for path, constant, name, inputs, outputs, template in KERNELS:
        body = source_of(path, constant)
        for dtype in ("f32", "bf16"):
            for chosen in variants(template):
                rc, log = compile_source(lib, wrap(name, body, inputs, outputs, chosen, dtype), name, includes)
                status = "ok" if rc == 0 else "FAILED"
                varied = " ".join(f"{k}={v}" for k, v in chosen.items() if isinstance(template[k], list))
                used = " ".join(re.findall(r"Used (\d+ registers)", log))
                print(f"{name} {dtype} {varied}: {status} {used}")
                if rc != 0 or "warning" in log:
                    print(log)
                failed += rc != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
