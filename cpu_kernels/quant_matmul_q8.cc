// y = x @ W for a quantized weight W[K, N] with x rounded to 8 bits (an XLA FFI custom call,
// quant_matmul.py's `int8_activations`): the products are integer dot products, as llama.cpp
// computes them, instead of f32 multiply-adds.
//
// Each row of x is quantized per group of the weight's K (the weight's own groups), symmetric:
//   d[m, g] = max_{k in g} |x[m, k]| / 127,   xq[m, k] = round(x[m, k] / d[m, g])  (int8)
// and each group's integer dot product is exact in int32, then scaled in f32:
//   y[m, n] = sum_g scale[g, n] d[m, g] sum_{k in g} xq[m, k] q[k, n]
//             (+ min[g, n] sum_{k in g} x[m, k]: the exact sum of x, for asymmetric int4)
// with q the weight's codes as stored (int4 0..15, symmetric ones offset by 8 through the
// minimum term, min = -8 scale; int8 -127..127). The weight layout is QuantizedWeight's (see
// quant_matmul.cc). This changes the numbers (x is rounded to ~2 significant digits per group),
// so it is an opt-in: `jaxinfer eval-ppl` measures what it costs.
//
// Why: with AVX-512 VNNI a vpdpbusd multiplies 64 byte pairs and sums them by four into 16
// int32 lanes, four times the multiply-adds of an f32 FMA, so a few rows of x (a speculative
// verification, a small batch) cost little more than one. The codes of 4 consecutive rows of K
// are interleaved so each int32 lane holds one column's 4 codes (byte unpacks of the 64-column
// rows), once per 32 rows of K and 64 columns into a buffer in L1; every row of x then runs over
// that buffer in tiles of up to 3 rows, a broadcast of its 4 int8 values against each vector.
// A work item is a range of columns (ItemBlocks), its code rows read forward part by part.
// With AVX2 and no VNNI, vpmaddubsw and vpmaddwd compute the same exact sums (Avx2Columns); with
// neither, a plain C++ loop.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "quant_params.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAXINFER_Q8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_Q8_AVX2 1
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jaxinfer::load_params;

constexpr int64_t kCols = 64;  // output columns of a block (a work item takes several)
constexpr int64_t kRowPad = 16;  // AMX tile rows: xq's rows are padded to a multiple of this
constexpr int64_t kAmxMinRows = 32;  // the fewest rows of x that go through AMX (see AmxRows)

struct Problem {
  const void* values;
  const void* scales;
  const void* mins;  // nullptr: symmetric (or int8)
  bool f16_params;
  int bits;
  int64_t m, k, n, group_size;
  int64_t ld;  // the row stride of values, scales and mins: N, or more (quant_matmul.cc)
  // x quantized (QuantizeRows)
  const int8_t* xq;   // [M, K]
  const uint8_t* xu;  // [M, K] xq + 128 (int8 weights: vpdpbusd takes one unsigned side)
  const float* xd;    // [M, G] the step d of each row's group
  const float* xs;    // [M, G] the exact sum of each row's group of x
  int64_t num_groups;
};

void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t gs, int8_t* xq, uint8_t* xu,
                  float* xd, float* xs) {
  const int64_t num_groups = (k + gs - 1) / gs;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t k0 = g * gs, k1 = std::min(k, k0 + gs);
      const float* row = x + r * k;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if ((k1 - k0) % 16 == 0) {  // the same rounding (to nearest even) 16 values at a time
        __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
        for (int64_t i = k0; i < k1; i += 16) {
          const __m512 v = _mm512_loadu_ps(row + i);
          vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
          vsum = _mm512_add_ps(vsum, v);
        }
        const float d = _mm512_reduce_max_ps(vmax) / 127.0f;
        const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        for (int64_t i = k0; i < k1; i += 16) {
          const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), inv));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + i), _mm512_cvtepi32_epi8(q));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xu + r * k + i),
                           _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
        }
        xd[r * num_groups + g] = d;
        xs[r * num_groups + g] = _mm512_reduce_add_ps(vsum);
        continue;
      }
#endif
      float amax = 0.0f, sum = 0.0f;
      for (int64_t i = k0; i < k1; ++i) {
        amax = std::max(amax, std::fabs(row[i]));
        sum += row[i];
      }
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      for (int64_t i = k0; i < k1; ++i) {
        const int q = static_cast<int>(std::nearbyint(row[i] * inv));
        xq[r * k + i] = static_cast<int8_t>(q);
        xu[r * k + i] = static_cast<uint8_t>(q + 128);
      }
      xd[r * num_groups + g] = d;
      xs[r * num_groups + g] = sum;
    }
  }
}

inline int Code(const Problem& p, int64_t kk, int64_t col) {
  if (p.bits == 8) return static_cast<const int8_t*>(p.values)[kk * p.ld + col];
  const int64_t kh = p.k / 2;
  const uint8_t byte = static_cast<const uint8_t*>(p.values)[(kk % kh) * p.ld + col];
  return kk < kh ? (byte & 15) : (byte >> 4);
}

// The same sums in plain loops: columns [c0, c1), every row (CPUs without AVX-512 VNNI).
void PlainColumns(const Problem& p, float* y, int64_t c0, int64_t c1) {
  const int64_t gs = p.group_size, width = c1 - c0;
  const size_t psize = p.f16_params ? 2 : 4;
  std::vector<float> scale(width), minimum(width, 0.0f);
  std::vector<int32_t> dot(width);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t j = 0; j < width; ++j) y[r * p.n + c0 + j] = 0.0f;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    load_params(static_cast<const char*>(p.scales) + (g * p.ld + c0) * psize, p.f16_params, width,
                scale.data());
    if (p.mins != nullptr) {
      load_params(static_cast<const char*>(p.mins) + (g * p.ld + c0) * psize, p.f16_params, width,
                  minimum.data());
    } else if (p.bits == 4) {
      for (int64_t j = 0; j < width; ++j) minimum[j] = -8.0f * scale[j];
    }
    const int64_t k0 = g * gs, k1 = std::min(p.k, k0 + gs);
    for (int64_t r = 0; r < p.m; ++r) {
      std::fill(dot.begin(), dot.end(), 0);
      for (int64_t kk = k0; kk < k1; ++kk) {
        const int xv = p.xq[r * p.k + kk];
        for (int64_t j = 0; j < width; ++j) dot[j] += xv * Code(p, kk, c0 + j);
      }
      const float d = p.xd[r * p.num_groups + g], s = p.xs[r * p.num_groups + g];
      for (int64_t j = 0; j < width; ++j) {
        y[r * p.n + c0 + j] += static_cast<float>(dot[j]) * (scale[j] * d) + minimum[j] * s;
      }
    }
  }
}

#if defined(JAXINFER_Q8_VNNI) || defined(JAXINFER_Q8_AVX2)
// The chunks of a whole part (kPartK rows of K), the usual case: a loop of constant length,
// unrolled, so the compiler keeps the sums in place (with the length a variable, GCC copied
// every accumulator from register to register on each chunk; 16-256 rows of x were 1.05-1.16x
// slower so).
constexpr int64_t kPartChunks = 8;

constexpr int64_t kPartK = 32;  // rows of K interleaved at a time (a group may have several)
static_assert(kPartK == 4 * kPartChunks);
// 64-column blocks of a work item. Each item walks its code rows forward, so the wider it is,
// the longer the run of memory each code row gives it (a few rows of x are bound by reading the
// codes); its [M, width] f32 accumulators bound it from above, and the threads want items to
// share. Columns are independent, so the width never changes a result.
constexpr int64_t kMinItemBlocks = 4;      // 256 columns
constexpr int64_t kMaxItemBlocks = 64;     // 4096 columns
constexpr int64_t kItemAccFloats = 16384;  // 64 KB of accumulators

// Blocks an item takes: the widest whose items the threads share most evenly (items of
// `width` blocks and a last one of the rest, each to the least loaded thread, as the shared
// counter hands them out). Widths are tried from the widest down, and the first that gives every
// thread its even share ends the search (it runs on every call: SmolLM2's matrices find it in
// 1-25 tries).
int64_t ItemBlocks(int64_t m, int64_t block_count, int64_t threads) {
  const int64_t widest = std::clamp<int64_t>(kItemAccFloats / (kCols * std::max<int64_t>(1, m)),
                                             kMinItemBlocks, kMaxItemBlocks);
  threads = std::clamp<int64_t>(threads, 1, 64);
  const int64_t even = (block_count + threads - 1) / threads;  // no width does better
  int64_t best = 1, best_load = block_count + 1;
  for (int64_t width = std::min(widest, block_count); width >= 1; --width) {
    int64_t load[64] = {};
    for (int64_t start = 0; start < block_count; start += width) {
      int64_t* least = std::min_element(load, load + threads);
      *least += std::min(width, block_count - start);
    }
    const int64_t most = *std::max_element(load, load + threads);
    if (most < best_load) best = width, best_load = most;
    if (most == even) break;
  }
  return best;
}

// What an item prefetches: the code rows it reads `kAheadBlocks` blocks of kPartK rows from
// now (its blocks are read part by part, block by block), from `base` (those rows' first, at
// that block's columns), `rows` of them before the last code row. A prefetch that far ahead in
// the item's own order arrives in time and is not evicted before its use, however wide the item.
// Into L2, not L1: with L1 as the target, a row of x took 1.3x as long (the prefetches' fills
// then compete with the interleave's own loads for L1's miss buffers), 9 rows 1.05-1.1x.
constexpr int64_t kAheadBlocks = 2;

struct Ahead {
  const uint8_t* base = nullptr;  // nullptr: past the last code row
  int64_t rows = 0;

  Ahead(const Problem& p, int64_t c0, int blocks, int b, int64_t row0, int64_t code_rows) {
    const int64_t next = b + kAheadBlocks, r = row0 + next / blocks * kPartK;
    if (r >= code_rows) return;
    base = static_cast<const uint8_t*>(p.values) + r * p.ld + c0 + 64 * (next % blocks);
    rows = code_rows - r;
  }

  void Fetch(int64_t i, int64_t n) const {  // the i-th code row from base
    if (i < rows) _mm_prefetch(reinterpret_cast<const char*>(base + i * n), _MM_HINT_T1);
  }
};

#endif

#if defined(JAXINFER_Q8_VNNI)
constexpr int kTileRows = 3;  // 3 rows x 8 int32 accumulators + broadcasts fit the 32 registers

// 4 rows of 64 bytes (a, b, c, d: rows k .. k + 3 of 64 columns) -> 4 vectors of one dword a
// column, bytes (a, b, c, d): out[v] lane 4 L + e holds column 16 L + 4 v + e (the byte
// unpacks work within 128-bit lanes).
inline void Interleave4(__m512i a, __m512i b, __m512i c, __m512i d, __m512i* out) {
  const __m512i t0 = _mm512_unpacklo_epi8(a, b), t1 = _mm512_unpackhi_epi8(a, b);
  const __m512i t2 = _mm512_unpacklo_epi8(c, d), t3 = _mm512_unpackhi_epi8(c, d);
  out[0] = _mm512_unpacklo_epi16(t0, t2);
  out[1] = _mm512_unpackhi_epi16(t0, t2);
  out[2] = _mm512_unpacklo_epi16(t1, t3);
  out[3] = _mm512_unpackhi_epi16(t1, t3);
}

// A parameter of 64 columns (s[L]: columns 16 L .. 16 L + 15) in the order of Interleave4's
// vector v: lane 4 L + e = s[L][4 v + e].
inline __m512 Permuted(const __m512 s[4], int v) {
  const int b = 4 * v;
  const __m512i idx = _mm512_set_epi32(b + 19, b + 18, b + 17, b + 16, b + 3, b + 2, b + 1, b,
                                       b + 19, b + 18, b + 17, b + 16, b + 3, b + 2, b + 1, b);
  return _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(s[0], idx, s[1]),
                              _mm512_permutex2var_ps(s[2], idx, s[3]));
}

inline void LoadPermuted(const void* base, int64_t index, bool f16, __m512* out) {
  __m512 s[4];
  for (int j = 0; j < 4; ++j) s[j] = jaxinfer::load_param16(base, index + 16 * j, f16);
  for (int v = 0; v < 4; ++v) out[v] = Permuted(s, v);
}

// One row's exact group products (dot: 64 columns, permuted order) scaled into its 64 f32
// accumulators at o: o += dot * (scale * d) (+ minimum * the exact sum of x). Shared by the
// vpdpbusd and AMX paths, so a row's result is the same bit for bit whichever computes it.
inline void AddScaled(const Problem& p, int64_t row, int64_t g, const __m512i dot[4],
                      const __m512 scale[4], const __m512* minimum, float* o) {
  const __m512 d = _mm512_set1_ps(p.xd[row * p.num_groups + g]);
  const __m512 s = _mm512_set1_ps(p.xs[row * p.num_groups + g]);
  for (int v = 0; v < 4; ++v) {
    __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[v]), _mm512_mul_ps(scale[v], d),
                               _mm512_loadu_ps(o + 16 * v));
    if (minimum != nullptr) y = _mm512_fmadd_ps(minimum[v], s, y);
    _mm512_storeu_ps(o + 16 * v, y);
  }
}

// One chunk (4 rows of K from k0, interleaved: w[0..3]) into the sums of rows [m0, m0 + R).
// kInt8: int8 weights, (x + 128) . w (the 128 . w part is taken off after); else int4 codes . x.
template <int R, bool kInt8>
inline void Chunk(const Problem& p, int64_t m0, int64_t k0, const __m512i* w, __m512i acc[R][4]) {
  for (int r = 0; r < R; ++r) {
    int32_t four;
    if (kInt8) {
      std::memcpy(&four, p.xu + (m0 + r) * p.k + k0, 4);
    } else {
      std::memcpy(&four, p.xq + (m0 + r) * p.k + k0, 4);
    }
    const __m512i xb = _mm512_set1_epi32(four);
    for (int v = 0; v < 4; ++v) {
      acc[r][v] = kInt8 ? _mm512_dpbusd_epi32(acc[r][v], xb, w[v])
                        : _mm512_dpbusd_epi32(acc[r][v], w[v], xb);
    }
  }
}

// The contribution of rows k0 .. k0 + 4 chunks of K (within param group g) to rows [m0, m0 + R)
// of x: `w` their interleaved codes (chunks of 4 rows of K, 4 vectors each). out: [M, 64]
// accumulators in the permuted column order.
template <int R, bool kInt8>
inline void Tile(const Problem& p, int64_t m0, int64_t g, int64_t k0, int64_t chunks,
                 const __m512i* w, const __m512i* corr, const __m512 scale[4],
                 const __m512* minimum, float* out, int64_t out_stride) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
  if (chunks == kPartChunks) {
#pragma GCC unroll 8
    for (int64_t ch = 0; ch < kPartChunks; ++ch)
      Chunk<R, kInt8>(p, m0, k0 + 4 * ch, w + 4 * ch, acc);
  } else {
    for (int64_t ch = 0; ch < chunks; ++ch) Chunk<R, kInt8>(p, m0, k0 + 4 * ch, w + 4 * ch, acc);
  }
  for (int r = 0; r < R; ++r) {
    __m512i dot[4];
    for (int v = 0; v < 4; ++v) dot[v] = kInt8 ? _mm512_sub_epi32(acc[r][v], corr[v]) : acc[r][v];
    AddScaled(p, m0 + r, g, dot, scale, minimum, out + (m0 + r) * out_stride);
  }
}

template <bool kInt8>
inline void Rows(const Problem& p, int64_t g, int64_t k0, int64_t chunks, const __m512i* w,
                 const __m512i* corr, const __m512 scale[4], const __m512* minimum, float* out,
                 int64_t out_stride) {
  int64_t m0 = 0;
  for (; m0 + kTileRows <= p.m; m0 += kTileRows)
    Tile<kTileRows, kInt8>(p, m0, g, k0, chunks, w, corr, scale, minimum, out, out_stride);
  if (p.m - m0 == 2) Tile<2, kInt8>(p, m0, g, k0, chunks, w, corr, scale, minimum, out, out_stride);
  if (p.m - m0 == 1) Tile<1, kInt8>(p, m0, g, k0, chunks, w, corr, scale, minimum, out, out_stride);
}


#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define JAXINFER_Q8_AMX 1
// AMX (where the CPU has AMX-INT8 and Linux grants the tile state): from kAmxMinRows rows of x
// up, each 32-row part of K is one tile product per 16 columns: A = 16 rows of xq (32 bytes
// each; xq is padded with zero rows), B = the part's interleaved codes (8 rows of 64 bytes:
// Interleave4's vector v of each chunk, 256 bytes apart in the buffer), C = the rows' exact int32
// dot products, the same integers vpdpbusd sums, scaled by the same AddScaled, so a row's
// result is bit for bit the same whichever path its step takes. From kAmxMinRows = 32 rows: at
// 4-16 rows it is no faster than vpdpbusd (the epilogue, which stores, reloads and scales every
// group's products, costs as much as the products), and a tile costs the same for 9 rows as for
// 16, which misled speculation's calibration (docs/performance.md, the AMX table).
constexpr int kAmxTileRows = kRowPad;

// Linux gives a process the tile state only when asked for it (once, for every thread).
bool AmxUsable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: A (rows x 32 bytes), tmm1: B (8 x 64 bytes), tmm2..tmm5: C of the 4 vectors (rows x 64)
inline void ConfigureTiles(int rows) {
  TileConfig c;
  c.colsb[0] = 32;
  c.rows[0] = static_cast<uint8_t>(rows);
  c.colsb[1] = 64;
  c.rows[1] = 8;
  for (int t = 2; t < 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(rows);
  }
  _tile_loadconfig(&c);
}

// Rows<>'s contract on AMX, for a full part (8 chunks), the tiles configured (16 rows; xq is
// padded with zero rows to a multiple of 16).
template <bool kInt8>
inline void AmxRows(const Problem& p, int64_t g, int64_t k0, const __m512i* w,
                    const __m512 scale[4], const __m512* minimum, float* out,
                    int64_t out_stride) {
  alignas(64) int32_t dots[4][kAmxTileRows][16];
  for (int64_t m0 = 0; m0 < p.m; m0 += kAmxTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAmxTileRows, p.m - m0));
    _tile_loadd(0, p.xq + m0 * p.k + k0, p.k);
#define JAXINFER_Q8_TILE(V, C)                                              \
    _tile_zero(C);                                                           \
    _tile_loadd(1, w + V, 4 * sizeof(__m512i));                              \
    if (kInt8) {                                                             \
      _tile_dpbssd(C, 0, 1);                                                 \
    } else {                                                                 \
      _tile_dpbsud(C, 0, 1);                                                 \
    }                                                                        \
    _tile_stored(C, dots[V], 16 * sizeof(int32_t));
    JAXINFER_Q8_TILE(0, 2)  // the tile numbers must be literals
    JAXINFER_Q8_TILE(1, 3)
    JAXINFER_Q8_TILE(2, 4)
    JAXINFER_Q8_TILE(3, 5)
#undef JAXINFER_Q8_TILE
    for (int r = 0; r < rows; ++r) {
      __m512i dot[4];
      for (int v = 0; v < 4; ++v) dot[v] = _mm512_load_si512(dots[v][r]);
      AddScaled(p, m0 + r, g, dot, scale, minimum, out + (m0 + r) * out_stride);
    }
  }
}
#endif

// One block's part of the int4 codes: packed rows [i0, i0 + 4 chunks) of columns [col, col + 64),
// low nibbles (rows i of K) into lo, high ones (rows K/2 + i) into hi, prefetching `ahead`.
inline void UnpackInt4(const Problem& p, int64_t col, int64_t i0, int64_t chunks, __m512i* lo,
                       __m512i* hi, const Ahead& ahead) {
  const uint8_t* q = static_cast<const uint8_t*>(p.values);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* row = q + (i0 + 4 * ch) * p.ld + col;
    __m512i l[4], h[4];
    for (int t = 0; t < 4; ++t) {
      ahead.Fetch(4 * ch + t, p.ld);
      const __m512i v = _mm512_loadu_si512(row + t * p.ld);
      l[t] = _mm512_and_si512(v, low4);
      h[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    Interleave4(l[0], l[1], l[2], l[3], lo + 4 * ch);
    Interleave4(h[0], h[1], h[2], h[3], hi + 4 * ch);
  }
}

// Columns [c0, c0 + 64 blocks) of every row into out ([M, 64 blocks], each block's 64 in the
// permuted order).
void VnniColumns(const Problem& p, int64_t c0, int blocks, float* out) {
  const int64_t gs = p.group_size, ow = kCols * blocks;
#ifdef JAXINFER_Q8_AMX
  const bool amx = p.m >= kAmxMinRows && gs % kPartK == 0 &&
                   (p.bits == 4 ? (p.k / 2) % kPartK : p.k % kPartK) == 0 && AmxUsable();
  if (amx) ConfigureTiles(kAmxTileRows);
#else
  constexpr bool amx = false;
#endif
  alignas(64) __m512i lo[kPartK], hi[kPartK];  // one block's kPartK / 4 chunks x 4 vectors
  __m512 s_lo[4], s_hi[4], o_lo[4], o_hi[4];
  if (p.bits == 4) {
    const int64_t half_groups = (p.k / 2) / gs;
    const __m512 minus8 = _mm512_set1_ps(-8.0f);
    for (int64_t g = 0; g < half_groups; ++g) {
      const int64_t g_hi = g + half_groups;
      for (int64_t i0 = g * gs; i0 < (g + 1) * gs; i0 += kPartK) {
        const int64_t chunks = (std::min((g + 1) * gs, i0 + kPartK) - i0) / 4;
        for (int b = 0; b < blocks; ++b) {
          const int64_t col = c0 + 64 * b;
          UnpackInt4(p, col, i0, chunks, lo, hi, Ahead(p, c0, blocks, b, i0, p.k / 2));
          LoadPermuted(p.scales, g * p.ld + col, p.f16_params, s_lo);
          LoadPermuted(p.scales, g_hi * p.ld + col, p.f16_params, s_hi);
          // the minimum term once per group, with the group's first part
          const bool first = i0 == g * gs;
          if (first && p.mins != nullptr) {
            LoadPermuted(p.mins, g * p.ld + col, p.f16_params, o_lo);
            LoadPermuted(p.mins, g_hi * p.ld + col, p.f16_params, o_hi);
          } else if (first) {
            for (int v = 0; v < 4; ++v) {
              o_lo[v] = _mm512_mul_ps(s_lo[v], minus8);
              o_hi[v] = _mm512_mul_ps(s_hi[v], minus8);
            }
          }
#ifdef JAXINFER_Q8_AMX
          if (amx) {
            AmxRows<false>(p, g, i0, lo, s_lo, first ? o_lo : nullptr, out + 64 * b, ow);
            AmxRows<false>(p, g_hi, p.k / 2 + i0, hi, s_hi, first ? o_hi : nullptr, out + 64 * b,
                           ow);
            continue;
          }
#endif
          Rows<false>(p, g, i0, chunks, lo, nullptr, s_lo, first ? o_lo : nullptr, out + 64 * b,
                      ow);
          Rows<false>(p, g_hi, p.k / 2 + i0, chunks, hi, nullptr, s_hi, first ? o_hi : nullptr,
                      out + 64 * b, ow);
        }
      }
    }
#ifdef JAXINFER_Q8_AMX
    if (amx) _tile_release();
#endif
    return;
  }
  const int8_t* q = static_cast<const int8_t*>(p.values);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t g_end = std::min(p.k, (g + 1) * gs);
    for (int64_t k0 = g * gs; k0 < g_end; k0 += kPartK) {
      const int64_t chunks = (std::min(g_end, k0 + kPartK) - k0) / 4;
      for (int b = 0; b < blocks; ++b) {
        const Ahead ahead(p, c0, blocks, b, k0, p.k);
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const int8_t* row = q + (k0 + 4 * ch) * p.ld + c0 + 64 * b;
          __m512i r[4];
          for (int t = 0; t < 4; ++t) {
            ahead.Fetch(4 * ch + t, p.ld);
            r[t] = _mm512_loadu_si512(row + t * p.ld);
          }
          Interleave4(r[0], r[1], r[2], r[3], lo + 4 * ch);
        }
#ifdef JAXINFER_Q8_AMX
        if (amx) {  // signed x times signed codes: no correction
          LoadPermuted(p.scales, g * p.ld + c0 + 64 * b, p.f16_params, s_lo);
          AmxRows<true>(p, g, k0, lo, s_lo, nullptr, out + 64 * b, ow);
          continue;
        }
#endif
        __m512i corr[4];  // 128 . w of the part, per column
        for (int v = 0; v < 4; ++v) {
          corr[v] = _mm512_setzero_si512();
          for (int64_t ch = 0; ch < chunks; ++ch)
            corr[v] = _mm512_dpbusd_epi32(corr[v], bias, lo[4 * ch + v]);
        }
        LoadPermuted(p.scales, g * p.ld + c0 + 64 * b, p.f16_params, s_lo);
        Rows<true>(p, g, k0, chunks, lo, corr, s_lo, nullptr, out + 64 * b, ow);
      }
    }
  }
#ifdef JAXINFER_Q8_AMX
  if (amx) _tile_release();
#endif
}

// out ([M, 64 blocks], permuted order) -> y[:, c0 .. c0 + 64 blocks)
void StoreColumns(const Problem& p, const float* out, int blocks, float* y, int64_t c0) {
  for (int64_t r = 0; r < p.m; ++r) {
    for (int b = 0; b < blocks; ++b) {
      const float* o = out + r * kCols * blocks + 64 * b;
      float* dst = y + r * p.n + c0 + 64 * b;
      for (int v = 0; v < 4; ++v)
        for (int lane = 0; lane < 16; ++lane)
          dst[16 * (lane / 4) + 4 * v + lane % 4] = o[16 * v + lane];
    }
  }
}
#endif

#if defined(JAXINFER_Q8_AVX2)
// AVX2 without VNNI: the same exact integer sums, from vpmaddubsw (unsigned x signed bytes, each
// pair summed into an int16) and vpmaddwd by ones (pairs of those into an int32), as llama.cpp
// computes its quantized dot products on such CPUs. A 64-column block is taken as two halves of
// 32 columns; a half's 4 rows of K interleave as the AVX-512 path's do, within 128-bit lanes:
// vector v, dword 4 L + e holds column 16 L + 4 v + e of the half (L = 0, 1).
constexpr int64_t kHalfCols = 32;
// 2 rows: 8 sums, 2 broadcasts and a vector of codes fit the 16 registers (tiles of 3 rows
// spilled: the 30 layers of benchmarks/cpu_matmul.py 1.3-1.5x slower at 9 and 16 rows)
constexpr int kAvx2TileRows = 2;

inline void Interleave4(__m256i a, __m256i b, __m256i c, __m256i d, __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi8(a, b), t1 = _mm256_unpackhi_epi8(a, b);
  const __m256i t2 = _mm256_unpacklo_epi8(c, d), t3 = _mm256_unpackhi_epi8(c, d);
  out[0] = _mm256_unpacklo_epi16(t0, t2);
  out[1] = _mm256_unpackhi_epi16(t0, t2);
  out[2] = _mm256_unpacklo_epi16(t1, t3);
  out[3] = _mm256_unpackhi_epi16(t1, t3);
}

inline __m128 Load4(const void* base, int64_t index, bool f16) {
  if (f16) {
#if defined(__F16C__)
    return _mm_cvtph_ps(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index)));
#else
    const uint16_t* h = static_cast<const uint16_t*>(base) + index;
    return _mm_setr_ps(jaxinfer::half_to_float(h[0]), jaxinfer::half_to_float(h[1]),
                       jaxinfer::half_to_float(h[2]), jaxinfer::half_to_float(h[3]));
#endif
  }
  return _mm_loadu_ps(static_cast<const float*>(base) + index);
}

// A parameter row's 32 columns from `index` in the interleaved order: out[v] lane 4 L + e =
// column 16 L + 4 v + e.
inline void LoadPermuted(const void* base, int64_t index, bool f16, __m256* out) {
  for (int v = 0; v < 4; ++v)
    out[v] = _mm256_set_m128(Load4(base, index + 16 + 4 * v, f16), Load4(base, index + 4 * v, f16));
}

// As the AVX-512 path's AddScaled, 32 columns: o += dot * (scale * d) (+ minimum * sum of x).
inline void AddScaled(const Problem& p, int64_t row, int64_t g, const __m256i dot[4],
                      const __m256 scale[4], const __m256* minimum, float* o) {
  const __m256 d = _mm256_set1_ps(p.xd[row * p.num_groups + g]);
  const __m256 s = _mm256_set1_ps(p.xs[row * p.num_groups + g]);
  for (int v = 0; v < 4; ++v) {
    __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[v]), _mm256_mul_ps(scale[v], d),
                               _mm256_loadu_ps(o + 8 * v));
    if (minimum != nullptr) y = _mm256_fmadd_ps(minimum[v], s, y);
    _mm256_storeu_ps(o + 8 * v, y);
  }
}

inline __m256i Broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

// int4 codes (0..15) x int8 x (-127..127): a byte pair sums to at most 2 * 15 * 127 = 3810, so
// the int16 sums of a part's 8 chunks (30480) do not overflow; one vpmaddwd per part widens them.
template <int R>
inline void Int4Tile(const Problem& p, int64_t m0, int64_t g, int64_t k0, int64_t chunks,
                     const __m256i* w, const __m256 scale[4], const __m256* minimum, float* out,
                     int64_t out_stride) {
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_si256();
  auto chunk = [&](int64_t ch) {
    for (int r = 0; r < R; ++r) {
      const __m256i xb = Broadcast4(p.xq + (m0 + r) * p.k + k0 + 4 * ch);
      for (int v = 0; v < 4; ++v)
        acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(w[4 * ch + v], xb));
    }
  };
  if (chunks == kPartChunks) {
#pragma GCC unroll 8
    for (int64_t ch = 0; ch < kPartChunks; ++ch) chunk(ch);
  } else {
    for (int64_t ch = 0; ch < chunks; ++ch) chunk(ch);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    __m256i dot[4];
    for (int v = 0; v < 4; ++v) dot[v] = _mm256_madd_epi16(acc[r][v], ones);
    AddScaled(p, m0 + r, g, dot, scale, minimum, out + (m0 + r) * out_stride);
  }
}

// int8 codes x int8 x, both signed: vpmaddubsw takes |w| (unsigned, at most 128) and x with w's
// sign (vpsignb), whose pairs sum to at most 2 * 128 * 127 = 32512, widened every chunk.
template <int R>
inline void Int8Tile(const Problem& p, int64_t m0, int64_t g, int64_t k0, int64_t chunks,
                     const __m256i* w, const __m256i* w_abs, const __m256 scale[4], float* out,
                     int64_t out_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t ch = 0; ch < chunks; ++ch) {
    for (int r = 0; r < R; ++r) {
      const __m256i xb = Broadcast4(p.xq + (m0 + r) * p.k + k0 + 4 * ch);
      for (int v = 0; v < 4; ++v) {
        const __m256i pairs =
            _mm256_maddubs_epi16(w_abs[4 * ch + v], _mm256_sign_epi8(xb, w[4 * ch + v]));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r) AddScaled(p, m0 + r, g, acc[r], scale, nullptr, out + (m0 + r) * out_stride);
}

inline void Int4Rows(const Problem& p, int64_t g, int64_t k0, int64_t chunks, const __m256i* w,
                     const __m256 scale[4], const __m256* minimum, float* out, int64_t stride) {
  int64_t m0 = 0;
  for (; m0 + kAvx2TileRows <= p.m; m0 += kAvx2TileRows)
    Int4Tile<kAvx2TileRows>(p, m0, g, k0, chunks, w, scale, minimum, out, stride);
  if (p.m - m0 == 1) Int4Tile<1>(p, m0, g, k0, chunks, w, scale, minimum, out, stride);
}

inline void Int8Rows(const Problem& p, int64_t g, int64_t k0, int64_t chunks, const __m256i* w,
                     const __m256i* w_abs, const __m256 scale[4], float* out, int64_t stride) {
  int64_t m0 = 0;
  for (; m0 + kAvx2TileRows <= p.m; m0 += kAvx2TileRows)
    Int8Tile<kAvx2TileRows>(p, m0, g, k0, chunks, w, w_abs, scale, out, stride);
  if (p.m - m0 == 1) Int8Tile<1>(p, m0, g, k0, chunks, w, w_abs, scale, out, stride);
}

// Columns [c0, c0 + 64 blocks) of every row into out ([M, 64 blocks], each half block's 32 in
// the interleaved order), as VnniColumns.
void Avx2Columns(const Problem& p, int64_t c0, int blocks, float* out) {
  const int64_t gs = p.group_size, ow = kCols * blocks;
  alignas(32) __m256i lo[kPartK], hi[kPartK];  // one half block's kPartK / 4 chunks x 4 vectors
  __m256 s_lo[4], s_hi[4], o_lo[4], o_hi[4];
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if (p.bits == 4) {
    const uint8_t* q = static_cast<const uint8_t*>(p.values);
    const int64_t half_groups = (p.k / 2) / gs;
    const __m256 minus8 = _mm256_set1_ps(-8.0f);
    for (int64_t g = 0; g < half_groups; ++g) {
      const int64_t g_hi = g + half_groups;
      for (int64_t i0 = g * gs; i0 < (g + 1) * gs; i0 += kPartK) {
        const int64_t chunks = (std::min((g + 1) * gs, i0 + kPartK) - i0) / 4;
        const bool first = i0 == g * gs;  // the minimum term once per group, with its first part
        for (int b = 0; b < blocks; ++b) {
          const Ahead ahead(p, c0, blocks, b, i0, p.k / 2);
          for (int h = 0; h < 2; ++h) {
            const int64_t col = c0 + 64 * b + kHalfCols * h;
            for (int64_t ch = 0; ch < chunks; ++ch) {
              const uint8_t* row = q + (i0 + 4 * ch) * p.ld + col;
              __m256i l[4], u[4];
              for (int t = 0; t < 4; ++t) {
                if (h == 0) ahead.Fetch(4 * ch + t, p.ld);
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + t * p.ld));
                l[t] = _mm256_and_si256(v, low4);
                u[t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
              }
              Interleave4(l[0], l[1], l[2], l[3], lo + 4 * ch);
              Interleave4(u[0], u[1], u[2], u[3], hi + 4 * ch);
            }
            LoadPermuted(p.scales, g * p.ld + col, p.f16_params, s_lo);
            LoadPermuted(p.scales, g_hi * p.ld + col, p.f16_params, s_hi);
            if (first && p.mins != nullptr) {
              LoadPermuted(p.mins, g * p.ld + col, p.f16_params, o_lo);
              LoadPermuted(p.mins, g_hi * p.ld + col, p.f16_params, o_hi);
            } else if (first) {
              for (int v = 0; v < 4; ++v) {
                o_lo[v] = _mm256_mul_ps(s_lo[v], minus8);
                o_hi[v] = _mm256_mul_ps(s_hi[v], minus8);
              }
            }
            float* o = out + 64 * b + kHalfCols * h;
            Int4Rows(p, g, i0, chunks, lo, s_lo, first ? o_lo : nullptr, o, ow);
            Int4Rows(p, g_hi, p.k / 2 + i0, chunks, hi, s_hi, first ? o_hi : nullptr, o, ow);
          }
        }
      }
    }
    return;
  }
  const int8_t* q = static_cast<const int8_t*>(p.values);
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t g_end = std::min(p.k, (g + 1) * gs);
    for (int64_t k0 = g * gs; k0 < g_end; k0 += kPartK) {
      const int64_t chunks = (std::min(g_end, k0 + kPartK) - k0) / 4;
      for (int b = 0; b < blocks; ++b) {
        const Ahead ahead(p, c0, blocks, b, k0, p.k);
        for (int h = 0; h < 2; ++h) {
          const int64_t col = c0 + 64 * b + kHalfCols * h;
          for (int64_t ch = 0; ch < chunks; ++ch) {
            const int8_t* row = q + (k0 + 4 * ch) * p.ld + col;
            __m256i r[4];
            for (int t = 0; t < 4; ++t) {
              if (h == 0) ahead.Fetch(4 * ch + t, p.ld);
              r[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + t * p.ld));
            }
            Interleave4(r[0], r[1], r[2], r[3], lo + 4 * ch);
            for (int v = 0; v < 4; ++v) hi[4 * ch + v] = _mm256_abs_epi8(lo[4 * ch + v]);
          }
          LoadPermuted(p.scales, g * p.ld + col, p.f16_params, s_lo);
          Int8Rows(p, g, k0, chunks, lo, hi, s_lo, out + 64 * b + kHalfCols * h, ow);
        }
      }
    }
  }
}

// out ([M, 64 blocks], interleaved order per half block) -> y[:, c0 .. c0 + 64 blocks)
void StoreColumns(const Problem& p, const float* out, int blocks, float* y, int64_t c0) {
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t half = 0; half < 2 * blocks; ++half) {
      const float* o = out + r * kCols * blocks + kHalfCols * half;
      float* dst = y + r * p.n + c0 + kHalfCols * half;
      for (int v = 0; v < 4; ++v)
        for (int lane = 0; lane < 8; ++lane) dst[16 * (lane / 4) + 4 * v + lane % 4] = o[8 * v + lane];
    }
  }
}
#endif

ffi::Error QuantMatmulQ8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                             ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                             ffi::Buffer<ffi::S32> num_rows, int64_t bits, int64_t group_size,
                             int64_t has_mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto vd = values.dimensions();
  if (xd.size() != 2 || vd.size() != 2) {
    return ffi::Error::InvalidArgument("x must be [M, K] and the values 2-D");
  }
  Problem p;
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
  p.num_groups = (p.k + group_size - 1) / group_size;
  if (p.n % kCols != 0 || group_size % 4 != 0 || (bits == 4 && group_size > 128) ||
      p.k % 4 != 0) {
    return ffi::Error::InvalidArgument(
        "int8 activations need N a multiple of 64, K and the group size multiples of 4 (int4: "
        "groups of at most 128)");
  }
  if (p.n > p.ld || scales.dimensions().back() != p.ld) {
    return ffi::Error::InvalidArgument("values and scales must have as many columns, at least N");
  }
  // where AMX may run, rows padded with zeros to whole tiles, which then always take kRowPad rows
  const int64_t xq_rows = p.m >= kAmxMinRows ? (p.m + kRowPad - 1) / kRowPad * kRowPad : p.m;
  std::vector<int8_t> xq(xq_rows * p.k, 0);
  std::vector<uint8_t> xu(p.m * p.k);
  std::vector<float> xdd(p.m * p.num_groups), xs(p.m * p.num_groups);
  QuantizeRows(x.typed_data(), p.m, p.k, group_size, xq.data(), xu.data(), xdd.data(), xs.data());
  p.xq = xq.data();
  p.xu = xu.data();
  p.xd = xdd.data();
  p.xs = xs.data();
  float* out = y->typed_data();
  jaxinfer::ZeroRowsFrom(out, p.m, xd[0], p.n);
  if (p.m == 0) return ffi::Error::Success();
#if defined(JAXINFER_Q8_VNNI) || defined(JAXINFER_Q8_AVX2)
  const int64_t block_count = p.n / kCols;
  const int64_t per_item = ItemBlocks(p.m, block_count, pool.num_threads());
  jaxinfer::ParallelFor(pool, (block_count + per_item - 1) / per_item, p.m * p.k * p.n / 4,
                        [&](int64_t i) {
    const int blocks = static_cast<int>(std::min(per_item, block_count - i * per_item));
    std::vector<float> acc(p.m * kCols * blocks, 0.0f);
#if defined(JAXINFER_Q8_VNNI)
    VnniColumns(p, i * per_item * kCols, blocks, acc.data());
#else
    Avx2Columns(p, i * per_item * kCols, blocks, acc.data());
#endif
    StoreColumns(p, acc.data(), blocks, out, i * per_item * kCols);
  });
  return ffi::Error::Success();
#endif
  const int64_t items = p.n / kCols;
  jaxinfer::ParallelFor(pool, items, p.m * p.k * p.n, [&](int64_t i) {
    PlainColumns(p, out, i * kCols, (i + 1) * kCols);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantMatmulQ8, QuantMatmulQ8Impl,
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
