    // Body of `ferrite_qmm_mma` (see qmm_mma.rs; bench/qmm_small_m.py launches the same text).
    // y[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]) for up to 16 rows m of
    // bfloat16, on the tensor cores: one `mma.m16n8k16` per 16 inputs multiplies all 16 rows
    // (rows past x's are zeros) by 8 columns of weights dequantized to bfloat16 in registers,
    // so the weights are read once and the cost barely grows with the rows. A block's 4 warps
    // share 8 output columns, each a quarter of the inputs, and add their sums in a fixed
    // order. Whatever the other rows hold, a row's products and sums are the same
    // instructions on the same values: a row gives the same bits alone and among others.
    constexpr int per_word = 32 / Bits;
    constexpr int step_words = 16 / per_word;       // packed words under 16 inputs
    constexpr unsigned mask = (1u << Bits) - 1u;
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int row_words = K / per_word;
    const int groups = K / GroupSize;
    const int lane = threadIdx.x;
    const int g = lane >> 2;                        // the fragments' row (x) and column (w)
    const int t = lane & 3;
    const int split = threadIdx.y;                  // which quarter of the inputs
    const int n0 = blockIdx.y * 8;
    if (n0 >= N) return;                            // whole blocks leave together
    const int n = n0 + g;
    const unsigned* wrow = w + (size_t)n * row_words;
    const unsigned* xlo = reinterpret_cast<const unsigned*>(x + (size_t)g * K);
    const unsigned* xhi = reinterpret_cast<const unsigned*>(x + (size_t)(g + 8) * K);
    const bool has_lo = g < rows;
    const bool has_hi = g + 8 < rows;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int quarter = K / 4;
    for (int k0 = split * quarter; k0 < (split + 1) * quarter; k0 += 16) {
      // A: rows g and g + 8, inputs k0 + 2t, +1 and k0 + 8 + 2t, +1 (pairs of bfloat16).
      const int pair = (k0 >> 1) + t;
      const unsigned a0 = has_lo ? xlo[pair] : 0u;
      const unsigned a1 = has_hi ? xhi[pair] : 0u;
      const unsigned a2 = has_lo ? xlo[pair + 4] : 0u;
      const unsigned a3 = has_hi ? xhi[pair + 4] : 0u;
      // B: column n, inputs k0 + 2t, +1 (b0) and k0 + 8 + 2t, +1 (b1), dequantized.
      unsigned words[step_words];
      const unsigned* wk = wrow + k0 / per_word;
      if constexpr (step_words == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(wk);
        words[0] = v.x; words[1] = v.y; words[2] = v.z; words[3] = v.w;
      } else if constexpr (step_words == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(wk);
        words[0] = v.x; words[1] = v.y;
      } else {
        #pragma unroll
        for (int j = 0; j < step_words; ++j) words[j] = wk[j];
      }
      const float scale = static_cast<float>(scales[(size_t)n * groups + k0 / GroupSize]);
      const float bias = static_cast<float>(biases[(size_t)n * groups + k0 / GroupSize]);
      unsigned b[2];
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        float v[2];
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = 8 * half + 2 * t + e;       // within the 16 inputs
          const unsigned bits = 0x4B000000u | ((words[k / per_word] >> ((k % per_word) * Bits)) & mask);
          v[e] = __fmaf_rn(scale, __uint_as_float(bits) - 8388608.0f, bias);
        }
        const __nv_bfloat162 packed = __floats2bfloat162_rn(v[0], v[1]);
        b[half] = *reinterpret_cast<const unsigned*>(&packed);
      }
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
          : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[0]), "r"(b[1]));
    }

    // The quarters' sums, added in split order by the first warp. C: rows g (acc 0, 1) and
    // g + 8 (acc 2, 3), columns n0 + 2t, +1.
    __shared__ float parts[4][32][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) parts[split][lane][i] = acc[i];
    __syncthreads();
    if (split == 0) {
      float sum[4];
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        sum[i] = parts[0][lane][i];
        #pragma unroll
        for (int s = 1; s < 4; ++s) sum[i] += parts[s][lane][i];
      }
      const int col = n0 + 2 * t;
      if (has_lo) {
        y[(size_t)g * N + col] = static_cast<InT>(sum[0]);
        y[(size_t)g * N + col + 1] = static_cast<InT>(sum[1]);
      }
      if (has_hi) {
        y[(size_t)(g + 8) * N + col] = static_cast<InT>(sum[2]);
        y[(size_t)(g + 8) * N + col + 1] = static_cast<InT>(sum[3]);
      }
    }
