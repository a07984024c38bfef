// y = x @ W for a quantized weight W[K, N] on the CPU: an XLA FFI custom call (quant_matmul.py).
//
// The weight layout is jaxinfer.quant.QuantizedWeight's (quant/format.py), groups of
// `group_size` rows of K sharing one scale (and minimum) per output column:
//   bits 8: values i8[K, N], w = q * scale
//   bits 4: values u8[K/2, N]; the low nibble of row i is row i of W, the high nibble row
//           K/2 + i; symmetric w = (q - 8) * scale, asymmetric w = q * scale + min
//   scales (mins): f16 or f32 [G, N]
// The weight is read once, straight from its packed form: no float copy of it is ever written.
// Within a group the integer codes are widened and multiplied into per-row accumulators, and
// the group's scale (and minimum, times the group's sum of x) is applied once per column:
//   y[m, n] = sum_g scale[g, n] * sum_{k in g} x[m, k] q[k, n]  (+ min[g, n] * sum_{k in g} x[m, k])
// Work items are blocks of output columns, spread over XLA's intra-op thread pool; each item
// takes the rows of x kRows at a time, so a block of the weight is streamed from memory once
// and reused from cache for the other row blocks. It is meant for the few rows of a decode step
// (a memory-bound product); many rows are faster through a dense matmul.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 32;          // output columns in registers at once
constexpr int64_t kItemCols = 256;     // output columns per work item
constexpr int kRows = 4;               // rows of x per pass over a column block

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

struct Problem {
  const float* x;  // [M, K]
  float* y;        // [M, N]
  const void* values;
  const void* scales;
  const void* mins;  // nullptr: symmetric (or int8)
  bool f16_params;
  int bits;
  int64_t m, k, n, group_size;
};

// Rows [m0, m0 + R) of y, columns [c0, c0 + kCols) (c0 + kCols <= n), int8 weights.
template <int R>
void Int8Block(const Problem& p, int64_t m0, int64_t c0) {
  const int8_t* q = static_cast<const int8_t*>(p.values);
  const int64_t gs = p.group_size, num_groups = (p.k + gs - 1) / gs;
  float out[R][kCols] = {};
  float scale[kCols];
  for (int64_t g = 0; g < num_groups; ++g) {
    float acc[R][kCols] = {};
    const int64_t k_end = std::min(p.k, (g + 1) * gs);
    for (int64_t k = g * gs; k < k_end; ++k) {
      const int8_t* row = q + k * p.n + c0;
      float w[kCols];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) w[j] = static_cast<float>(row[j]);
      for (int r = 0; r < R; ++r) {
        const float xv = p.x[(m0 + r) * p.k + k];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) acc[r][j] += xv * w[j];
      }
    }
    const int64_t param_row = g * p.n + c0;
    load_params(static_cast<const char*>(p.scales) + param_row * (p.f16_params ? 2 : 4),
                p.f16_params, kCols, scale);
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) out[r][j] += acc[r][j] * scale[j];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + c0, out[r], sizeof(out[r]));
}

// The same for int4 weights: one pass over the K/2 packed rows covers both halves of K; the
// half rows of group g (low nibbles) and of group g + (K/2)/gs (high nibbles) run together.
template <int R>
void Int4Block(const Problem& p, int64_t m0, int64_t c0) {
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const int64_t gs = p.group_size, kh = p.k / 2, half_groups = kh / gs;
  const bool asym = p.mins != nullptr;
  const size_t psize = p.f16_params ? 2 : 4;
  float out[R][kCols] = {};
  float s_lo[kCols], s_hi[kCols], m_lo[kCols], m_hi[kCols];
  for (int64_t g = 0; g < half_groups; ++g) {
    float acc_lo[R][kCols] = {}, acc_hi[R][kCols] = {};
    float sum_lo[R] = {}, sum_hi[R] = {};
    for (int64_t i = g * gs; i < (g + 1) * gs; ++i) {
      const uint8_t* row = q + i * p.n + c0;
      float lo[kCols], hi[kCols];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) {
        lo[j] = static_cast<float>(row[j] & 15);
        hi[j] = static_cast<float>(row[j] >> 4);
      }
      for (int r = 0; r < R; ++r) {
        const float xl = p.x[(m0 + r) * p.k + i], xh = p.x[(m0 + r) * p.k + kh + i];
        sum_lo[r] += xl;
        sum_hi[r] += xh;
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) {
          acc_lo[r][j] += xl * lo[j];
          acc_hi[r][j] += xh * hi[j];
        }
      }
    }
    const int64_t g_hi = g + half_groups;
    const char* sc = static_cast<const char*>(p.scales);
    load_params(sc + (g * p.n + c0) * psize, p.f16_params, kCols, s_lo);
    load_params(sc + (g_hi * p.n + c0) * psize, p.f16_params, kCols, s_hi);
    if (asym) {
      const char* mn = static_cast<const char*>(p.mins);
      load_params(mn + (g * p.n + c0) * psize, p.f16_params, kCols, m_lo);
      load_params(mn + (g_hi * p.n + c0) * psize, p.f16_params, kCols, m_hi);
    }
    for (int r = 0; r < R; ++r) {
      // asymmetric: w = q s + min; symmetric: w = (q - 8) s = q s - 8 s
      const float bl = sum_lo[r], bh = sum_hi[r];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) {
        const float off_lo = asym ? m_lo[j] : -8.0f * s_lo[j];
        const float off_hi = asym ? m_hi[j] : -8.0f * s_hi[j];
        out[r][j] += acc_lo[r][j] * s_lo[j] + bl * off_lo + acc_hi[r][j] * s_hi[j] + bh * off_hi;
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + c0, out[r], sizeof(out[r]));
}

template <int R>
void Block(const Problem& p, int64_t m0, int64_t c0) {
  if (p.bits == 8) {
    Int8Block<R>(p, m0, c0);
  } else {
    Int4Block<R>(p, m0, c0);
  }
}

// Columns [c0, c1) of y for every row.
void RunItem(const Problem& p, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += kCols) {
    int64_t m0 = 0;
    for (; m0 + kRows <= p.m; m0 += kRows) Block<kRows>(p, m0, c);
    for (; m0 < p.m; ++m0) Block<1>(p, m0, c);
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                           ffi::AnyBuffer scales, ffi::AnyBuffer mins, int64_t bits,
                           int64_t group_size, int64_t has_mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto vd = values.dimensions();
  if (xd.size() != 2 || vd.size() != 2) {
    return ffi::Error::InvalidArgument("x must be [M, K] and the values 2-D");
  }
  Problem p;
  p.x = x.typed_data();
  p.y = y->typed_data();
  p.values = values.untyped_data();
  p.scales = scales.untyped_data();
  p.mins = has_mins ? mins.untyped_data() : nullptr;
  p.f16_params = scales.element_type() == ffi::DataType::F16;
  p.bits = static_cast<int>(bits);
  p.m = xd[0];
  p.k = xd[1];
  p.n = vd[1];
  p.group_size = group_size;
  if (p.n % kCols != 0) {
    return ffi::Error::InvalidArgument("the number of output columns must be a multiple of 32");
  }
  jaxinfer::ParallelFor(pool, (p.n + kItemCols - 1) / kItemCols, [&](int64_t i) {
    RunItem(p, i * kItemCols, std::min(p.n, (i + 1) * kItemCols));
  });
  return ffi::Error::Success();
}

// W[K, N] as f32, for the many-row products a dense matmul does better: columns [c0, c1).
void DequantizeColumns(const Problem& p, float* w, int64_t c0, int64_t c1) {
  const int64_t gs = p.group_size, width = c1 - c0;
  const size_t psize = p.f16_params ? 2 : 4;
  const char* sc = static_cast<const char*>(p.scales);
  const char* mn = static_cast<const char*>(p.mins);
  std::vector<float> scale(width), minimum(width);
  const int64_t num_groups = (p.k + gs - 1) / gs;
  for (int64_t g = 0; g < num_groups; ++g) {
    load_params(sc + (g * p.n + c0) * psize, p.f16_params, width, scale.data());
    if (p.mins != nullptr) load_params(mn + (g * p.n + c0) * psize, p.f16_params, width, minimum.data());
    for (int64_t k = g * gs; k < std::min(p.k, (g + 1) * gs); ++k) {
      float* out = w + k * p.n + c0;
      if (p.bits == 8) {
        const int8_t* q = static_cast<const int8_t*>(p.values) + k * p.n + c0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) out[j] = static_cast<float>(q[j]) * scale[j];
      } else {
        const int64_t kh = (p.k + 1) / 2;
        const uint8_t* q = static_cast<const uint8_t*>(p.values) + (k % kh) * p.n + c0;
        const int shift = k < kh ? 0 : 4;
        if (p.mins != nullptr) {
#pragma omp simd
          for (int64_t j = 0; j < width; ++j)
            out[j] = static_cast<float>((q[j] >> shift) & 15) * scale[j] + minimum[j];
        } else {
#pragma omp simd
          for (int64_t j = 0; j < width; ++j)
            out[j] = static_cast<float>(((q[j] >> shift) & 15) - 8) * scale[j];
        }
      }
    }
  }
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                          ffi::AnyBuffer mins, int64_t bits, int64_t group_size, int64_t has_mins,
                          int64_t k, ffi::ResultBuffer<ffi::F32> w) {
  Problem p{};
  p.values = values.untyped_data();
  p.scales = scales.untyped_data();
  p.mins = has_mins ? mins.untyped_data() : nullptr;
  p.f16_params = scales.element_type() == ffi::DataType::F16;
  p.bits = static_cast<int>(bits);
  p.k = k;
  p.n = values.dimensions()[1];
  p.group_size = group_size;
  float* out = w->typed_data();
  jaxinfer::ParallelFor(pool, (p.n + kItemCols - 1) / kItemCols, [&](int64_t i) {
    DequantizeColumns(p, out, i * kItemCols, std::min(p.n, (i + 1) * kItemCols));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // values
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // mins (or a dummy)
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_mins")
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // values i8[K, N] | u8[K/2, N]
                                  .Arg<ffi::AnyBuffer>()         // scales f16|f32 [G, N]
                                  .Arg<ffi::AnyBuffer>()         // mins (or a dummy)
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_mins")
                                  .Ret<ffi::Buffer<ffi::F32>>());
