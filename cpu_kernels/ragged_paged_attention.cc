// Ragged paged attention on the CPU: an XLA FFI custom call (see ragged_paged_attention.py).
//
// The step's new tokens are a flat list q[T, Hq, D]; sequence s owns tokens cu_q_lens[s] ..
// cu_q_lens[s+1] and has kv_lens[s] context tokens (its new ones included) in the pages
// page_indices[s] of the stacked cache. Token i of sequence s sits at position kv_lens[s] -
// q_len[s] + i and attends causally to positions 0 .. that position, optionally only to the last
// `sliding_window` of them.
//
// The cache is head-major, so that one KV head's part of a page is one contiguous block read in
// place: K [L, N, Hkv, D, page_size] (each page's keys transposed) and V [L, N, Hkv, page_size,
// D]. One work item is (sequence, KV head, block of up to kRowBlock new tokens): its rows are
// those tokens times the query heads of that KV head (GQA), and it walks only the pages its rows
// can see, one page at a time, with an online softmax: the scores of a row against the page are
// D vector FMAs across the page's keys, and the values are accumulated D-wide. Nothing is
// gathered into a copy of the context, and a decode row costs what its own context costs,
// however long the other sequences in the step are.
// Decode items of the common shapes (page size 16, head_dim 64 or 128; any cache dtype, an int8
// page's slot scales applied to its scores and its softmax weights) take a faster path,
// DecodeItem: 4 pages per online-softmax update, the accumulators of up to 4 query heads (2 at
// head_dim 128) in AVX-512 registers (a larger GQA group, e.g. Qwen2's 7, is split into items of
// at most that many heads that read the same pages, the later ones from cache), the next pages
// prefetched (on a CPU with AVX2 and no AVX-512, a variant with the accumulators in L1). Where
// it applies, every new token is an item of its own, prefill chunks and verifications included: a token's row is then computed the same way, bit for bit, whatever
// chunk or step it comes in (speculation and chunking cannot change greedy output, even where a
// last-bit difference would be amplified: int8 activations round x), and it is faster than the
// blocks of rows too (a 512-token chunk over 512 positions: 9.5 -> 3.8 ms a layer with a float32
// cache, 8.8 -> 2.1 with float16; the G query heads of a KV head still share each key and value
// read).
//
// Work items are spread over XLA's intra-op thread pool (the calling thread takes items too).
// int8 caches carry one f32 scale per (layer, page, KV head, slot); float16/bfloat16 caches are
// widened to f32 as they are read. Padding tokens (past cu_q_lens[num_seqs]) get zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "quant_params.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowBlock = 32;  // new tokens per work item (prefill chunks are split in blocks)

// exp(x) for x <= 88 (x = -inf gives 0), ~1e-7 relative error: Cephes' expf (range reduction by
// ln 2, a degree-6 polynomial), written so that loops over it vectorize (libm's expf does not).
inline float exp_approx(float x) {
  const bool zero = x < -87.3f;
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x -= fx * 0.693359375f;
  x -= fx * -2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const int32_t e = static_cast<int32_t>(fx) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return zero ? 0.0f : y * scale;
}

inline float tanh_approx(float x) {
  const float a = std::min(std::abs(x), 9.0f);  // tanh(9) is 1 in f32
  const float t = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);
  return x < 0.0f ? -t : t;
}

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(uint16_t bits, bool is_bf16) {
  if (is_bf16) {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  return jaxinfer::half_to_float(bits);
}

// The cache as the kernel reads it, head-major: one KV head's part of a page is contiguous, K
// transposed ([D, page_size]: a key's dimension d of every slot together) and V as rows
// ([page_size, D]). An f32 page is read in place; other dtypes are widened into a buffer.
struct CacheView {
  const void* data;
  const float* scale;  // int8 only: [L, N, Hkv, ps]
  ffi::DataType dtype;
  int64_t num_pages, num_kv_heads, head_dim, page_size;

  // The [D * ps] values of (layer, page, head) as f32: a pointer into the cache (f32) or into
  // `buf`. `transposed` says which axis the scale (int8: one per slot) runs along.
  const float* head_page(int64_t layer, int64_t page, int64_t h, bool transposed,
                         float* buf) const {
    const int64_t block = (layer * num_pages + page) * num_kv_heads + h;  // (layer, page, head)
    const int64_t n = head_dim * page_size, base = block * n;
    switch (dtype) {
      case ffi::DataType::F32:
        return static_cast<const float*>(data) + base;
      case ffi::DataType::BF16:
      case ffi::DataType::F16: {
        const uint16_t* src = static_cast<const uint16_t*>(data) + base;
        const bool bf16 = dtype == ffi::DataType::BF16;
        int64_t i = 0;
#if defined(__F16C__)
        if (!bf16) {  // eight halves at a time (vcvtph2ps)
          for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                          reinterpret_cast<const __m128i*>(src + i))));
        }
#endif
        if (bf16) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) buf[j] = to_float(src[j], true);
          i = n;
        }
        for (; i < n; ++i) buf[i] = to_float(src[i], false);
        return buf;
      }
      case ffi::DataType::S8: {
        const int8_t* src = static_cast<const int8_t*>(data) + base;
        const float* sc = scale + block * page_size;  // f32[ps]
        if (transposed) {  // [D, ps]: slot t's scale on column t
          for (int64_t d = 0; d < head_dim; ++d)
#pragma omp simd
            for (int64_t t = 0; t < page_size; ++t)
              buf[d * page_size + t] = to_float(src[d * page_size + t]) * sc[t];
        } else {  // [ps, D]: slot t's scale on row t
          for (int64_t t = 0; t < page_size; ++t)
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d)
              buf[t * head_dim + d] = to_float(src[t * head_dim + d]) * sc[t];
        }
        return buf;
      }
      default:
        return nullptr;
    }
  }
};

struct Problem {
  const float* q;  // [T, Hq, D]
  float* out;      // [T, Hq, D]
  CacheView k, v;
  int64_t num_q_heads, head_dim, group, page_size, pages_per_seq;
  int64_t layer;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  float sm_scale, soft_cap;
  int64_t sliding_window;  // 0: none
};

struct WorkItem {
  int32_t seq, head, first_token, num_tokens;  // tokens of the sequence (relative), this block
  // the decode path's query heads of KV head `head`: [q0, q0 + nq) of its group (all of a group
  // of at most DecodeFns::max_heads; a larger group is split into items of at most that many)
  int32_t q0 = 0, nq = 0;
  // the first of the decode items reading these pages (a later token's, or a later part of
  // the group's, finds them in cache: it prefetches nothing, nor does the item before it for it)
  bool first_reader() const { return first_token == 0 && q0 == 0; }
};

using DecodeFn = void (*)(const Problem&, const WorkItem&, const WorkItem*);

// The decode path's item for 1 .. max_heads query heads of a KV head (by_heads[nq]); all null
// where the path does not apply (another page size or head_dim, neither AVX-512 nor AVX2, an
// int8 cache without scales).
struct DecodeFns {
  DecodeFn by_heads[5] = {};
  int max_heads = 0;  // the G whose accumulators and scores fit the registers (AVX-512)
  explicit operator bool() const { return by_heads[1] != nullptr; }
};

constexpr int kRows = 4;  // query rows computed together against one page (register block)

// Scores, softmax update and value accumulation of up to kRows rows against one page.
// PS: page size, DV: head_dim (compile-time for the common sizes so the accumulators live in
// registers; 0 = runtime, the generic path). q: [kRows, D] (pre-scaled), kt: [D, PS] (the page's
// keys, transposed), vb: [PS, D], lo/hi: each row's visible keys [lo, hi) of this page (lo >= hi:
// none); m, l: running max and sum per row; acc: [kRows, D].
template <int PS, int DV>
void PageBlock(const float* q, const float* kt, const float* vb, int64_t head_dim, int ps_runtime,
               const int* lo, const int* hi, float soft_cap, float* m, float* l, float* acc) {
  const int ps = PS ? PS : ps_runtime;
  const int64_t D = DV ? DV : head_dim;
  constexpr int kMaxPs = 64;
  float sc[kRows][kMaxPs];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kMaxPs; ++t) sc[r][t] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float* krow = kt + d * ps;
    for (int r = 0; r < kRows; ++r) {
      const float qd = q[r * D + d];
#pragma omp simd
      for (int t = 0; t < (PS ? PS : ps); ++t) sc[r][t] += qd * krow[t];
    }
  }
  float alpha[kRows];
  for (int r = 0; r < kRows; ++r) {
    float* s = sc[r];
    const int a = lo[r], b = hi[r];
    if (a >= b) {  // nothing of this page is visible to the row
      alpha[r] = 1.0f;
      for (int t = 0; t < ps; ++t) s[t] = 0.0f;
      continue;
    }
#pragma omp simd
    for (int t = 0; t < (PS ? PS : ps); ++t) {
      float x = s[t];
      if (soft_cap > 0.0f) x = soft_cap * tanh_approx(x / soft_cap);
      s[t] = (t >= a && t < b) ? x : -INFINITY;
    }
    float mx = m[r];
#pragma omp simd reduction(max : mx)
    for (int t = 0; t < (PS ? PS : ps); ++t) mx = std::max(mx, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < (PS ? PS : ps); ++t) {
      s[t] = exp_approx(s[t] - mx);
      sum += s[t];
    }
    alpha[r] = exp_approx(m[r] - mx);  // 0 while m is -inf
    l[r] = l[r] * alpha[r] + sum;
    m[r] = mx;
  }
  // acc[r] = alpha[r] * acc[r] + sum_t sc[r][t] * v[t], 16 columns at a time in registers.
  constexpr int kW = 16;
  if (D % kW == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += kW) {
      float pv[kRows][kW];
      for (int r = 0; r < kRows; ++r)
        for (int j = 0; j < kW; ++j) pv[r][j] = 0.0f;
      for (int t = 0; t < (PS ? PS : ps); ++t) {
        const float* vrow = vb + t * D + d0;
        for (int r = 0; r < kRows; ++r) {
          const float e = sc[r][t];
#pragma omp simd
          for (int j = 0; j < kW; ++j) pv[r][j] += e * vrow[j];
        }
      }
      for (int r = 0; r < kRows; ++r) {
        float* a = acc + r * D + d0;
#pragma omp simd
        for (int j = 0; j < kW; ++j) a[j] = a[j] * alpha[r] + pv[r][j];
      }
    }
  } else {
    for (int r = 0; r < kRows; ++r) {
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha[r];
      for (int t = 0; t < ps; ++t) {
        const float e = sc[r][t];
        const float* vrow = vb + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += e * vrow[d];
      }
    }
  }
}

using PageBlockFn = void (*)(const float*, const float*, const float*, int64_t, int, const int*,
                             const int*, float, float*, float*, float*);

PageBlockFn ChoosePageBlock(int64_t page_size, int64_t head_dim) {
#define JAXINFER_CASE(PS, DV) \
  if (page_size == PS && head_dim == DV) return &PageBlock<PS, DV>;
  JAXINFER_CASE(16, 64) JAXINFER_CASE(16, 128) JAXINFER_CASE(32, 64) JAXINFER_CASE(32, 128)
  JAXINFER_CASE(8, 64) JAXINFER_CASE(8, 128)
#undef JAXINFER_CASE
  if (page_size == 16) return &PageBlock<16, 0>;
  if (page_size == 32) return &PageBlock<32, 0>;
  return &PageBlock<0, 0>;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// What a decode item fetches while it computes the block of kPages pages from pg0: its own next
// block's pages, and on its last block the first pages of `later` (the item its thread takes
// next) where that item is the first to read them. Only the first reader of a sequence's pages
// fetches (a later token's item finds them cached).
template <int kPages, int PS>
struct NextPages {
  const char* next[2 * kPages];  // K and V blocks of each page
  int num_pages = 0;

  NextPages(const Problem& p, const WorkItem& w, const WorkItem* later, int64_t pg0, int64_t k_hi,
            const char* kbase, const char* vbase, int64_t block_bytes) {
    const int64_t layer_block = p.layer * p.k.num_pages;
    const int32_t* pages = p.page_indices + static_cast<int64_t>(w.seq) * p.pages_per_seq;
    int num_next = 0;
    for (int j = 0; j < kPages && w.first_reader(); ++j) {
      const int64_t pg = pg0 + kPages + j;
      if (pg * PS >= k_hi) break;
      const int64_t block = (layer_block + pages[pg]) * p.k.num_kv_heads + w.head;
      next[num_next++] = kbase + block * block_bytes;
      next[num_next++] = vbase + block * block_bytes;
    }
    // the last block: the next item's first one
    if ((pg0 + kPages) * PS >= k_hi && later != nullptr && later->first_reader()) {
      const int32_t later_q_len = p.cu_q_lens[later->seq + 1] - p.cu_q_lens[later->seq];
      const int64_t later_pos = p.kv_lens[later->seq] - later_q_len + later->first_token;
      const int64_t later_lo =
          p.sliding_window > 0 ? std::max<int64_t>(0, later_pos - p.sliding_window + 1) : 0;
      const int32_t* later_pages =
          p.page_indices + static_cast<int64_t>(later->seq) * p.pages_per_seq;
      for (int64_t pg = later_lo / PS; pg * PS <= later_pos && num_next < 2 * kPages; ++pg) {
        const int64_t block = (layer_block + later_pages[pg]) * p.k.num_kv_heads + later->head;
        next[num_next++] = kbase + block * block_bytes;
        next[num_next++] = vbase + block * block_bytes;
      }
    }
    num_pages = num_next / 2;
  }

  // lines [k0, k1) of the next pages' K (half 0) or V (half 1) blocks: line k is page
  // k % kPages, line k / kPages
  void Fetch(int k0, int k1, int half) const {
    for (int k = k0; k < k1; ++k)
      if (k % kPages < num_pages)
        _mm_prefetch(next[2 * (k % kPages) + half] + (k / kPages) * 64, _MM_HINT_T1);
  }
};
#endif

#if defined(__AVX512F__)
// Decode items (one token: the G query heads of a KV head, G <= 4 at head_dim 64, G <= 2 at 128)
// with page size 16 take a path in AVX-512 registers. The G rows' accumulators ([G, D] floats:
// GD/16 vectors, at most 16) stay in registers over the whole context, and the context is walked
// kPages pages (64 keys) per online-softmax update: the scores of a block are G x kPages
// independent vector FMA chains over D (one page's 16 keys per vector), then one max, one rescale
// and one sum per row per block instead of per page. Halves are widened as they are loaded (no
// buffer).

inline __m512 Exp512(__m512 x) {  // exp_approx on 16 lanes
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~zero), y, _mm512_castsi512_ps(e));
}

inline __m512 Tanh512(__m512 x) {  // tanh_approx on 16 lanes
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(9.0f));
  const __m512 e = Exp512(_mm512_add_ps(a, a));
  const __m512 t = _mm512_sub_ps(
      _mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_sub_ps(t, neg, _mm512_setzero_ps(), t);
}

// 16 cache values as f32: KIND 0 float32, 1 float16, 2 bfloat16, 3 int8 (its scale not applied).
template <int KIND>
inline __m512 Load16(const void* src) {
  if constexpr (KIND == 0) {
    return _mm512_loadu_ps(src);
  } else if constexpr (KIND == 3) {
    const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(src));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else if constexpr (KIND == 1) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(src))), 16));
  }
}

// stands in for pages past the context (the largest page block: 16 slots of 128 f32 values)
alignas(64) const float kZeroPage[16 * 128] = {};

template <int G, int KIND, int D>
void DecodeItem(const Problem& p, const WorkItem& w, const WorkItem* later) {
  constexpr int PS = 16, C = D / 16, kPages = 4;
  static_assert(G * C <= 16 && PS * D <= 16 * 128,
                "more accumulators than registers, or a page larger than kZeroPage");
  constexpr int64_t kEsize = KIND == 0 ? 4 : KIND == 3 ? 1 : 2;
  constexpr bool kScaled = KIND == 3;  // int8: each slot's f32 scales (K: score, V: weight)
  const int32_t q_start = p.cu_q_lens[w.seq];
  const int32_t q_len = p.cu_q_lens[w.seq + 1] - q_start;
  const int64_t pos = p.kv_lens[w.seq] - q_len + w.first_token;  // the token's position
  const int64_t k_hi = pos + 1;  // visible keys [k_lo, k_hi)
  const int64_t k_lo =
      p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  const int64_t token = q_start + w.first_token;
  alignas(64) float q[G][D];
  for (int g = 0; g < G; ++g) {
    const float* src = p.q + (token * p.num_q_heads + w.head * p.group + w.q0 + g) * D;
    for (int d = 0; d < D; ++d) q[g][d] = src[d] * p.sm_scale;
  }
  __m512 acc[G][C];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const char* kbase = static_cast<const char*>(p.k.data);
  const char* vbase = static_cast<const char*>(p.v.data);
  const int64_t block_bytes = D * PS * kEsize;
  const int64_t layer_block = p.layer * p.k.num_pages;
  const int32_t* pages = p.page_indices + static_cast<int64_t>(w.seq) * p.pages_per_seq;
  alignas(64) char vtail[PS * D * 4];  // the last page's V, zeros past the context
  alignas(64) float vscale_tail[PS];  // int8: its scales, zeros past the context
  alignas(64) float probs[G][kPages * PS];
  constexpr int kLines = PS * D * kEsize / 64;  // cache lines of one page's K (or V) block
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t pg0 = k_lo / PS; pg0 * PS < k_hi; pg0 += kPages) {
    const char* kp[kPages];
    const char* vp[kPages];
    const float* ks[kPages];  // int8: the pages' K and V scales (f32[PS] each)
    const float* vs[kPages];
    __mmask16 mask[kPages];
    int used = 0;
    for (int j = 0; j < kPages; ++j) {
      const int64_t t0 = (pg0 + j) * PS;
      if (t0 >= k_hi) {
        kp[j] = vp[j] = reinterpret_cast<const char*>(kZeroPage);
        ks[j] = vs[j] = kZeroPage;
        mask[j] = 0;
        continue;
      }
      used = j + 1;
      const int64_t block = (layer_block + pages[pg0 + j]) * p.k.num_kv_heads + w.head;
      kp[j] = kbase + block * block_bytes;
      vp[j] = vbase + block * block_bytes;
      if constexpr (kScaled) {
        ks[j] = p.k.scale + block * PS;
        vs[j] = p.v.scale + block * PS;
      }
      const int lo = static_cast<int>(std::max<int64_t>(0, k_lo - t0));
      const int hi = static_cast<int>(std::min<int64_t>(PS, k_hi - t0));
      mask[j] = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
      if (hi < PS) {  // slots past the context may hold anything (NaN): zeros in a copy
        std::memcpy(vtail, vp[j], hi * D * kEsize);
        std::memset(vtail + hi * D * kEsize, 0, (PS - hi) * D * kEsize);
        vp[j] = vtail;
        if constexpr (kScaled) {  // a slot past the context may hold any scale (NaN too)
          std::memcpy(vscale_tail, vs[j], hi * sizeof(float));
          std::fill(vscale_tail + hi, vscale_tail + PS, 0.0f);
          vs[j] = vscale_tail;
        }
      }
    }
    // The next block's pages, fetched into L2 while this one is computed: their K lines spread
    // evenly over the D steps of the scores, their V lines over the slots of the weighted sum
    // (L2 takes more misses at once than L1, and a burst of them stalls the loop it sits in:
    // all lines in the first half of the scores' loop took 1.3x as long over 16 x 512 tokens,
    // f16). An item of a sequence's later token finds its pages cached by the first token's.
    const NextPages<kPages, PS> ahead(p, w, later, pg0, k_hi, kbase, vbase, block_bytes);
    const auto fetch = [&](int k0, int k1, int half) { ahead.Fetch(k0, k1, half); };
    __m512 s[G][kPages];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kPages; ++j) s[g][j] = _mm512_setzero_ps();
    __m512 kscale[kPages], vscale[kPages];
    if constexpr (kScaled) {
      for (int j = 0; j < kPages; ++j) {
        kscale[j] = _mm512_loadu_ps(ks[j]);
        vscale[j] = _mm512_loadu_ps(vs[j]);
      }
    }
    for (int d = 0; d < D; ++d) {
      fetch(d * kPages * kLines / D, (d + 1) * kPages * kLines / D, 0);
      __m512 kv[kPages];
      for (int j = 0; j < kPages; ++j) kv[j] = Load16<KIND>(kp[j] + d * PS * kEsize);
      for (int g = 0; g < G; ++g) {
        const __m512 qd = _mm512_set1_ps(q[g][d]);
        for (int j = 0; j < kPages; ++j) s[g][j] = _mm512_fmadd_ps(qd, kv[j], s[g][j]);
      }
    }
    // int8: a key's scale multiplies its score once (q . (k s) = (q . k) s), not each of its D
    // values (a NaN scale past the context is masked below, as its score would be)
    if constexpr (kScaled)
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < kPages; ++j) s[g][j] = _mm512_mul_ps(s[g][j], kscale[j]);
    for (int g = 0; g < G; ++g) {
      __m512 mx = neg_inf;
      for (int j = 0; j < kPages; ++j) {
        __m512 x = s[g][j];
        if (p.soft_cap > 0.0f) {
          const __m512 cap = _mm512_set1_ps(p.soft_cap);
          x = _mm512_mul_ps(cap, Tanh512(_mm512_div_ps(x, cap)));
        }
        x = _mm512_mask_blend_ps(mask[j], neg_inf, x);
        s[g][j] = x;
        mx = _mm512_max_ps(mx, x);
      }
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(mx));  // finite: a key is visible
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kPages; ++j) {
        const __m512 e = Exp512(_mm512_sub_ps(s[g][j], mv));
        sum = _mm512_add_ps(sum, e);
        // int8: each value's weight times its slot's scale, once for the D values of the slot
        // (zeros past the context, where the page's scales may be anything)
        __m512 weight = e;
        if constexpr (kScaled) weight = _mm512_mul_ps(e, vscale[j]);
        _mm512_store_ps(probs[g] + j * PS, weight);
      }
      const float alpha = exp_approx(m[g] - m_new);  // 0 while m is -inf
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);
      m[g] = m_new;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], av);
    }
    for (int j = 0; j < used; ++j) {
      for (int t = 0; t < PS; ++t) {
        const int slot = j * PS + t;  // of used * PS
        fetch(slot * kPages * kLines / (used * PS), (slot + 1) * kPages * kLines / (used * PS), 1);
        const char* vrow = vp[j] + t * D * kEsize;
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = Load16<KIND>(vrow + c * 16 * kEsize);
        for (int g = 0; g < G; ++g) {
          const __m512 e = _mm512_set1_ps(probs[g][j * PS + t]);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(e, v[c], acc[g][c]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    float* dst = p.out + (token * p.num_q_heads + w.head * p.group + w.q0 + g) * D;
    const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc[g][c], inv));
  }
}

// head_dim 64: items of up to 4 heads (16 accumulators and 16 scores); 128: up to 2 (16 and 8)
template <int KIND, int D>
DecodeFns DecodeFnsOf() {
  DecodeFns f;
  f.by_heads[1] = &DecodeItem<1, KIND, D>;
  f.by_heads[2] = &DecodeItem<2, KIND, D>;
  f.max_heads = 2;
  if constexpr (D == 64) {
    f.by_heads[3] = &DecodeItem<3, KIND, D>;
    f.by_heads[4] = &DecodeItem<4, KIND, D>;
    f.max_heads = 4;
  }
  return f;
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The decode path on CPUs with AVX2 and no AVX-512 (the same items, one token each, so a token's
// row is again computed the same way in any chunk or step). Sixteen 8-lane registers hold neither
// the G rows' accumulators nor G x 4 pages of scores, so one row's scores of a block (4 pages: 8
// vectors) are taken at a time, over keys widened to f32 once per block (f32 pages are read in
// place), and the weighted values are summed 8 columns at a time for the G rows together, the
// accumulators kept in L1 between blocks.

inline __m256 Exp256(__m256 x) {  // exp_approx on 8 lanes
  const __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline __m256 Tanh256(__m256 x) {  // tanh_approx on 8 lanes
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(9.0f));
  const __m256 e = Exp256(_mm256_add_ps(a, a));
  const __m256 t = _mm256_sub_ps(
      _mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  return _mm256_or_ps(t, _mm256_and_ps(sign, x));  // t >= 0: x's sign
}

// 8 cache values as f32: KIND 0 float32, 1 float16, 2 bfloat16, 3 int8 (its scale not applied).
template <int KIND>
inline __m256 Load8(const void* src) {
  if constexpr (KIND == 0) {
    return _mm256_loadu_ps(static_cast<const float*>(src));
  } else if constexpr (KIND == 3) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(src))));
  } else if constexpr (KIND == 1) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(src)));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(src))), 16));
  }
}

// stands in for pages past the context (the largest page block: 16 slots of 128 f32 values)
alignas(64) const float kZeroPage[16 * 128] = {};

template <int G, int KIND, int D>
void DecodeItem(const Problem& p, const WorkItem& w, const WorkItem* later) {
  constexpr int PS = 16, kPages = 4, kSlots = kPages * PS, C = D / 8;
  static_assert(PS * D <= 16 * 128, "a page larger than kZeroPage");
  constexpr int64_t kEsize = KIND == 0 ? 4 : KIND == 3 ? 1 : 2;
  constexpr bool kScaled = KIND == 3;  // int8: each slot's f32 scales (K: score, V: weight)
  const int32_t q_start = p.cu_q_lens[w.seq];
  const int32_t q_len = p.cu_q_lens[w.seq + 1] - q_start;
  const int64_t pos = p.kv_lens[w.seq] - q_len + w.first_token;  // the token's position
  const int64_t k_hi = pos + 1;  // visible keys [k_lo, k_hi)
  const int64_t k_lo =
      p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  const int64_t token = q_start + w.first_token;
  alignas(32) float q[G][D];
  for (int g = 0; g < G; ++g) {
    const float* src = p.q + (token * p.num_q_heads + w.head * p.group + w.q0 + g) * D;
    for (int d = 0; d < D; ++d) q[g][d] = src[d] * p.sm_scale;
  }
  alignas(32) float acc[G][D] = {};
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const char* kbase = static_cast<const char*>(p.k.data);
  const char* vbase = static_cast<const char*>(p.v.data);
  const int64_t block_bytes = D * PS * kEsize;
  const int64_t layer_block = p.layer * p.k.num_pages;
  const int32_t* pages = p.page_indices + static_cast<int64_t>(w.seq) * p.pages_per_seq;
  alignas(32) char vtail[PS * D * 4];  // the last page's V, zeros past the context
  alignas(32) float vscale_tail[PS];  // int8: its scales, zeros past the context
  alignas(32) float kf[D][kSlots];  // the block's keys as f32 (not for a float32 cache)
  alignas(32) float probs[G][kSlots];
  constexpr int kLines = PS * D * kEsize / 64;  // cache lines of one page's K (or V) block
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t pg0 = k_lo / PS; pg0 * PS < k_hi; pg0 += kPages) {
    const char* kp[kPages];
    const char* vp[kPages];
    const float* ks[kPages];  // int8: the pages' K and V scales (f32[PS] each)
    const float* vs[kPages];
    __m256 visible[kPages][2];  // all ones on the slots of the context the token sees
    int used = 0;
    for (int j = 0; j < kPages; ++j) {
      const int64_t t0 = (pg0 + j) * PS;
      if (t0 >= k_hi) {
        kp[j] = vp[j] = reinterpret_cast<const char*>(kZeroPage);
        ks[j] = vs[j] = kZeroPage;
        visible[j][0] = visible[j][1] = _mm256_setzero_ps();
        continue;
      }
      used = j + 1;
      const int64_t block = (layer_block + pages[pg0 + j]) * p.k.num_kv_heads + w.head;
      kp[j] = kbase + block * block_bytes;
      vp[j] = vbase + block * block_bytes;
      if constexpr (kScaled) {
        ks[j] = p.k.scale + block * PS;
        vs[j] = p.v.scale + block * PS;
      }
      const int lo = static_cast<int>(std::max<int64_t>(0, k_lo - t0));
      const int hi = static_cast<int>(std::min<int64_t>(PS, k_hi - t0));
      for (int h = 0; h < 2; ++h) {
        const __m256i slot = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h));
        const __m256i in = _mm256_andnot_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), slot),
            _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), slot));  // lo <= slot < hi
        visible[j][h] = _mm256_castsi256_ps(in);
      }
      if (hi < PS) {  // slots past the context may hold anything (NaN): zeros in a copy
        std::memcpy(vtail, vp[j], hi * D * kEsize);
        std::memset(vtail + hi * D * kEsize, 0, (PS - hi) * D * kEsize);
        vp[j] = vtail;
        if constexpr (kScaled) {  // a slot past the context may hold any scale (NaN too)
          std::memcpy(vscale_tail, vs[j], hi * sizeof(float));
          std::fill(vscale_tail + hi, vscale_tail + PS, 0.0f);
          vs[j] = vscale_tail;
        }
      }
    }
    // The next block's pages, fetched into L2 while this one is computed, spread over the loops
    // below (as the AVX-512 path does).
    const NextPages<kPages, PS> ahead(p, w, later, pg0, k_hi, kbase, vbase, block_bytes);
    const auto fetch = [&](int k0, int k1, int half) { ahead.Fetch(k0, k1, half); };
    // keys: K page j, dimension d, slots 8 h .. 8 h + 7
    if constexpr (KIND != 0) {
      for (int d = 0; d < D; ++d) {
        fetch(d * kPages * kLines / D, (d + 1) * kPages * kLines / D, 0);
        for (int j = 0; j < kPages; ++j)
          for (int h = 0; h < 2; ++h)
            _mm256_store_ps(kf[d] + j * PS + 8 * h, Load8<KIND>(kp[j] + (d * PS + 8 * h) * kEsize));
      }
    } else {
      fetch(0, kPages * kLines, 0);
    }
    const auto key = [&](int d, int j, int h) {
      if constexpr (KIND == 0) {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(kp[j]) + d * PS + 8 * h);
      } else {
        return _mm256_load_ps(kf[d] + j * PS + 8 * h);
      }
    };
    for (int g = 0; g < G; ++g) {
      __m256 s[kPages][2];
      for (int j = 0; j < kPages; ++j) s[j][0] = s[j][1] = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m256 qd = _mm256_set1_ps(q[g][d]);
        for (int j = 0; j < kPages; ++j)
          for (int h = 0; h < 2; ++h) s[j][h] = _mm256_fmadd_ps(qd, key(d, j, h), s[j][h]);
      }
      __m256 mx = neg_inf;
      for (int j = 0; j < kPages; ++j) {
        for (int h = 0; h < 2; ++h) {
          __m256 x = s[j][h];
          // int8: a key's scale multiplies its score once (q . (k s) = (q . k) s)
          if constexpr (kScaled) x = _mm256_mul_ps(x, _mm256_loadu_ps(ks[j] + 8 * h));
          if (p.soft_cap > 0.0f) {
            const __m256 cap = _mm256_set1_ps(p.soft_cap);
            x = _mm256_mul_ps(cap, Tanh256(_mm256_div_ps(x, cap)));
          }
          x = _mm256_blendv_ps(neg_inf, x, visible[j][h]);
          s[j][h] = x;
          mx = _mm256_max_ps(mx, x);
        }
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      float block_max = lanes[0];
      for (int i = 1; i < 8; ++i) block_max = std::max(block_max, lanes[i]);
      const float m_new = std::max(m[g], block_max);  // finite: a key is visible
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < kPages; ++j) {
        for (int h = 0; h < 2; ++h) {
          const __m256 e = Exp256(_mm256_sub_ps(s[j][h], mv));
          sum = _mm256_add_ps(sum, e);
          // int8: each value's weight times its slot's scale (zeros past the context)
          __m256 weight = e;
          if constexpr (kScaled) weight = _mm256_mul_ps(e, _mm256_loadu_ps(vs[j] + 8 * h));
          _mm256_store_ps(probs[g] + j * PS + 8 * h, weight);
        }
      }
      _mm256_store_ps(lanes, sum);
      float block_sum = 0.0f;
      for (int i = 0; i < 8; ++i) block_sum += lanes[i];
      const float alpha = exp_approx(m[g] - m_new);  // 0 while m is -inf
      l[g] = l[g] * alpha + block_sum;
      m[g] = m_new;
      const __m256 av = _mm256_set1_ps(alpha);
      for (int c = 0; c < C; ++c)
        _mm256_store_ps(acc[g] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c), av));
    }
    for (int c = 0; c < C; ++c) {
      __m256 a[G];
      for (int g = 0; g < G; ++g) a[g] = _mm256_load_ps(acc[g] + 8 * c);
      for (int j = 0; j < used; ++j) {
        if (c == 0) fetch(j * kPages * kLines / used, (j + 1) * kPages * kLines / used, 1);
        for (int t = 0; t < PS; ++t) {
          const __m256 v = Load8<KIND>(vp[j] + (t * D + 8 * c) * kEsize);
          for (int g = 0; g < G; ++g)
            a[g] = _mm256_fmadd_ps(_mm256_set1_ps(probs[g][j * PS + t]), v, a[g]);
        }
      }
      for (int g = 0; g < G; ++g) _mm256_store_ps(acc[g] + 8 * c, a[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* dst = p.out + (token * p.num_q_heads + w.head * p.group + w.q0 + g) * D;
    const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c), inv));
  }
}

// items of up to 4 query heads at either head_dim (the accumulators live in L1)
template <int KIND, int D>
DecodeFns DecodeFnsOf() {
  DecodeFns f;
  f.by_heads[1] = &DecodeItem<1, KIND, D>;
  f.by_heads[2] = &DecodeItem<2, KIND, D>;
  f.by_heads[3] = &DecodeItem<3, KIND, D>;
  f.by_heads[4] = &DecodeItem<4, KIND, D>;
  f.max_heads = 4;
  return f;
}
#define JAXINFER_ATTN_DECODE 1
#endif

#if defined(__AVX512F__) || defined(JAXINFER_ATTN_DECODE)
template <int D>
DecodeFns ChooseDecodeOf(const Problem& p) {
  switch (p.k.dtype) {
    case ffi::DataType::F32: return DecodeFnsOf<0, D>();
    case ffi::DataType::F16: return DecodeFnsOf<1, D>();
    case ffi::DataType::BF16: return DecodeFnsOf<2, D>();
    case ffi::DataType::S8:
      if (p.k.scale == nullptr || p.v.scale == nullptr) return {};
      return DecodeFnsOf<3, D>();
    default: return {};
  }
}

// The decode path for this problem, or none where it does not apply.
DecodeFns ChooseDecode(const Problem& p) {
  if (p.page_size != 16 || p.group < 1) return {};
  if (p.head_dim == 64) return ChooseDecodeOf<64>(p);
  if (p.head_dim == 128) return ChooseDecodeOf<128>(p);
  return {};
}
#else
DecodeFns ChooseDecode(const Problem&) { return {}; }
#endif

// One work item: rows = its tokens x the query heads of KV head `head`, token-major (row
// i * G + g is token i, query head g), so rows are in position order.
void RunItem(const Problem& p, const WorkItem& w, PageBlockFn block, std::vector<float>& scratch) {
  const int64_t D = p.head_dim, G = p.group, ps = p.page_size;
  const int32_t q_start = p.cu_q_lens[w.seq];
  const int32_t q_len = p.cu_q_lens[w.seq + 1] - q_start;
  const int32_t kv_len = p.kv_lens[w.seq];
  const int64_t first_pos = kv_len - q_len + w.first_token;  // the block's first token
  const int64_t last_pos = first_pos + w.num_tokens - 1;
  const int64_t rows = static_cast<int64_t>(w.num_tokens) * G;
  const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
  // scratch: q [padded_rows, D] | acc [padded_rows, D] | m, l [padded_rows] | kt [D, ps] | v [ps, D]
  scratch.resize(2 * padded_rows * D + 2 * padded_rows + 2 * D * ps);
  float* qr = scratch.data();
  float* acc = qr + padded_rows * D;
  float* m = acc + padded_rows * D;
  float* l = m + padded_rows;
  float* kbuf = l + padded_rows;
  float* vbuf = kbuf + D * ps;
  std::fill(qr, qr + padded_rows * D, 0.0f);
  for (int32_t i = 0; i < w.num_tokens; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = p.q + ((q_start + w.first_token + i) * p.num_q_heads + w.head * G + g) * D;
      float* dst = qr + (i * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.sm_scale;
    }
  }
  std::fill(acc, acc + padded_rows * D, 0.0f);
  std::fill(m, m + padded_rows, -INFINITY);
  std::fill(l, l + padded_rows, 0.0f);

  int64_t lo_pos = 0;
  if (p.sliding_window > 0) lo_pos = std::max<int64_t>(0, first_pos - p.sliding_window + 1);
  const int32_t* pages = p.page_indices + static_cast<int64_t>(w.seq) * p.pages_per_seq;
  for (int64_t pg = lo_pos / ps; pg * ps <= last_pos; ++pg) {
    const int64_t t0 = pg * ps;
    const int count = static_cast<int>(std::min<int64_t>(ps, last_pos + 1 - t0));
    const float* kt = p.k.head_page(p.layer, pages[pg], w.head, true, kbuf);   // [D, ps]
    const float* vb = p.v.head_page(p.layer, pages[pg], w.head, false, vbuf);  // [ps, D]
    if (count < ps) {  // slots past the context (any garbage, even NaN): zeros in a copy, so
      // masked lanes multiply zeros
      if (kt != kbuf) std::memcpy(kbuf, kt, sizeof(float) * D * ps);
      if (vb != vbuf) std::memcpy(vbuf, vb, sizeof(float) * D * ps);
      for (int64_t d = 0; d < D; ++d)
        for (int t = count; t < ps; ++t) kbuf[d * ps + t] = 0.0f;
      std::fill(vbuf + count * D, vbuf + ps * D, 0.0f);
      kt = kbuf;
      vb = vbuf;
    }
    // Rows are in position order: those before the page's first key see none of it.
    const int64_t first_row = std::max<int64_t>(0, t0 - first_pos) * G;
    for (int64_t r0 = first_row / kRows * kRows; r0 < rows; r0 += kRows) {
      int lo[kRows], hi[kRows];
      for (int j = 0; j < kRows; ++j) {
        const int64_t r = r0 + j;
        lo[j] = 0;
        hi[j] = 0;
        if (r >= rows) continue;
        const int64_t pos = first_pos + r / G;
        hi[j] = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(count, pos - t0 + 1)));
        if (p.sliding_window > 0)
          lo[j] = static_cast<int>(std::max<int64_t>(0, pos - p.sliding_window + 1 - t0));
      }
      block(qr + r0 * D, kt, vb, D, static_cast<int>(ps), lo, hi, p.soft_cap, m + r0, l + r0,
            acc + r0 * D);
    }
  }
  for (int32_t i = 0; i < w.num_tokens; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float* dst = p.out + ((q_start + w.first_token + i) * p.num_q_heads + w.head * G + g) * D;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      const float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = a[d] * inv;
    }
  }
}

ffi::Error RaggedPagedAttentionImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
    ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
    int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 5) {
    return ffi::Error::InvalidArgument("q must be [T, Hq, D] and the caches 5-D (head-major)");
  }
  const int64_t num_tokens = qd[0], num_q_heads = qd[1], head_dim = qd[2];
  const int64_t num_kv_heads = kd[2];
  const int64_t num_seq_slots = kv_lens.dimensions()[0];
  const ffi::DataType dtype = k_cache.element_type();
  const bool quantized = dtype == ffi::DataType::S8;
  Problem p;
  p.q = q.typed_data();
  p.out = out->typed_data();
  // k: [L, N, Hkv, D, ps], v: [L, N, Hkv, ps, D] (head-major)
  p.k = CacheView{k_cache.untyped_data(), quantized ? k_scale.typed_data() : nullptr, dtype,
                  kd[1], kd[2], kd[3], kd[4]};
  p.v = CacheView{v_cache.untyped_data(), quantized ? v_scale.typed_data() : nullptr, dtype,
                  kd[1], kd[2], kd[3], kd[4]};
  p.num_q_heads = num_q_heads;
  p.head_dim = head_dim;
  p.group = num_q_heads / num_kv_heads;
  p.page_size = kd[4];
  p.pages_per_seq = page_indices.dimensions()[1];
  p.layer = layer.typed_data()[0];
  p.kv_lens = kv_lens.typed_data();
  p.page_indices = page_indices.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.sliding_window = sliding_window;

  const int32_t real = std::min<int64_t>(num_seqs.typed_data()[0], num_seq_slots);
  const DecodeFns decode = ChooseDecode(p);
  // the decode path's items of one KV head: its group's query heads in parts of at most
  // max_heads, as even as they go (a group of 7: 4 and 3), each part an item of its own
  const int64_t parts = decode ? (p.group + decode.max_heads - 1) / decode.max_heads : 1;
  std::vector<WorkItem> items;
  int64_t work = 0;  // multiply-adds of the scores and the weighted values, an upper bound
  for (int32_t s = 0; s < real; ++s) {
    const int32_t q_len = p.cu_q_lens[s + 1] - p.cu_q_lens[s];
    work += 2 * static_cast<int64_t>(q_len) * p.kv_lens[s] * num_q_heads * head_dim;
    // Where the decode path applies every token is an item of its own (see the top of the file).
    const int32_t rows_per_item = decode ? 1 : kRowBlock;
    for (int32_t t0 = 0; t0 < q_len; t0 += rows_per_item) {
      for (int32_t h = 0; h < num_kv_heads; ++h) {
        if (!decode) {
          items.push_back(WorkItem{s, h, t0, std::min(rows_per_item, q_len - t0)});
          continue;
        }
        for (int32_t part = 0, q0 = 0; part < parts; ++part) {
          const int32_t nq = static_cast<int32_t>(p.group / parts + (part < p.group % parts));
          items.push_back(WorkItem{s, h, t0, 1, q0, nq});
          q0 += nq;
        }
      }
    }
  }
  // Longest contexts first, so the last items to finish are short ones.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return p.kv_lens[a.seq] > p.kv_lens[b.seq];
  });
  const int32_t real_tokens = real > 0 ? p.cu_q_lens[real] : 0;
  const int64_t row = num_q_heads * head_dim;
  std::fill(p.out + static_cast<int64_t>(real_tokens) * row, p.out + num_tokens * row, 0.0f);
  const PageBlockFn block = ChoosePageBlock(p.page_size, p.head_dim);
  // A thread's next item is about `threads` further on (items are taken in order): the decode
  // path fetches its first pages while it finishes this one.
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t ahead = std::max<int64_t>(1, pool.num_threads());
  jaxinfer::ParallelFor(pool, num_items, work, [&](int64_t i) {
    if (decode) {
      const WorkItem* later = i + ahead < num_items ? &items[i + ahead] : nullptr;
      return decode.by_heads[items[i].nq](p, items[i], later);
    }
    thread_local std::vector<float> scratch;
    RunItem(p, items[i], block, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale (int8; else [1])
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
