    // Body of `ferrite_qmm_rows` (see qmm_rows.rs; bench/qmm_small_m.py launches the same text).
    // y[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]) for a few rows m: each
    // warp owns C output columns and reads their packed weights once, 16 bytes per lane per
    // step, for every row of x. A group's part of the sum is scale * (q . x) + bias * sum(x).
    // The order of the sums depends on neither the number of rows nor the other rows, so a
    // row's output is the same bit for bit in a one-row step and in a verify pass.
    constexpr int per_word = 32 / Bits;             // values in one uint32
    constexpr int words_per_group = GroupSize / per_word;
    constexpr int per_step = 4 * per_word;          // values under one lane's 16-byte load
    constexpr unsigned mask = (1u << Bits) - 1u;
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int row_words = K / per_word;
    const int groups = K / GroupSize;
    const int lane = threadIdx.x;
    const int n0 = (blockIdx.y * blockDim.y + threadIdx.y) * C;
    if (n0 >= N) return;                            // whole warps leave together

    float acc[C][MaxRows];
    #pragma unroll
    for (int c = 0; c < C; ++c) {
      #pragma unroll
      for (int m = 0; m < MaxRows; ++m) acc[c][m] = 0.0f;
    }

    for (int i = lane * 4; i < row_words; i += 128) {
      uint4 packed[C];
      float scale[C], bias[C];
      #pragma unroll
      for (int c = 0; c < C; ++c) {
        const size_t n = (size_t)(n0 + c);
        packed[c] = *reinterpret_cast<const uint4*>(w + n * row_words + i);
        scale[c] = static_cast<float>(scales[n * groups + i / words_per_group]);
        bias[c] = static_cast<float>(biases[n * groups + i / words_per_group]);
      }
      const int k = i * per_word;
      #pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        if (m < rows) {
          float xs[per_step];
          const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
          #pragma unroll
          for (int j = 0; j < per_step / 8; ++j) {
            const uint4 raw = xr[j];
            const InT* h = reinterpret_cast<const InT*>(&raw);
            #pragma unroll
            for (int t = 0; t < 8; ++t) xs[j * 8 + t] = static_cast<float>(h[t]);
          }
          float xsum = 0.0f;
          #pragma unroll
          for (int v = 0; v < per_step; ++v) xsum += xs[v];
          #pragma unroll
          for (int c = 0; c < C; ++c) {
            const unsigned* words = reinterpret_cast<const unsigned*>(&packed[c]);
            float dot = 0.0f;
            #pragma unroll
            for (int wi = 0; wi < 4; ++wi) {
              #pragma unroll
              for (int v = 0; v < per_word; ++v) {
                // 2^23 + q as a float's bits, less 2^23: exactly q, without an int-to-float
                // conversion (a fraction of the FMA rate).
                const unsigned bits = 0x4B000000u | ((words[wi] >> (v * Bits)) & mask);
                const float q = __uint_as_float(bits) - 8388608.0f;
                dot = __fmaf_rn(q, xs[wi * per_word + v], dot);
              }
            }
            // Explicit fused steps: the compiler may not contract them differently in the
            // kernel's instances for different row counts.
            acc[c][m] = __fmaf_rn(scale[c], dot, __fmaf_rn(bias[c], xsum, acc[c][m]));
          }
        }
      }
    }

    #pragma unroll
    for (int c = 0; c < C; ++c) {
      #pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[c][m] += __shfl_xor_sync(0xffffffffu, acc[c][m], o);
      }
    }
    if (lane == 0) {
      #pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        if (m < rows) {
          #pragma unroll
          for (int c = 0; c < C; ++c) y[(size_t)m * N + n0 + c] = static_cast<InT>(acc[c][m]);
        }
      }
    }
