"""mlx-lm as it runs on a Mac, on an NVIDIA GPU: the peer for bench/compare.sh's `PEERS=mac-like`.

On Apple silicon mlx-lm (0.32.2) runs a hybrid's Gated DeltaNet recurrence as its own Metal
kernel (`mlx_lm.models.gated_delta._make_gated_delta_kernel`: one SIMD group per value row,
each lane holding Dk/32 state elements, `simd_sum` for the two dot products), one launch per
layer and step; anywhere else it falls back to operations. This module ports that kernel to
`mx.fast.cuda_kernel` — the same thread layout, the same per-lane element order, a warp
butterfly for `simd_sum` — and patches it into the `gated_delta_update` that mlx-lm's
`qwen3_next` and `qwen3_5` call, so on the H200 mlx-lm runs the recurrence the way it runs on a
Mac. (Its packed Dk=128 prefill specialisation is left out: it reorders the same sums.)

`install()` patches; `check()` compares the port with mlx-lm's operations path on random inputs
(float32 and bfloat16, with and without a mask) and raises if they differ.
"""

import mlx.core as mx

from mlx_lm.models import gated_delta as gd

_SOURCE = """
    const int T = *T_in;  // a runtime input, as in the Metal kernel (no new kernel per length)
    auto n = blockIdx.z * blockDim.z + threadIdx.z;
    auto b_idx = n / Hv;
    auto hv_idx = n % Hv;
    auto hk_idx = hv_idx / (Hv / Hk);
    constexpr int n_per_t = Dk / 32;

    // q, k: [B, T, Hk, Dk]
    auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;
    auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk;

    // v, y: [B, T, Hv, Dv]
    auto v_ = v + b_idx * T * Hv * Dv + hv_idx * Dv;
    y += b_idx * T * Hv * Dv + hv_idx * Dv;

    auto dk_idx = threadIdx.x;
    auto dv_idx = blockIdx.y * blockDim.y + threadIdx.y;

    // state_in, state_out: [B, Hv, Dv, Dk]
    auto i_state = state_in + (n * Dv + dv_idx) * Dk;
    auto o_state = state_out + (n * Dv + dv_idx) * Dk;

    float state[n_per_t];
    for (int i = 0; i < n_per_t; ++i) {
      auto s_idx = n_per_t * dk_idx + i;
      state[i] = static_cast<float>(i_state[s_idx]);
    }

    // g, beta: [B, T, Hv]
    auto g_ = g + b_idx * T * Hv;
    auto beta_ = beta + b_idx * T * Hv;

    for (int t = 0; t < T; ++t) {
      if (MASK) {
        float kv_mem = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          state[i] = state[i] * static_cast<float>(g_[hv_idx]);
          kv_mem += state[i] * static_cast<float>(k_[s_idx]);
        }
        for (int o = 1; o < 32; o <<= 1) kv_mem += __shfl_xor_sync(0xffffffffu, kv_mem, o);

        auto delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);

        float out = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
          out += state[i] * static_cast<float>(q_[s_idx]);
        }
        for (int o = 1; o < 32; o <<= 1) out += __shfl_xor_sync(0xffffffffu, out, o);
        if (dk_idx == 0) {
          y[dv_idx] = static_cast<InT>(out);
        }
      } else if (dk_idx == 0) {
        y[dv_idx] = static_cast<InT>(0.0f);
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    for (int i = 0; i < n_per_t; ++i) {
      auto s_idx = n_per_t * dk_idx + i;
      o_state[s_idx] = static_cast<StT>(state[i]);
    }
"""

_kernels = {}


def _kernel(has_mask):
    if has_mask not in _kernels:
        inputs = ["q", "k", "v", "g", "beta", "state_in", "T_in"] + (["mask"] if has_mask else [])
        _kernels[has_mask] = mx.fast.cuda_kernel(
            name="mlx_lm_gated_delta_step" + ("_mask" if has_mask else ""),
            input_names=inputs,
            output_names=["y", "state_out"],
            source=_SOURCE.replace("MASK", "static_cast<bool>(mask[b_idx * T + t])" if has_mask else "true"),
        )
    return _kernels[has_mask]


def gated_delta_kernel_cuda(q, k, v, g, beta, state, mask=None):
    """mlx-lm's `gated_delta_kernel` (scalar gates) on CUDA."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state, mx.array(T, dtype=mx.int32)] + ([mask] if mask is not None else [])
    return _kernel(mask is not None)(
        inputs=inputs,
        template=[
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
        ],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape],
        output_dtypes=[q.dtype, state.dtype],
    )


def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True, lower_bound=None, allow_neg_eigval=False):
    """mlx-lm 0.32.2's `gated_delta_update`, with its Metal condition read as 'a GPU kernel exists'."""
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    g = gd.compute_g(A_log, a, dt_bias) if lower_bound is None else gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if state is None:
        B, _, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if not use_kernel or mx.default_device() != mx.gpu or k.shape[-1] % 32 != 0 or g.ndim != 3:
        return gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    return gated_delta_kernel_cuda(q, k, v, g, beta, state, mask)


def install():
    """Routes mlx-lm's hybrids through the port (a no-op without a CUDA GPU)."""
    if not mx.cuda.is_available():
        return False
    import mlx_lm.models.qwen3_5 as qwen3_5
    import mlx_lm.models.qwen3_next as qwen3_next

    for module in (gd, qwen3_next, qwen3_5):
        module.gated_delta_update = gated_delta_update
    return True


def check():
    """The port against mlx-lm's operations path; returns the largest relative differences."""
    worst = {}
    for dtype in (mx.float32, mx.bfloat16):
        for T, masked in ((1, False), (5, False), (70, False), (5, True)):
            mx.random.seed(T)
            B, Hk, Hv, Dk, Dv = 2, 2, 4, 128, 128
            q = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
            k = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
            q, k = gd.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
            v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
            g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
            beta = mx.random.uniform(shape=(B, T, Hv)).astype(dtype)
            state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
            mask = (mx.arange(T)[None, :] < T - 2) if masked else None
            mask = mx.broadcast_to(mask, (B, T)) if masked else None
            y0, s0 = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
            y1, s1 = gated_delta_kernel_cuda(q, k, v, g, beta, state, mask)
            if masked:  # the ops path computes masked positions' outputs anyway; the kernels zero them
                keep = mask[..., None, None]
                y0, y1 = mx.where(keep, y0, 0), mx.where(keep, y1, 0)
            for name, e, got, tol in (("y", y0, y1, 2e-2 if dtype == mx.bfloat16 else 1e-4), ("state", s0, s1, 1e-3)):
                e, got = e.astype(mx.float32), got.astype(mx.float32)
                rel = (mx.abs(e - got).max() / (1 + mx.abs(e).max())).item()
                if not rel <= tol:
                    raise AssertionError(f"mlx-lm's kernel port differs from its ops: {dtype}, T={T}, mask={masked}: {name} by {rel:.2e}")
                worst[f"{dtype} T={T}{' mask' if masked else ''} {name}"] = rel
    return worst


if __name__ == "__main__":
    import json

    print(json.dumps({"cuda": mx.cuda.is_available(), "differences": check() if mx.cuda.is_available() else None}))
