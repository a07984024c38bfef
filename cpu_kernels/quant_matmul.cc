// y = x @ W for a quantized weight W[K, N] on the CPU: an XLA FFI custom call (quant_matmul.py).
//
// The weight layout is jaxinfer.quant.QuantizedWeight's (quant/format.py), groups of
// `group_size` rows of K sharing one scale (and minimum) per output column:
//   bits 8: values i8[K, N], w = q * scale
//   bits 4: values u8[K/2, N]; the low nibble of row i is row i of W, the high nibble row
//           K/2 + i; symmetric w = (q - 8) * scale, asymmetric w = q * scale + min
//   scales (mins): f16 or f32 [G, N]
//   their rows may be longer than N: a stride padded so that consecutive rows do not fall in
//   the same cache sets (QuantizedWeight.padded in quant/format.py). y's shape says N, the
//   arrays' the stride.
// The weight is read once, straight from its packed form: no float copy of it is ever written.
// Within a group the integer codes are widened and multiplied into per-row accumulators, and
// the group's scale (and minimum, times the group's sum of x) is applied once per column:
//   y[m, n] = sum_g scale[g, n] * sum_{k in g} x[m, k] q[k, n]  (+ min[g, n] * sum_{k in g} x[m, k])
// Work items are blocks of output columns, spread over XLA's intra-op thread pool; each item
// takes the rows of x kRows at a time, so a block of the weight is streamed from memory once
// and reused from cache for the other row blocks. One row of x is cut differently (OneRow):
// into blocks of up to 4096 columns, each walked forward row by row, and where that makes too
// few items, into ranges of the code rows too, each summed into its own partial row (on a CPU
// with AVX2 and no AVX-512, one to four rows: FewRows, the codes widened from memory). It is
// meant for the few rows of a decode step (a memory-bound product); many rows are faster
// through a dense matmul.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "quant_params.h"
#include "xla/ffi/api/ffi.h"

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jaxinfer::half_to_float;
using jaxinfer::load_params;
#if defined(__AVX512F__)
using jaxinfer::load_param16;
#endif

constexpr int64_t kCols = 32;          // output columns in registers at once
constexpr int64_t kItemCols = 256;     // output columns per work item
constexpr int kRows = 4;               // rows of x per pass over a column block
// Rows of the weight fetched ahead: a column block walks K rows N codes apart, a stride the
// hardware prefetchers do not follow across pages, so the kernel asks for them itself (a
// single-row product of SmolLM2's weights: 16.5 -> 10 ms).
constexpr int64_t kPrefetchRows = 16;

struct Problem {
  const float* x;  // [M, K]
  float* y;        // [M, N]
  const void* values;
  const void* scales;
  const void* mins;  // nullptr: symmetric (or int8)
  bool f16_params;
  int bits;
  int64_t m, k, n, group_size;
  int64_t ld;  // the row stride of values, scales and mins: N, or more (PaddedStride)
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
      const int8_t* row = q + k * p.ld + c0;
      if (k + kPrefetchRows < p.k) __builtin_prefetch(row + kPrefetchRows * p.ld);
      float w[kCols];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) w[j] = static_cast<float>(row[j]);
      for (int r = 0; r < R; ++r) {
        const float xv = p.x[(m0 + r) * p.k + k];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) acc[r][j] += xv * w[j];
      }
    }
    const int64_t param_row = g * p.ld + c0;
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
      const uint8_t* row = q + i * p.ld + c0;
      if (i + kPrefetchRows < kh) __builtin_prefetch(row + kPrefetchRows * p.ld);
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
    load_params(sc + (g * p.ld + c0) * psize, p.f16_params, kCols, s_lo);
    load_params(sc + (g_hi * p.ld + c0) * psize, p.f16_params, kCols, s_hi);
    if (asym) {
      const char* mn = static_cast<const char*>(p.mins);
      load_params(mn + (g * p.ld + c0) * psize, p.f16_params, kCols, m_lo);
      load_params(mn + (g_hi * p.ld + c0) * psize, p.f16_params, kCols, m_hi);
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same two blocks written with AVX-512 intrinsics, 64 columns (one cache line of int8
// codes, half a line of int4 ones) at a time: the codes are widened and converted in
// registers and every row's accumulators stay in registers across the group.
constexpr int64_t kWideCols = 64;

inline __m512 u8_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
inline __m512 i8_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

template <int R>
void Int8BlockAvx512(const Problem& p, int64_t m0, int64_t c0) {
  const int8_t* q = static_cast<const int8_t*>(p.values);
  const int64_t gs = p.group_size, num_groups = (p.k + gs - 1) / gs;
  __m512 out[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) out[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const int64_t k_end = std::min(p.k, (g + 1) * gs);
    for (int64_t k = g * gs; k < k_end; ++k) {
      if (k + kPrefetchRows < p.k)
        _mm_prefetch(reinterpret_cast<const char*>(q + (k + kPrefetchRows) * p.ld + c0), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(q + k * p.ld + c0);
      __m512 w[4];
      w[0] = i8_to_ps(_mm512_extracti32x4_epi32(v, 0));
      w[1] = i8_to_ps(_mm512_extracti32x4_epi32(v, 1));
      w[2] = i8_to_ps(_mm512_extracti32x4_epi32(v, 2));
      w[3] = i8_to_ps(_mm512_extracti32x4_epi32(v, 3));
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(p.x[(m0 + r) * p.k + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 sc = load_param16(p.scales, g * p.ld + c0 + 16 * j, p.f16_params);
      for (int r = 0; r < R; ++r) out[r][j] = _mm512_fmadd_ps(acc[r][j], sc, out[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(p.y + (m0 + r) * p.n + c0 + 16 * j, out[r][j]);
}

template <int R>
void Int4BlockAvx512(const Problem& p, int64_t m0, int64_t c0) {
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const int64_t gs = p.group_size, kh = p.k / 2, half_groups = kh / gs;
  const bool asym = p.mins != nullptr;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 out[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) out[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < half_groups; ++g) {
    __m512 acc_lo[R][4], acc_hi[R][4];
    float sum_lo[R], sum_hi[R];
    for (int r = 0; r < R; ++r) {
      sum_lo[r] = sum_hi[r] = 0.0f;
      for (int j = 0; j < 4; ++j) acc_lo[r][j] = acc_hi[r][j] = _mm512_setzero_ps();
    }
    for (int64_t i = g * gs; i < (g + 1) * gs; ++i) {
      const uint8_t* row = q + i * p.ld + c0;
      if (i + kPrefetchRows < kh)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * p.ld), _MM_HINT_T0);
      __m512 lo[4], hi[4];
      for (int h = 0; h < 2; ++h) {  // columns 32 h .. 32 h + 31
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * h));
        const __m256i l = _mm256_and_si256(v, low4);
        const __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        lo[2 * h] = u8_to_ps(_mm256_castsi256_si128(l));
        lo[2 * h + 1] = u8_to_ps(_mm256_extracti128_si256(l, 1));
        hi[2 * h] = u8_to_ps(_mm256_castsi256_si128(u));
        hi[2 * h + 1] = u8_to_ps(_mm256_extracti128_si256(u, 1));
      }
      for (int r = 0; r < R; ++r) {
        const float xl = p.x[(m0 + r) * p.k + i], xh = p.x[(m0 + r) * p.k + kh + i];
        sum_lo[r] += xl;
        sum_hi[r] += xh;
        const __m512 vl = _mm512_set1_ps(xl), vh = _mm512_set1_ps(xh);
        for (int j = 0; j < 4; ++j) {
          acc_lo[r][j] = _mm512_fmadd_ps(vl, lo[j], acc_lo[r][j]);
          acc_hi[r][j] = _mm512_fmadd_ps(vh, hi[j], acc_hi[r][j]);
        }
      }
    }
    const int64_t g_hi = g + half_groups;
    for (int j = 0; j < 4; ++j) {
      const int64_t col = c0 + 16 * j;
      const __m512 s_lo = load_param16(p.scales, g * p.ld + col, p.f16_params);
      const __m512 s_hi = load_param16(p.scales, g_hi * p.ld + col, p.f16_params);
      // asymmetric: w = q s + min; symmetric: w = (q - 8) s = q s - 8 s
      const __m512 off_lo = asym ? load_param16(p.mins, g * p.ld + col, p.f16_params)
                                 : _mm512_mul_ps(s_lo, _mm512_set1_ps(-8.0f));
      const __m512 off_hi = asym ? load_param16(p.mins, g_hi * p.ld + col, p.f16_params)
                                 : _mm512_mul_ps(s_hi, _mm512_set1_ps(-8.0f));
      for (int r = 0; r < R; ++r) {
        __m512 o = _mm512_fmadd_ps(acc_lo[r][j], s_lo, out[r][j]);
        o = _mm512_fmadd_ps(_mm512_set1_ps(sum_lo[r]), off_lo, o);
        o = _mm512_fmadd_ps(acc_hi[r][j], s_hi, o);
        out[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(sum_hi[r]), off_hi, o);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(p.y + (m0 + r) * p.n + c0 + 16 * j, out[r][j]);
}


// One row of x against int4 codes without widening shuffles: a 64-byte load holds 64 columns'
// codes as 16 dwords of 4 bytes; v >> 4 t' brings one nibble of every dword to its low 4 bits,
// the only bits of an index vpermps reads, so a lookup in the floats 0 .. 15 turns each shifted
// copy of the load into a vector of codes as floats (a shift and a lookup a vector, where a
// mask and an int-to-float conversion took two more). The 8 copies hold the t-th byte of each
// dword (columns 4 d + t, d = 0..15), low (row i) or high (row K/2 + i) nibble. The
// accumulators live in that permuted column order; each group's scales and minimums are
// permuted to it once, and the result is put back in column order at the end (OneRow).
inline __m512 permuted_param(const __m512 s[4], int t) {
  // lanes d of the result: column 4 d + t of the 64 held in s[0..3] (16 columns each)
  const __m512i lo_idx = _mm512_set_epi32(28 + t, 24 + t, 20 + t, 16 + t, 12 + t, 8 + t, 4 + t, t,
                                          28 + t, 24 + t, 20 + t, 16 + t, 12 + t, 8 + t, 4 + t, t);
  const __m512 a = _mm512_permutex2var_ps(s[0], lo_idx, s[1]);
  const __m512 b = _mm512_permutex2var_ps(s[2], lo_idx, s[3]);
  return _mm512_mask_blend_ps(0xFF00, a, b);
}

// Where a one-row product's prefetches go next: the bytes of the code rows and columns that
// the work item reads, in memory order, a fixed number of rows ahead of its reads.
struct PrefetchStream {
  const uint8_t* codes;
  int64_t n, c0, c1;  // the row stride and the item's columns (bytes: int8, or int4 pairs)
  int64_t row, end_row, col;

  void Next() {
    if (row >= end_row) return;
    _mm_prefetch(reinterpret_cast<const char*>(codes + row * n + col), _MM_HINT_T0);
    col += kWideCols;
    if (col >= c1) {
      col = c0;
      ++row;
    }
  }
};

// Code rows [a, b) of half-group g (one group's low nibbles, rows of K, and group g + K/2/gs's
// high nibbles), columns [c0, c0 + 64 C) of one row of x, added into `part` in the permuted
// column order below (partial sums: the item's other segments and the other items' are added
// to the same columns).
template <int C>
void Int4RowSegment(const Problem& p, int64_t c0, int64_t a, int64_t b, int64_t g, float* part,
                    PrefetchStream& ahead) {
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const int64_t kh = p.k / 2, half_groups = kh / p.group_size;
  const bool asym = p.mins != nullptr;
  const __m512 nibbles = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 acc_lo[C][4], acc_hi[C][4];  // acc[c][t] lane d: column c0 + 64 c + 4 d + t
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < 4; ++t) acc_lo[c][t] = acc_hi[c][t] = _mm512_setzero_ps();
  float sum_lo = 0.0f, sum_hi = 0.0f;
  for (int64_t i = a; i < b; ++i) {
    const uint8_t* row = q + i * p.ld + c0;
    for (int c = 0; c < C; ++c) ahead.Next();
    const float xl = p.x[i], xh = p.x[kh + i];
    sum_lo += xl;
    sum_hi += xh;
    const __m512 vl = _mm512_set1_ps(xl), vh = _mm512_set1_ps(xh);
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(row + 64 * c);
      for (int t = 0; t < 4; ++t) {
        // vpermps reads the low 4 bits of each lane: the nibble, looked up as its float value
        const __m512 l = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * t), nibbles);
        const __m512 u = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * t + 4), nibbles);
        acc_lo[c][t] = _mm512_fmadd_ps(vl, l, acc_lo[c][t]);
        acc_hi[c][t] = _mm512_fmadd_ps(vh, u, acc_hi[c][t]);
      }
    }
  }
  const int64_t g_hi = g + half_groups;
  const __m512 bl = _mm512_set1_ps(sum_lo), bh = _mm512_set1_ps(sum_hi);
  for (int c = 0; c < C; ++c) {
    __m512 s_lo[4], s_hi[4], o_lo[4], o_hi[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t col = c0 + 64 * c + 16 * j;
      s_lo[j] = load_param16(p.scales, g * p.ld + col, p.f16_params);
      s_hi[j] = load_param16(p.scales, g_hi * p.ld + col, p.f16_params);
      // asymmetric: w = q s + min; symmetric: w = (q - 8) s = q s - 8 s
      o_lo[j] = asym ? load_param16(p.mins, g * p.ld + col, p.f16_params)
                     : _mm512_mul_ps(s_lo[j], _mm512_set1_ps(-8.0f));
      o_hi[j] = asym ? load_param16(p.mins, g_hi * p.ld + col, p.f16_params)
                     : _mm512_mul_ps(s_hi[j], _mm512_set1_ps(-8.0f));
    }
    for (int t = 0; t < 4; ++t) {
      float* dst = part + c0 + 64 * c + 16 * t;
      __m512 o = _mm512_fmadd_ps(acc_lo[c][t], permuted_param(s_lo, t), _mm512_loadu_ps(dst));
      o = _mm512_fmadd_ps(bl, permuted_param(o_lo, t), o);
      o = _mm512_fmadd_ps(acc_hi[c][t], permuted_param(s_hi, t), o);
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(bh, permuted_param(o_hi, t), o));
    }
  }
}

// The same for int8 codes: rows [a, b) of group g, in column order.
template <int C>
void Int8RowSegment(const Problem& p, int64_t c0, int64_t a, int64_t b, int64_t g, float* part,
                    PrefetchStream& ahead) {
  const int8_t* q = static_cast<const int8_t*>(p.values);
  __m512 acc[C][4];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) acc[c][j] = _mm512_setzero_ps();
  for (int64_t i = a; i < b; ++i) {
    const int8_t* row = q + i * p.ld + c0;
    for (int c = 0; c < C; ++c) ahead.Next();
    const __m512 xv = _mm512_set1_ps(p.x[i]);
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(row + 64 * c);
      for (int j = 0; j < 4; ++j)
        acc[c][j] = _mm512_fmadd_ps(xv, i8_to_ps(_mm512_extracti32x4_epi32(v, j)), acc[c][j]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) {
      const __m512 sc = load_param16(p.scales, g * p.ld + c0 + 64 * c + 16 * j, p.f16_params);
      float* dst = part + c0 + 64 * c + 16 * j;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(acc[c][j], sc, _mm512_loadu_ps(dst)));
    }
}

// How a one-row product is cut into work items: ranges of the columns no wider than
// kMaxBlockCols, so that each item's reads are one region of memory walked forward row by row,
// which its prefetches follow and the memory serves faster than many short strided pieces
// (SmolLM2's LM head at one row: 256-column items 1.33 ms, 4096-column ones 1.09); where that
// gives too few items to keep the threads busy, ranges of the code rows too, each summed into
// its own partial row (its 30 layers at one row: 4.5 -> 3.9 ms).
struct RowSplit {
  int64_t parts, col_blocks, block_cols, ahead_rows;
};

constexpr int64_t kMaxBlockCols = 4096;
constexpr int64_t kMinPartRows = 64;       // code rows per row range at least (two groups of 32)
constexpr int64_t kAheadBytes = 32 << 10;  // how far ahead of its reads an item prefetches

RowSplit SplitOneRow(const Problem& p, int64_t threads) {
  const int64_t rows = p.bits == 4 ? p.k / 2 : p.k, chunks = p.n / kWideCols;
  const int64_t narrow_blocks = (p.n + kMaxBlockCols - 1) / kMaxBlockCols;
  RowSplit s;
  s.parts = narrow_blocks >= 4 * threads
                ? 1
                : std::max<int64_t>(1, std::min(threads, rows / kMinPartRows));
  s.col_blocks = std::min(chunks, std::max(narrow_blocks, (threads + s.parts - 1) / s.parts));
  s.block_cols = (chunks + s.col_blocks - 1) / s.col_blocks * kWideCols;
  s.col_blocks = (p.n + s.block_cols - 1) / s.block_cols;
  s.ahead_rows = std::clamp<int64_t>(kAheadBytes / s.block_cols, 8, 24);
  return s;
}

// Code rows [r0, r1), columns [c0, c1) of one row of x, added into `part`.
template <int Bits>
void RowRange(const Problem& p, const RowSplit& split, int64_t r0, int64_t r1, int64_t c0,
              int64_t c1, float* part) {
  PrefetchStream ahead{static_cast<const uint8_t*>(p.values), p.ld, c0, c1,
                       std::min(r1, r0 + split.ahead_rows), r1, c0};
  for (int64_t a = r0; a < r1;) {
    const int64_t g = a / p.group_size, b = std::min(r1, (g + 1) * p.group_size);
    int64_t c = c0;
    if constexpr (Bits == 4) {
      for (; c + 4 * kWideCols <= c1; c += 4 * kWideCols) Int4RowSegment<4>(p, c, a, b, g, part, ahead);
      for (; c + kWideCols <= c1; c += kWideCols) Int4RowSegment<1>(p, c, a, b, g, part, ahead);
    } else {
      for (; c + 4 * kWideCols <= c1; c += 4 * kWideCols) Int8RowSegment<4>(p, c, a, b, g, part, ahead);
      for (; c + kWideCols <= c1; c += kWideCols) Int8RowSegment<1>(p, c, a, b, g, part, ahead);
    }
    a = b;
  }
}

// y = x @ W for one row of x (N a multiple of 64): each work item sums its range of code rows
// over its columns into its own partial row; the partial rows are added at the end (and, for
// int4, put back into column order).
void OneRow(const Problem& p, ffi::ThreadPool& pool) {
  const RowSplit split = SplitOneRow(p, pool.num_threads());
  const int64_t rows = p.bits == 4 ? p.k / 2 : p.k;
  // [parts, N]; a single partial row is y itself (a wide LM head's row is ~200 KB)
  std::vector<float> scratch;
  float* parts = p.y;
  if (split.parts == 1) {
    std::memset(p.y, 0, p.n * sizeof(float));
  } else {
    scratch.assign(split.parts * p.n, 0.0f);
    parts = scratch.data();
  }
  jaxinfer::ParallelFor(pool, split.parts * split.col_blocks, p.k * p.n, [&](int64_t item) {
    const int64_t part = item / split.col_blocks, block = item % split.col_blocks;
    const int64_t c0 = block * split.block_cols, c1 = std::min(p.n, c0 + split.block_cols);
    const int64_t r0 = rows * part / split.parts, r1 = rows * (part + 1) / split.parts;
    float* dst = parts + part * p.n;
    if (p.bits == 4) RowRange<4>(p, split, r0, r1, c0, c1, dst);
    else RowRange<8>(p, split, r0, r1, c0, c1, dst);
  });
  if (p.bits == 8) {
    if (split.parts == 1) return;
    for (int64_t c = 0; c < p.n; c += 16) {
      __m512 o = _mm512_loadu_ps(parts + c);
      for (int64_t i = 1; i < split.parts; ++i)
        o = _mm512_add_ps(o, _mm512_loadu_ps(parts + i * p.n + c));
      _mm512_storeu_ps(p.y + c, o);
    }
    return;
  }
  // Back to column order: y[16 j + e] = out[e % 4][4 j + e / 4] within each 64 columns.
  __m512i idx_a[4], idx_b[4];
  for (int j = 0; j < 4; ++j) {
    alignas(64) int32_t ia[16], ib[16];
    for (int e = 0; e < 16; ++e) {
      ia[e] = (e % 4 == 1 ? 16 : 0) + 4 * j + e / 4;  // out[0] | out[1]
      ib[e] = (e % 4 == 3 ? 16 : 0) + 4 * j + e / 4;  // out[2] | out[3]
    }
    idx_a[j] = _mm512_load_si512(ia);
    idx_b[j] = _mm512_load_si512(ib);
  }
  for (int64_t c0 = 0; c0 < p.n; c0 += kWideCols) {
    __m512 out[4];
    for (int t = 0; t < 4; ++t) {
      out[t] = _mm512_loadu_ps(parts + c0 + 16 * t);
      for (int64_t i = 1; i < split.parts; ++i)
        out[t] = _mm512_add_ps(out[t], _mm512_loadu_ps(parts + i * p.n + c0 + 16 * t));
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 a = _mm512_permutex2var_ps(out[0], idx_a[j], out[1]);
      const __m512 b = _mm512_permutex2var_ps(out[2], idx_b[j], out[3]);
      _mm512_storeu_ps(p.y + c0 + 16 * j, _mm512_mask_blend_ps(0xCCCC, a, b));
    }
  }
}

// Many rows: a panel of the weight (kPanelK values of K by 64 columns) is dequantized once into
// a float buffer on the stack (scales and minimums applied: the exact weights a dense copy
// holds), then every row of x is multiplied against it from L1 in register tiles of kTileRows
// rows x 64 columns. The codes still cross memory once; the conversion is paid once per panel
// instead of once per row pair, so the product is bound by its FMAs, not by widening codes.
constexpr int64_t kPanelK = 64;  // packed rows of codes per panel (int4: 128 values of K)
constexpr int64_t kPanelMinRows = 3;  // fewer rows: widen the codes in registers per row pair
constexpr int kTileRows = 6;

// w[(i - i0) * 64 + c] for packed rows i in [i0, i1): int8 rows of K, or the int4 low nibbles
// (K rows i) in `lo` and high nibbles (K rows K/2 + i) in `hi`.
void DequantPanel(const Problem& p, int64_t c0, int64_t i0, int64_t i1, float* lo, float* hi) {
  const int64_t gs = p.group_size;
  const bool asym = p.mins != nullptr;
  __m512 s_lo[4], s_hi[4], o_lo[4], o_hi[4];
  int64_t group = -1;
  if (p.bits == 8) {
    const int8_t* q = static_cast<const int8_t*>(p.values);
    for (int64_t i = i0; i < i1; ++i) {
      if (i / gs != group) {
        group = i / gs;
        for (int j = 0; j < 4; ++j) s_lo[j] = load_param16(p.scales, group * p.ld + c0 + 16 * j, p.f16_params);
      }
      if (i + kPrefetchRows < i1)
        _mm_prefetch(reinterpret_cast<const char*>(q + (i + kPrefetchRows) * p.ld + c0), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(q + i * p.ld + c0);
      float* out = lo + (i - i0) * kWideCols;
      for (int j = 0; j < 4; ++j)
        _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(i8_to_ps(_mm512_extracti32x4_epi32(v, j)), s_lo[j]));
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const int64_t half_groups = (p.k / 2) / gs;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t i = i0; i < i1; ++i) {
    if (i / gs != group) {
      group = i / gs;
      for (int j = 0; j < 4; ++j) {
        const int64_t col = c0 + 16 * j;
        s_lo[j] = load_param16(p.scales, group * p.ld + col, p.f16_params);
        s_hi[j] = load_param16(p.scales, (group + half_groups) * p.ld + col, p.f16_params);
        // asymmetric: w = q s + min; symmetric: w = (q - 8) s = q s - 8 s (both exact in f32)
        o_lo[j] = asym ? load_param16(p.mins, group * p.ld + col, p.f16_params)
                       : _mm512_mul_ps(s_lo[j], _mm512_set1_ps(-8.0f));
        o_hi[j] = asym ? load_param16(p.mins, (group + half_groups) * p.ld + col, p.f16_params)
                       : _mm512_mul_ps(s_hi[j], _mm512_set1_ps(-8.0f));
      }
    }
    const uint8_t* row = q + i * p.ld + c0;
    if (i + kPrefetchRows < i1)
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * p.ld), _MM_HINT_T0);
    float* out_lo = lo + (i - i0) * kWideCols;
    float* out_hi = hi + (i - i0) * kWideCols;
    for (int h = 0; h < 2; ++h) {  // columns 32 h .. 32 h + 31
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * h));
      const __m256i l = _mm256_and_si256(v, low4);
      const __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int t = 0; t < 2; ++t) {
        const int j = 2 * h + t;
        const __m128i lt = t ? _mm256_extracti128_si256(l, 1) : _mm256_castsi256_si128(l);
        const __m128i ut = t ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
        _mm512_storeu_ps(out_lo + 16 * j, _mm512_fmadd_ps(u8_to_ps(lt), s_lo[j], o_lo[j]));
        _mm512_storeu_ps(out_hi + 16 * j, _mm512_fmadd_ps(u8_to_ps(ut), s_hi[j], o_hi[j]));
      }
    }
  }
}

// y[m0 .. m0 + R, c0 .. c0 + 64] (+)= x[rows, K values of the panel] @ panel. `k_lo` / `k_hi`:
// the K index of the panel's first lo / hi row (hi == nullptr for int8).
template <int R>
void PanelTile(const Problem& p, int64_t m0, int64_t c0, const float* lo, const float* hi,
               int64_t k_lo, int64_t k_hi, int64_t rows, bool first) {
  __m512 acc[R][4];
  float* y = p.y + m0 * p.n + c0;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * p.n + 16 * j);
  const float* x = p.x + m0 * p.k;
  for (int64_t i = 0; i < rows; ++i) {
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(lo + i * kWideCols + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + k_lo + i]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
    if (hi != nullptr) {
      for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(hi + i * kWideCols + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * p.k + k_hi + i]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * p.n + 16 * j, acc[r][j]);
}

// Columns [c0, c0 + 64) of y for every row, panel by panel.
void PanelColumns(const Problem& p, int64_t c0) {
  alignas(64) float lo[kPanelK * kWideCols];
  alignas(64) float hi[kPanelK * kWideCols];
  const bool int4 = p.bits == 4;
  const int64_t packed_rows = int4 ? p.k / 2 : p.k;
  for (int64_t i0 = 0; i0 < packed_rows; i0 += kPanelK) {
    const int64_t i1 = std::min(packed_rows, i0 + kPanelK);
    DequantPanel(p, c0, i0, i1, lo, hi);
    const float* h = int4 ? hi : nullptr;
    const int64_t k_hi = int4 ? p.k / 2 + i0 : 0;
    const bool first = i0 == 0;
    int64_t m0 = 0;
    for (; m0 + kTileRows <= p.m; m0 += kTileRows)
      PanelTile<kTileRows>(p, m0, c0, lo, h, i0, k_hi, i1 - i0, first);
    switch (p.m - m0) {
      case 5: PanelTile<5>(p, m0, c0, lo, h, i0, k_hi, i1 - i0, first); break;
      case 4: PanelTile<4>(p, m0, c0, lo, h, i0, k_hi, i1 - i0, first); break;
      case 3: PanelTile<3>(p, m0, c0, lo, h, i0, k_hi, i1 - i0, first); break;
      case 2: PanelTile<2>(p, m0, c0, lo, h, i0, k_hi, i1 - i0, first); break;
      case 1: PanelTile<1>(p, m0, c0, lo, h, i0, k_hi, i1 - i0, first); break;
      default: break;
    }
  }
}

#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_PANEL_AVX2 1
// The many-row path on CPUs with AVX2 and no AVX-512: as PanelColumns above, a panel of kPanelK2
// code rows by 32 columns dequantized once into f32 buffers, then every row of x multiplied
// against it in register tiles of 6 rows x 16 columns (12 accumulators, 2 weight vectors and a
// broadcast of the 16 registers).
constexpr int64_t kPanelK2 = 64;   // packed rows of codes per panel (int4: 128 values of K)
constexpr int64_t kPanelCols = 32;
constexpr int64_t kPanelMinRows2 = 3;
constexpr int kTileRows2 = 6;

inline __m256 Param8(const void* base, int64_t index, bool f16) {
  if (f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index)));
  }
  return _mm256_loadu_ps(static_cast<const float*>(base) + index);
}

// w[(i - i0) * 32 + c] for packed rows i in [i0, i1): int8 rows of K, or the int4 low nibbles
// (K rows i) in `lo` and high nibbles (K rows K/2 + i) in `hi`; columns [c0, c0 + 32).
void DequantPanel32(const Problem& p, int64_t c0, int64_t i0, int64_t i1, float* lo, float* hi) {
  const int64_t gs = p.group_size;
  const bool asym = p.mins != nullptr;
  __m256 s_lo[4], s_hi[4], o_lo[4], o_hi[4];
  int64_t group = -1;
  if (p.bits == 8) {
    const int8_t* q = static_cast<const int8_t*>(p.values);
    for (int64_t i = i0; i < i1; ++i) {
      if (i / gs != group) {
        group = i / gs;
        for (int j = 0; j < 4; ++j) s_lo[j] = Param8(p.scales, group * p.ld + c0 + 8 * j, p.f16_params);
      }
      if (i + kPrefetchRows < i1)
        _mm_prefetch(reinterpret_cast<const char*>(q + (i + kPrefetchRows) * p.ld + c0), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * p.ld + c0));
      float* out = lo + (i - i0) * kPanelCols;
      const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
      for (int j = 0; j < 4; ++j) {
        const __m128i bytes = j % 2 ? _mm_srli_si128(halves[j / 2], 8) : halves[j / 2];
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(w, s_lo[j]));
      }
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const int64_t half_groups = (p.k / 2) / gs;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t i = i0; i < i1; ++i) {
    if (i / gs != group) {
      group = i / gs;
      for (int j = 0; j < 4; ++j) {
        const int64_t col = c0 + 8 * j;
        s_lo[j] = Param8(p.scales, group * p.ld + col, p.f16_params);
        s_hi[j] = Param8(p.scales, (group + half_groups) * p.ld + col, p.f16_params);
        // asymmetric: w = q s + min; symmetric: w = (q - 8) s = q s - 8 s (both exact in f32)
        o_lo[j] = asym ? Param8(p.mins, group * p.ld + col, p.f16_params)
                       : _mm256_mul_ps(s_lo[j], _mm256_set1_ps(-8.0f));
        o_hi[j] = asym ? Param8(p.mins, (group + half_groups) * p.ld + col, p.f16_params)
                       : _mm256_mul_ps(s_hi[j], _mm256_set1_ps(-8.0f));
      }
    }
    const uint8_t* row = q + i * p.ld + c0;
    if (i + kPrefetchRows < i1)
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * p.ld), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    const __m256i l = _mm256_and_si256(v, low4);
    const __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m128i lh[2] = {_mm256_castsi256_si128(l), _mm256_extracti128_si256(l, 1)};
    const __m128i uh[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
    float* out_lo = lo + (i - i0) * kPanelCols;
    float* out_hi = hi + (i - i0) * kPanelCols;
    for (int j = 0; j < 4; ++j) {
      const __m128i lb = j % 2 ? _mm_srli_si128(lh[j / 2], 8) : lh[j / 2];
      const __m128i ub = j % 2 ? _mm_srli_si128(uh[j / 2], 8) : uh[j / 2];
      _mm256_storeu_ps(out_lo + 8 * j,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lb)), s_lo[j], o_lo[j]));
      _mm256_storeu_ps(out_hi + 8 * j,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ub)), s_hi[j], o_hi[j]));
    }
  }
}

// y[m0 .. m0 + R, c0 .. c0 + 16] (+)= x[rows, K values of the panel] @ the panel's 16 columns
// from `half` (lo / hi: the panel's buffers at that column offset).
template <int R>
void PanelTile16(const Problem& p, int64_t m0, int64_t c0, const float* lo, const float* hi,
                 int64_t k_lo, int64_t k_hi, int64_t rows, bool first) {
  __m256 acc[R][2];
  float* y = p.y + m0 * p.n + c0;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * p.n + 8 * j);
  const float* x = p.x + m0 * p.k;
  for (int64_t i = 0; i < rows; ++i) {
    const __m256 w0 = _mm256_loadu_ps(lo + i * kPanelCols), w1 = _mm256_loadu_ps(lo + i * kPanelCols + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * p.k + k_lo + i);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  if (hi != nullptr) {
    for (int64_t i = 0; i < rows; ++i) {
      const __m256 w0 = _mm256_loadu_ps(hi + i * kPanelCols), w1 = _mm256_loadu_ps(hi + i * kPanelCols + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * p.k + k_hi + i);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(y + r * p.n + 8 * j, acc[r][j]);
}

// Columns [c0, c0 + 32) of y for every row, panel by panel.
void PanelColumns32(const Problem& p, int64_t c0) {
  alignas(32) float lo[kPanelK2 * kPanelCols];
  alignas(32) float hi[kPanelK2 * kPanelCols];
  const bool int4 = p.bits == 4;
  const int64_t packed_rows = int4 ? p.k / 2 : p.k;
  for (int64_t i0 = 0; i0 < packed_rows; i0 += kPanelK2) {
    const int64_t i1 = std::min(packed_rows, i0 + kPanelK2);
    DequantPanel32(p, c0, i0, i1, lo, hi);
    const int64_t k_hi = int4 ? p.k / 2 + i0 : 0;
    const bool first = i0 == 0;
    for (int half = 0; half < 2; ++half) {
      const float* l = lo + 16 * half;
      const float* h = int4 ? hi + 16 * half : nullptr;
      const int64_t c = c0 + 16 * half;
      int64_t m0 = 0;
      for (; m0 + kTileRows2 <= p.m; m0 += kTileRows2)
        PanelTile16<kTileRows2>(p, m0, c, l, h, i0, k_hi, i1 - i0, first);
      switch (p.m - m0) {
        case 5: PanelTile16<5>(p, m0, c, l, h, i0, k_hi, i1 - i0, first); break;
        case 4: PanelTile16<4>(p, m0, c, l, h, i0, k_hi, i1 - i0, first); break;
        case 3: PanelTile16<3>(p, m0, c, l, h, i0, k_hi, i1 - i0, first); break;
        case 2: PanelTile16<2>(p, m0, c, l, h, i0, k_hi, i1 - i0, first); break;
        case 1: PanelTile16<1>(p, m0, c, l, h, i0, k_hi, i1 - i0, first); break;
        default: break;
      }
    }
  }
}

// A product of one to four rows on AVX2 (a decode step's few sequences, memory-bound): the
// codes are widened in registers straight from memory, 8 columns a load (vpmovzxbd /
// vpmovsxbd), and multiplied into every row's accumulators, which stay in registers across a
// group's rows; the group's scale (and minimum, times the group's sum of x) is applied once per
// column. Work is cut as OneRow cuts it: ranges of columns no wider than kFewBlockCols, each
// walked forward row by row with the codes prefetched ahead of the reads, and where that makes
// too few items, ranges of the code rows too, each summed into its own partial result.
constexpr int kFewRowsMax2 = 4;
constexpr int64_t kFewBlockCols = 4096;
constexpr int64_t kFewMinPartRows = 64;     // code rows per row range at least (two groups of 32)
constexpr int64_t kFewAheadCols = 128;  // prefetch distance, in the order the codes are read
constexpr int64_t kLine = 64;           // bytes of codes a prefetch brings (a cache line)

// Where a segment's prefetches go: the codes kFewAheadCols further along the order in which
// the item reads them (within a group's rows 32 columns after 32, then the next group's rows),
// row by row: `base` for the segment's first row, nothing for rows from `rows` on.
struct FewPrefetch {
  const uint8_t* base = nullptr;
  int64_t ld = 0, rows = 0;

  void At(int64_t i) const {  // i: the row within the segment
    if (base != nullptr && i < rows) _mm_prefetch(reinterpret_cast<const char*>(base + i * ld), _MM_HINT_T0);
  }
};

// Code rows [a, b) of half-group g (low nibbles: rows of K in group g; high nibbles: group
// g + K/2/gs), columns [c, c + 8 J) of R rows of x, added into part[r * part_ld + column].
template <int R, int J, int HALF = 0>  // HALF 1 / 2: the low / high nibbles only
void Int4FewSegment(const Problem& p, int64_t c, int64_t a, int64_t b, int64_t g, float* part,
                    int64_t part_ld, const FewPrefetch& ahead) {
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const int64_t kh = p.k / 2, half_groups = kh / p.group_size;
  const __m256i low4 = _mm256_set1_epi32(15);
  __m256 acc_lo[R][J], acc_hi[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc_lo[r][j] = acc_hi[r][j] = _mm256_setzero_ps();
  float sum_lo[R] = {}, sum_hi[R] = {};
  for (int64_t i = a; i < b; ++i) {
    const uint8_t* row = q + i * p.ld + c;
    ahead.At(i - a);
    __m256 xl[R], xh[R];
    for (int r = 0; r < R; ++r) {
      const float l = p.x[r * p.k + i], h = p.x[r * p.k + kh + i];
      sum_lo[r] += l;
      sum_hi[r] += h;
      xl[r] = _mm256_set1_ps(l);
      xh[r] = _mm256_set1_ps(h);
    }
    for (int j = 0; j < J; ++j) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * j)));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      for (int r = 0; r < R; ++r) {
        if (HALF != 2) acc_lo[r][j] = _mm256_fmadd_ps(xl[r], lo, acc_lo[r][j]);
        if (HALF != 1) acc_hi[r][j] = _mm256_fmadd_ps(xh[r], hi, acc_hi[r][j]);
      }
    }
  }
  const bool asym = p.mins != nullptr;
  const int64_t g_hi = g + half_groups;
  for (int j = 0; j < J; ++j) {
    const int64_t col = c + 8 * j;
    const __m256 s_lo = Param8(p.scales, g * p.ld + col, p.f16_params);
    const __m256 s_hi = Param8(p.scales, g_hi * p.ld + col, p.f16_params);
    // asymmetric: w = q s + min; symmetric: w = (q - 8) s = q s - 8 s
    const __m256 o_lo = asym ? Param8(p.mins, g * p.ld + col, p.f16_params)
                             : _mm256_mul_ps(s_lo, _mm256_set1_ps(-8.0f));
    const __m256 o_hi = asym ? Param8(p.mins, g_hi * p.ld + col, p.f16_params)
                             : _mm256_mul_ps(s_hi, _mm256_set1_ps(-8.0f));
    for (int r = 0; r < R; ++r) {
      float* dst = part + r * part_ld + col;
      __m256 o = _mm256_loadu_ps(dst);
      if (HALF != 2) {
        o = _mm256_fmadd_ps(acc_lo[r][j], s_lo, o);
        o = _mm256_fmadd_ps(_mm256_set1_ps(sum_lo[r]), o_lo, o);
      }
      if (HALF != 1) {
        o = _mm256_fmadd_ps(acc_hi[r][j], s_hi, o);
        o = _mm256_fmadd_ps(_mm256_set1_ps(sum_hi[r]), o_hi, o);
      }
      _mm256_storeu_ps(dst, o);
    }
  }
}

// The same for int8 codes: rows [a, b) of group g.
template <int R, int J>
void Int8FewSegment(const Problem& p, int64_t c, int64_t a, int64_t b, int64_t g, float* part,
                    int64_t part_ld, const FewPrefetch& ahead) {
  const int8_t* q = static_cast<const int8_t*>(p.values);
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = a; i < b; ++i) {
    const int8_t* row = q + i * p.ld + c;
    ahead.At(i - a);
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_set1_ps(p.x[r * p.k + i]);
    for (int j = 0; j < J; ++j) {
      const __m256 w = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * j))));
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], w, acc[r][j]);
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t col = c + 8 * j;
    const __m256 s = Param8(p.scales, g * p.ld + col, p.f16_params);
    for (int r = 0; r < R; ++r) {
      float* dst = part + r * part_ld + col;
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(acc[r][j], s, _mm256_loadu_ps(dst)));
    }
  }
}

// Code rows [r0, r1), columns [c0, c1) of R rows of x, added into `part`: group by group, and
// within a group 32 columns (16 from two rows of int4 codes, or three of int8) at a time over the
// group's rows.
template <int R>
void FewRange(const Problem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* part,
              int64_t part_ld) {
  const uint8_t* codes = static_cast<const uint8_t*>(p.values);
  // 8 accumulators of 8 columns: both halves of one row's 32 columns, of two rows' 16, or one
  // half of three or four rows' 16 (the group's rows then read twice, the second time from cache)
  constexpr int J4 = R == 1 ? 4 : 2;
  constexpr int J8 = R <= 2 ? 4 : 2;
  const int64_t width = c1 - c0, cols = 8 * (p.bits == 4 ? J4 : J8);
  for (int64_t a = r0; a < r1;) {
    const int64_t g = a / p.group_size, b = std::min(r1, (g + 1) * p.group_size);
    for (int64_t c = c0; c < c1; c += cols) {
      FewPrefetch ahead;
      if ((c - c0) % kLine == 0) {  // one prefetch a row for each cache line of codes
        int64_t col = c + kFewAheadCols, row = a;
        if (col >= c1) {  // past the block: the next group's rows
          col = width > kFewAheadCols ? col - width : c;
          row = b;
        }
        ahead = {codes + row * p.ld + col, p.ld, r1 - row};
      }
      if (p.bits == 4 && R > 2) {
        Int4FewSegment<R, J4, 1>(p, c, a, b, g, part, part_ld, ahead);
        Int4FewSegment<R, J4, 2>(p, c, a, b, g, part, part_ld, FewPrefetch{});
      } else if (p.bits == 4) Int4FewSegment<R, J4>(p, c, a, b, g, part, part_ld, ahead);
      else Int8FewSegment<R, J8>(p, c, a, b, g, part, part_ld, ahead);
    }
    a = b;
  }
}

// y = x @ W for 1 .. kFewRowsMax2 rows of x (N a multiple of 32): each work item sums its range
// of code rows over its columns into its own partial result [M, N]; those are added at the end.
void FewRows(const Problem& p, ffi::ThreadPool& pool) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t rows = p.bits == 4 ? p.k / 2 : p.k, chunks = p.n / kCols;
  const int64_t narrow_blocks = (p.n + kFewBlockCols - 1) / kFewBlockCols;
  const int64_t parts = narrow_blocks >= 4 * threads
                            ? 1
                            : std::max<int64_t>(1, std::min(threads, rows / kFewMinPartRows));
  int64_t col_blocks = std::min(chunks, std::max(narrow_blocks, (threads + parts - 1) / parts));
  const int64_t block_cols = (chunks + col_blocks - 1) / col_blocks * kCols;
  col_blocks = (p.n + block_cols - 1) / block_cols;
  const int64_t size = p.m * p.n;
  std::vector<float> scratch;
  float* out = p.y;  // [parts, M, N]; a single partial result is y itself
  if (parts == 1) {
    std::memset(p.y, 0, size * sizeof(float));
  } else {
    scratch.assign(parts * size, 0.0f);
    out = scratch.data();
  }
  jaxinfer::ParallelFor(pool, parts * col_blocks, p.m * p.k * p.n, [&](int64_t item) {
    const int64_t part = item / col_blocks, block = item % col_blocks;
    const int64_t c0 = block * block_cols, c1 = std::min(p.n, c0 + block_cols);
    const int64_t r0 = rows * part / parts, r1 = rows * (part + 1) / parts;
    float* dst = out + part * size;
    switch (p.m) {
      case 1: FewRange<1>(p, r0, r1, c0, c1, dst, p.n); break;
      case 2: FewRange<2>(p, r0, r1, c0, c1, dst, p.n); break;
      case 3: FewRange<3>(p, r0, r1, c0, c1, dst, p.n); break;
      default: FewRange<4>(p, r0, r1, c0, c1, dst, p.n); break;
    }
  });
  if (parts == 1) return;
  for (int64_t e = 0; e < size; e += 8) {
    __m256 o = _mm256_loadu_ps(out + e);
    for (int64_t i = 1; i < parts; ++i) o = _mm256_add_ps(o, _mm256_loadu_ps(out + i * size + e));
    _mm256_storeu_ps(p.y + e, o);
  }
}
#endif

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
  int64_t c = c0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (p.m >= kPanelMinRows) {
    for (; c + kWideCols <= c1; c += kWideCols) PanelColumns(p, c);
  }
  for (; c + kWideCols <= c1; c += kWideCols) {
    int64_t m0 = 0;
    for (; m0 + 2 <= p.m; m0 += 2) {
      if (p.bits == 8) Int8BlockAvx512<2>(p, m0, c); else Int4BlockAvx512<2>(p, m0, c);
    }
    for (; m0 < p.m; ++m0) {
      if (p.bits == 8) Int8BlockAvx512<1>(p, m0, c); else Int4BlockAvx512<1>(p, m0, c);
    }
  }
#elif defined(JAXINFER_PANEL_AVX2)
  if (p.m >= kPanelMinRows2) {
    for (; c + kPanelCols <= c1; c += kPanelCols) PanelColumns32(p, c);
  }
#endif
  for (; c < c1; c += kCols) {
    int64_t m0 = 0;
    for (; m0 + kRows <= p.m; m0 += kRows) Block<kRows>(p, m0, c);
    for (; m0 < p.m; ++m0) Block<1>(p, m0, c);
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                           ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                           ffi::Buffer<ffi::S32> num_rows, int64_t bits, int64_t group_size,
                           int64_t has_mins, ffi::ResultBuffer<ffi::F32> y) {
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
  p.m = jaxinfer::RealRows(num_rows.typed_data(), xd[0]);
  p.k = xd[1];
  p.n = y->dimensions()[1];
  p.ld = vd[1];
  p.group_size = group_size;
  if (p.n % kCols != 0) {
    return ffi::Error::InvalidArgument("the number of output columns must be a multiple of 32");
  }
  if (p.n > p.ld || scales.dimensions().back() != p.ld) {
    return ffi::Error::InvalidArgument("values and scales must have as many columns, at least N");
  }
  jaxinfer::ZeroRowsFrom(p.y, p.m, xd[0], p.n);
  if (p.m == 0) return ffi::Error::Success();
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (p.m == 1 && p.n % kWideCols == 0) {
    OneRow(p, pool);
    return ffi::Error::Success();
  }
#endif
#if defined(JAXINFER_PANEL_AVX2)
  if (p.m <= kFewRowsMax2) {
    FewRows(p, pool);
    return ffi::Error::Success();
  }
#endif
  jaxinfer::ParallelFor(pool, (p.n + kItemCols - 1) / kItemCols, p.m * p.k * p.n, [&](int64_t i) {
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
    load_params(sc + (g * p.ld + c0) * psize, p.f16_params, width, scale.data());
    if (p.mins != nullptr) load_params(mn + (g * p.ld + c0) * psize, p.f16_params, width, minimum.data());
    for (int64_t k = g * gs; k < std::min(p.k, (g + 1) * gs); ++k) {
      float* out = w + k * p.n + c0;
      if (p.bits == 8) {
        const int8_t* q = static_cast<const int8_t*>(p.values) + k * p.ld + c0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) out[j] = static_cast<float>(q[j]) * scale[j];
      } else {
        const int64_t kh = (p.k + 1) / 2;
        const uint8_t* q = static_cast<const uint8_t*>(p.values) + (k % kh) * p.ld + c0;
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
  p.n = w->dimensions()[1];
  p.ld = values.dimensions()[1];
  p.group_size = group_size;
  if (p.n > p.ld || scales.dimensions().back() != p.ld) {
    return ffi::Error::InvalidArgument("values and scales must have as many columns, at least N");
  }
  float* out = w->typed_data();
  jaxinfer::ParallelFor(pool, (p.n + kItemCols - 1) / kItemCols, p.k * p.n, [&](int64_t i) {
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_rows i32[1]: real rows
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_mins")
                                  .Ret<ffi::Buffer<ffi::F32>>());
