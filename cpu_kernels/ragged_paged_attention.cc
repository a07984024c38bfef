// Ragged paged attention on the CPU: an XLA FFI custom call (see ragged_paged_attention.py).
//
// The step's new tokens are a flat list q[T, Hq, D]; sequence s owns tokens cu_q_lens[s] ..
// cu_q_lens[s+1] and has kv_lens[s] context tokens (its new ones included) in the pages
// page_indices[s] of the stacked cache [L, N, page_size, Hkv, D]. Token i of sequence s sits at
// position kv_lens[s] - q_len[s] + i and attends causally to positions 0 .. that position,
// optionally only to the last `sliding_window` of them.
//
// One work item is (sequence, KV head, block of up to kRowBlock new tokens): its rows are those
// tokens times the query heads of that KV head (GQA), and it walks only the pages its rows can
// see, one page at a time, with an online softmax. A page's keys are transposed into a small
// [D, page_size] buffer so that the scores of one row against the whole page are D vector FMAs
// across the page's keys; the values are then accumulated D-wide. Every read goes straight to
// the cache pages (nothing is gathered into a copy of the context), and a decode row costs what
// its own context costs, however long the other sequences in the step are.
//
// Work items are spread over XLA's intra-op thread pool (the calling thread takes items too).
// int8 caches carry one f32 scale per (layer, page, slot, KV head); float16/bfloat16 caches are
// widened to f32 as they are read. Padding tokens (past cu_q_lens[num_seqs]) get zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
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
  // IEEE half -> float
  const uint32_t sign = (bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1f;
  uint32_t mant = bits & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      u = sign | (exp << 23) | (mant << 13);
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

// The cache as the kernel reads it: element (layer, page, slot, head, d) widened to f32.
struct CacheView {
  const void* data;
  const float* scale;  // int8 only: [L, N, ps, Hkv]
  ffi::DataType dtype;
  int64_t num_pages, page_size, num_kv_heads, head_dim;

  // Copies head `h` of `count` slots of page `page` (layer `layer`) into out[t * stride_t +
  // d * stride_d], as f32.
  void load(int64_t layer, int64_t page, int64_t h, int count, float* out, int64_t stride_t,
            int64_t stride_d) const {
    const int64_t slot0 = (layer * num_pages + page) * page_size;  // first slot of the page
    for (int t = 0; t < count; ++t) {
      const int64_t base = ((slot0 + t) * num_kv_heads + h) * head_dim;
      float* o = out + t * stride_t;
      switch (dtype) {
        case ffi::DataType::F32: {
          const float* src = static_cast<const float*>(data) + base;
          for (int64_t d = 0; d < head_dim; ++d) o[d * stride_d] = src[d];
          break;
        }
        case ffi::DataType::BF16:
        case ffi::DataType::F16: {
          const uint16_t* src = static_cast<const uint16_t*>(data) + base;
          const bool bf16 = dtype == ffi::DataType::BF16;
          for (int64_t d = 0; d < head_dim; ++d) o[d * stride_d] = to_float(src[d], bf16);
          break;
        }
        case ffi::DataType::S8: {
          const int8_t* src = static_cast<const int8_t*>(data) + base;
          const float s = scale[(slot0 + t) * num_kv_heads + h];
          for (int64_t d = 0; d < head_dim; ++d) o[d * stride_d] = to_float(src[d]) * s;
          break;
        }
        default:
          break;
      }
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
  float* kt = l + padded_rows;
  float* vb = kt + D * ps;
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
    p.k.load(p.layer, pages[pg], w.head, count, kt, 1, ps);  // kt[d * ps + t]
    p.v.load(p.layer, pages[pg], w.head, count, vb, D, 1);   // vb[t * D + d]
    if (count < ps) {  // slots past the context: zero, so masked lanes multiply zeros, not garbage
      for (int64_t d = 0; d < D; ++d)
        for (int t = count; t < ps; ++t) kt[d * ps + t] = 0.0f;
      std::fill(vb + count * D, vb + ps * D, 0.0f);
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
    return ffi::Error::InvalidArgument("q must be [T, Hq, D] and the caches [L, N, ps, Hkv, D]");
  }
  const int64_t num_tokens = qd[0], num_q_heads = qd[1], head_dim = qd[2];
  const int64_t num_kv_heads = kd[3];
  const int64_t num_seq_slots = kv_lens.dimensions()[0];
  const ffi::DataType dtype = k_cache.element_type();
  const bool quantized = dtype == ffi::DataType::S8;
  Problem p;
  p.q = q.typed_data();
  p.out = out->typed_data();
  p.k = CacheView{k_cache.untyped_data(), quantized ? k_scale.typed_data() : nullptr, dtype,
                  kd[1], kd[2], kd[3], kd[4]};
  p.v = CacheView{v_cache.untyped_data(), quantized ? v_scale.typed_data() : nullptr, dtype,
                  kd[1], kd[2], kd[3], kd[4]};
  p.num_q_heads = num_q_heads;
  p.head_dim = head_dim;
  p.group = num_q_heads / num_kv_heads;
  p.page_size = kd[2];
  p.pages_per_seq = page_indices.dimensions()[1];
  p.layer = layer.typed_data()[0];
  p.kv_lens = kv_lens.typed_data();
  p.page_indices = page_indices.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.sliding_window = sliding_window;

  const int32_t real = std::min<int64_t>(num_seqs.typed_data()[0], num_seq_slots);
  std::vector<WorkItem> items;
  for (int32_t s = 0; s < real; ++s) {
    const int32_t q_len = p.cu_q_lens[s + 1] - p.cu_q_lens[s];
    for (int32_t t0 = 0; t0 < q_len; t0 += kRowBlock) {
      for (int32_t h = 0; h < num_kv_heads; ++h) {
        items.push_back(WorkItem{s, h, t0, std::min(kRowBlock, q_len - t0)});
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
  jaxinfer::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
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
