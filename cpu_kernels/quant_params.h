// IEEE half -> float (the attention kernel's float16 caches too), and the scales and minimums of
// a quantized weight (f16 or f32 rows of [G, N]) read as f32 and the real rows of x, shared by
// the quantized matmul kernels.
#ifndef JAXINFER_CPU_KERNELS_QUANT_PARAMS_H_
#define JAXINFER_CPU_KERNELS_QUANT_PARAMS_H_

#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxinfer {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The rows of x [M, K] a product computes: the step's real ones, the first `num_rows[0]`
// (clamped to [0, M]). A step padded to its token bucket has rows beyond them that nothing reads,
// so their multiply-adds are skipped and their output rows set to zero (ZeroRowsFrom).
inline int64_t RealRows(const int32_t* num_rows, int64_t m) {
  const int64_t r = num_rows[0];
  return r < 0 ? 0 : (r > m ? m : r);
}

// Rows [from, m) of y [m, n] set to zero.
inline void ZeroRowsFrom(float* y, int64_t from, int64_t m, int64_t n) {
  if (from < m) std::memset(y + from * n, 0, sizeof(float) * (m - from) * n);
}

// n values of a scale/min row (f16 or f32) as f32.
inline void load_params(const void* row, bool f16, int64_t n, float* out) {
  if (!f16) {
    std::memcpy(out, row, sizeof(float) * n);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(row);
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(v));
  }
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

#if defined(__AVX512F__)
// 16 values of a scale/min array (f16 or f32) from `index` on, as f32.
inline __m512 load_param16(const void* base, int64_t index, bool f16) {
  if (f16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(base) + index);
}
#endif

}  // namespace jaxinfer

#endif  // JAXINFER_CPU_KERNELS_QUANT_PARAMS_H_
