// Decode attention on the CPU over a paged KV cache in (pinned) host memory: the Neo-like baseline's kernel.
// One call per layer attends every decode of the step: work items are (sequence, piece of the sequence's
// pages) spread over OpenMP threads; each item keeps every query head's online-softmax state in fp32 and
// reads each page once for all of them (GQA without repeating K/V), converting bf16/fp16 to
// fp32 on the fly (fp32 caches, used by the CPU tests of the serving path, are read as they are). The pieces
// of one sequence are merged per query head by their (max, sum) afterwards. Pages are read in place: no
// gather, no conversion copy of the cache. Host code only (no CUDA, no torch headers).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace directkv {

struct CpuDecodeParams {
  const void* q;                // [batch, num_heads, head_dim], `dtype`
  const void* k_pool;           // [num_pages, page_size, num_kv_heads, head_dim], `dtype`
  const void* v_pool;           // same
  const int32_t* block_table;   // [batch, table_width] page ids, logical order
  const int32_t* seq_lens;      // [batch], each >= 1
  const int32_t* item_start;    // [batch + 1] first work item (piece) of each sequence
  float* out;                   // [batch, num_heads, head_dim]
  float* part;                  // [num_items, num_heads, head_dim + 2] scratch: acc[head_dim], max, sum per head
  int batch, num_heads, num_kv_heads, head_dim, page_size, table_width;
  int piece_pages;              // pages per work item
  int num_threads;
  float scale;
  int dtype;                    // CPU_FP16, CPU_BF16 or CPU_FP32
};

enum CpuDtype { CPU_FP16 = 0, CPU_BF16 = 1, CPU_FP32 = 2 };

inline float half_bits_to_float(uint16_t h) {
  // IEEE binary16 -> binary32 without relying on F16C (subnormals, inf and NaN kept)
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: shift the leading one into place
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    bits = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element loaders: T is the storage type, load converts n elements to fp32.
struct LoadBf16 {
  using T = uint16_t;
  static void load(const T* src, float* dst, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) {  // the top half of a float
      const uint32_t bits = uint32_t(src[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  }
};
struct LoadFp16 {
  using T = uint16_t;
  static void load(const T* src, float* dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = half_bits_to_float(src[i]);
  }
};
struct LoadFp32 {
  using T = float;
  static void load(const T* src, float* dst, int n) { std::memcpy(dst, src, size_t(n) * 4); }
};

// Scores of one page: s[hq * page_size + t] = scale * q_hq . k_t for its n tokens. qf holds the queries in
// fp32 with the scale folded in, kf is scratch for the page's K in fp32.
template <class L>
inline void score_page(const CpuDecodeParams& p, const typename L::T* qraw, const float* qf,
                       const typename L::T* kpage, int n, float* kf, float* s) {
  const int D = p.head_dim, Hq = p.num_heads, G = p.num_heads / p.num_kv_heads, ps = p.page_size;
  const int row = p.num_kv_heads * D;
#if defined(__AVX512BF16__)
  // bf16 dot products in hardware (products exact, fp32 sums): no conversion of K, 25% faster per token on
  // an AVX512-BF16 CPU (Zen 4 VM, 2026-11-29: 84 vs 112 ns per token and head)
  if constexpr (std::is_same_v<L, LoadBf16>) {
    if (D % 32 == 0) {
      for (int hq = 0; hq < Hq; ++hq) {
        const uint16_t* qh = qraw + size_t(hq) * D;
        const uint16_t* kh = kpage + size_t(hq / G) * D;
        for (int t = 0; t < n; ++t) {
          const uint16_t* kt = kh + size_t(t) * row;
          __m512 acc = _mm512_setzero_ps();
          for (int d = 0; d < D; d += 32) {
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(kt + d));
          }
          s[hq * ps + t] = _mm512_reduce_add_ps(acc) * p.scale;
        }
      }
      return;
    }
  }
#endif
  L::load(kpage, kf, n * row);  // the page's K, all heads, in fp32: [n][num_kv_heads][D]
  for (int hq = 0; hq < Hq; ++hq) {
    const float* qh = qf + size_t(hq) * D;
    const float* kh = kf + size_t(hq / G) * D;
    for (int t = 0; t < n; ++t) {
      const float* kt = kh + size_t(t) * row;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)  // lets the compiler reorder the sum into vector lanes
      for (int d = 0; d < D; ++d) dot += qh[d] * kt[d];
      s[hq * ps + t] = dot;
    }
  }
}

// An item's online-softmax state per query head ([heads][D + 2]): no output yet, running max -inf, sum 0.
inline void init_state(float* part, int heads, int D) {
  for (int hq = 0; hq < heads; ++hq) {
    float* st = part + size_t(hq) * (D + 2);
    std::fill(st, st + D, 0.f);
    st[D] = -std::numeric_limits<float>::infinity();
    st[D + 1] = 0.f;
  }
}

// One work item: every query head of sequence b over pages [p0, p1) of its block table. A page's tokens are
// one contiguous block of page_size x num_kv_heads x head_dim elements, read whole (sequential, so the
// hardware prefetchers stream it; walking one KV head at a time instead strode 2 KB per token and was bound
// by memory latency, 3x slower than torch's kernel). Writes acc (unnormalised), max and sum per query head
// into `part` ([num_heads][head_dim + 2]).
template <class L>
inline void cpu_decode_item(const CpuDecodeParams& p, int b, int p0, int p1, float* part, float* qf, float* kf,
                            float* vf, float* s) {
  const auto* q = static_cast<const typename L::T*>(p.q);
  const auto* k_pool = static_cast<const typename L::T*>(p.k_pool);
  const auto* v_pool = static_cast<const typename L::T*>(p.v_pool);
  const int D = p.head_dim, Hq = p.num_heads, G = p.num_heads / p.num_kv_heads, ps = p.page_size;
  const int len = p.seq_lens[b];
  const int row = p.num_kv_heads * D;  // elements of one token (all KV heads)
  const auto* qraw = q + size_t(b) * Hq * D;
  L::load(qraw, qf, Hq * D);
  for (int i = 0; i < Hq * D; ++i) qf[i] *= p.scale;
  init_state(part, Hq, D);
  for (int j = p0; j < p1; ++j) {
    const int n = std::min(ps, len - j * ps);
    if (n <= 0) break;
    const size_t base = size_t(p.block_table[size_t(b) * p.table_width + j]) * ps * row;
    score_page<L>(p, qraw, qf, k_pool + base, n, kf, s);
    for (int hq = 0; hq < Hq; ++hq) {  // one rescale per page and head, not per token
      float* st = part + size_t(hq) * (D + 2);
      float m = st[D];
      for (int t = 0; t < n; ++t) m = std::max(m, s[hq * ps + t]);
      const float c = std::exp(st[D] - m);  // exp(-inf) = 0 on the first page
      if (c != 1.f) {
        for (int d = 0; d < D; ++d) st[d] *= c;
      }
      float l = st[D + 1] * c;
      for (int t = 0; t < n; ++t) {
        s[hq * ps + t] = std::exp(s[hq * ps + t] - m);
        l += s[hq * ps + t];
      }
      st[D] = m;
      st[D + 1] = l;
    }
    L::load(v_pool + base, vf, n * row);  // the page's V, same layout
    for (int hq = 0; hq < Hq; ++hq) {
      float* __restrict st = part + size_t(hq) * (D + 2);
      const float* vh = vf + size_t(hq / G) * D;
      for (int t = 0; t < n; ++t) {
        const float w = s[hq * ps + t];
        const float* __restrict vt = vh + size_t(t) * row;
#pragma omp simd
        for (int d = 0; d < D; ++d) st[d] += w * vt[d];
      }
    }
  }
}

#if defined(__AVX512F__)
// bf16 caches on an AVX-512 CPU, for the group sizes and head dims of the served models: the generic item
// above spends per (query head, token) a horizontal sum, a scalar exp and a load-and-store of the whole fp32
// accumulator, so with GQA (4 query heads per page row) it is bound by that work rather than by memory (Zen 4
// VM, 1 thread, Llama-3.1-8B heads: 11 us per page, 6 GB/s; the H200 host read 23-29 GB/s with 16 threads).
// Here each KV head's query group is handled together: a page row of K is loaded once per 4 query heads of the
// group (2 without AVX512-BF16), the exps are vectorised over the page's tokens, and the accumulators stay in
// registers for the whole page.
// Scores use the bf16 dot-product instruction where the CPU has AVX512-BF16, else fp32 FMAs on K rows widened
// in registers (ISA says which was compiled; the cpu_attention experiment records it).
namespace bf16_avx512 {

#if defined(__AVX512BF16__)
constexpr const char* ISA = "avx512bf16";
#else
constexpr const char* ISA = "avx512f";
#endif

// e^x, |rel. error| ~2e-7 (Cephes' expf polynomial after n = round(x log2 e)); inputs below -87 give ~1e-38,
// never 0, which is harmless for softmax weights whose largest is 1. NaN stays NaN (max_ps returns its second
// operand when either is NaN), so a corrupted cache shows in the output as it does in the generic item.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

constexpr size_t kPrefetchMaxPageBytes = 128u << 10;  // K + V of a page; Llama-3.1-8B's 64 KB, OPT-13B's 320 KB

inline __m512 bf16x16_to_ps(const uint16_t* src) {  // bf16 is the top half of a float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(src))), 16));
}

inline __mmask16 tail_mask(int left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// One work item (as cpu_decode_item) for group size G and head_dim D; s holds G x page_size scores.
template <int G, int D>
inline void item(const CpuDecodeParams& p, int b, int p0, int p1, float* part, float* s) {
  [[maybe_unused]] constexpr int KC = D / 32;  // 32-element bf16 chunks of a row (one dpbf16 each)
  constexpr int VC = D / 16;  // 16-float chunks of an accumulator
  [[maybe_unused]] constexpr int HB = G < 4 ? G : 4;  // query heads per score pass: HB x KC + KC + 1 registers
  [[maybe_unused]] constexpr int HF = G < 2 ? G : 2;  // without dpbf16: HF x VC + HF + 1 fp32 registers
  constexpr int VB = VC < 16 / G ? VC : 16 / G;  // accumulator chunks per V pass: G x VB <= 16 registers
  const auto* q = static_cast<const uint16_t*>(p.q) + size_t(b) * p.num_heads * D;
  const auto* k_pool = static_cast<const uint16_t*>(p.k_pool);
  const auto* v_pool = static_cast<const uint16_t*>(p.v_pool);
  const int Hkv = p.num_kv_heads, ps = p.page_size, row = Hkv * D, len = p.seq_lens[b];
  const size_t page_kv_bytes = size_t(ps) * row * sizeof(uint16_t) * 2;  // a page's K and V
  init_state(part, p.num_heads, D);
  for (int j = p0; j < p1; ++j) {
    const int n = std::min(ps, len - j * ps);
    if (n <= 0) break;
    const size_t base = size_t(p.block_table[size_t(b) * p.table_width + j]) * ps * row;
    // Software prefetch of the next page, a KV head's rows at a time: an item's next page is anywhere in the
    // pool, where the hardware prefetchers cannot see it coming. Only for small pages (GQA): measured on the
    // Zen 4 VM (1-2 threads, shuffled pages) +10-25% with Llama-3.1-8B's 64 KB pages, but -10-15% with
    // OPT-13B's 320 KB ones, whether the next page or this page's next head is fetched.
    const bool more = j + 1 < p1 && (j + 1) * ps < len && page_kv_bytes <= kPrefetchMaxPageBytes;
    const size_t next = more ? size_t(p.block_table[size_t(b) * p.table_width + j + 1]) * ps * row : 0;
    for (int g = 0; g < Hkv; ++g) {
      const uint16_t* kg = k_pool + base + size_t(g) * D;
      const uint16_t* vg = v_pool + base + size_t(g) * D;
      const size_t ahead = next + size_t(g) * D;
      if (more) {
        for (int t = 0; t < std::min(ps, len - (j + 1) * ps); ++t)
          for (int c = 0; c < D; c += 32) {
            _mm_prefetch(reinterpret_cast<const char*>(k_pool + ahead + size_t(t) * row + c), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v_pool + ahead + size_t(t) * row + c), _MM_HINT_T0);
          }
      }
#if defined(__AVX512BF16__)
      for (int h0 = 0; h0 < G; h0 += HB) {  // scores: each K row loaded once per HB query heads
        __m512bh qv[HB][KC];
        for (int h = 0; h < HB; ++h)
          for (int c = 0; c < KC; ++c)
            qv[h][c] = (__m512bh)_mm512_loadu_si512(q + size_t(g * G + h0 + h) * D + c * 32);
        for (int t = 0; t < n; ++t) {
          __m512bh kv[KC];
          for (int c = 0; c < KC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kg + size_t(t) * row + c * 32);
          for (int h = 0; h < HB; ++h) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < KC; ++c) acc = _mm512_dpbf16_ps(acc, qv[h][c], kv[c]);
            s[(h0 + h) * ps + t] = _mm512_reduce_add_ps(acc) * p.scale;
          }
        }
      }
#else
      for (int h0 = 0; h0 < G; h0 += HF) {  // scores in fp32: K rows widened once per HF query heads
        __m512 qv[HF][VC];
        for (int h = 0; h < HF; ++h)
          for (int c = 0; c < VC; ++c) qv[h][c] = bf16x16_to_ps(q + size_t(g * G + h0 + h) * D + c * 16);
        for (int t = 0; t < n; ++t) {
          __m512 acc[HF];
          for (int h = 0; h < HF; ++h) acc[h] = _mm512_setzero_ps();
          for (int c = 0; c < VC; ++c) {
            const __m512 kf = bf16x16_to_ps(kg + size_t(t) * row + c * 16);
            for (int h = 0; h < HF; ++h) acc[h] = _mm512_fmadd_ps(qv[h][c], kf, acc[h]);
          }
          for (int h = 0; h < HF; ++h) s[(h0 + h) * ps + t] = _mm512_reduce_add_ps(acc[h]) * p.scale;
        }
      }
#endif
      float rescale[G];
      for (int h = 0; h < G; ++h) {  // online softmax: the page's max, its weights in place, the running sum
        float* st = part + size_t(g * G + h) * (D + 2);
        float* sh = s + h * ps;
        __m512 mv = _mm512_set1_ps(st[D]);
        for (int t = 0; t < n; t += 16) {
          const __mmask16 k = tail_mask(n - t);
          mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, sh + t));
        }
        const float m = _mm512_reduce_max_ps(mv);
        rescale[h] = std::exp(st[D] - m);  // exp(-inf) = 0 on the item's first page
        __m512 lv = _mm512_setzero_ps();
        for (int t = 0; t < n; t += 16) {
          const __mmask16 k = tail_mask(n - t);
          const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), _mm512_set1_ps(m)));
          _mm512_mask_storeu_ps(sh + t, k, e);
          lv = _mm512_mask_add_ps(lv, k, lv, e);
        }
        st[D] = m;
        st[D + 1] = st[D + 1] * rescale[h] + _mm512_reduce_add_ps(lv);
      }
      for (int c0 = 0; c0 < VC; c0 += VB) {  // V: accumulators in registers for the page, each V row loaded once
        __m512 acc[G][VB];
        for (int h = 0; h < G; ++h)
          for (int c = 0; c < VB; ++c)
            acc[h][c] = _mm512_mul_ps(_mm512_loadu_ps(part + size_t(g * G + h) * (D + 2) + (c0 + c) * 16),
                                      _mm512_set1_ps(rescale[h]));
        for (int t = 0; t < n; ++t) {
          __m512 vf[VB];
          for (int c = 0; c < VB; ++c) vf[c] = bf16x16_to_ps(vg + size_t(t) * row + (c0 + c) * 16);
          for (int h = 0; h < G; ++h) {
            const __m512 w = _mm512_set1_ps(s[h * ps + t]);
            for (int c = 0; c < VB; ++c) acc[h][c] = _mm512_fmadd_ps(w, vf[c], acc[h][c]);
          }
        }
        for (int h = 0; h < G; ++h)
          for (int c = 0; c < VB; ++c) _mm512_storeu_ps(part + size_t(g * G + h) * (D + 2) + (c0 + c) * 16, acc[h][c]);
      }
    }
  }
}

using ItemFn = void (*)(const CpuDecodeParams&, int, int, int, float*, float*);

// The specialised item for this group size and head dim, or nullptr (the generic item then runs).
inline ItemFn pick(int group, int head_dim) {
#define DIRECTKV_BF16_ITEM(G)                      \
  if (group == G && head_dim == 64) return &item<G, 64>; \
  if (group == G && head_dim == 128) return &item<G, 128>;
  DIRECTKV_BF16_ITEM(1)
  DIRECTKV_BF16_ITEM(2)
  DIRECTKV_BF16_ITEM(4)
  DIRECTKV_BF16_ITEM(8)
#undef DIRECTKV_BF16_ITEM
  return nullptr;
}

}  // namespace bf16_avx512
#endif

template <class L>
inline const char* cpu_decode_attention_t(const CpuDecodeParams& p) {
  const int D = p.head_dim, Hq = p.num_heads;
  const int items = p.item_start[p.batch];
  const size_t item_floats = size_t(Hq) * (D + 2);
  bool generic = true;  // the generic item, which alone needs the fp32 query and page buffers
#if defined(__AVX512F__)
  bf16_avx512::ItemFn fast = nullptr;
  if constexpr (std::is_same_v<L, LoadBf16>) fast = bf16_avx512::pick(p.num_heads / p.num_kv_heads, D);
  generic = fast == nullptr;
#endif
  const size_t page_floats = generic ? size_t(p.page_size) * p.num_kv_heads * D : 0;
#pragma omp parallel num_threads(p.num_threads)
  {
    // per-thread buffers: queries, one page of K and of V in fp32, a page of scores per query head
    std::vector<float> qf(generic ? size_t(Hq) * D : 0), kf(page_floats), vf(page_floats), s(size_t(Hq) * p.page_size);
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int b = int(std::upper_bound(p.item_start, p.item_start + p.batch + 1, it) - p.item_start) - 1;
      const int piece = it - p.item_start[b];
      const int pages = (p.seq_lens[b] + p.page_size - 1) / p.page_size;
      const int p0 = piece * p.piece_pages, p1 = std::min(pages, p0 + p.piece_pages);
#if defined(__AVX512F__)
      if (fast) {
        fast(p, b, p0, p1, p.part + size_t(it) * item_floats, s.data());
        continue;
      }
#endif
      cpu_decode_item<L>(p, b, p0, p1, p.part + size_t(it) * item_floats, qf.data(), kf.data(), vf.data(), s.data());
    }
    // merge the pieces of each (sequence, query head) by their (max, sum)
#pragma omp for schedule(static)
    for (int bh = 0; bh < p.batch * Hq; ++bh) {
      const int b = bh / Hq, hq = bh % Hq;
      const int first = p.item_start[b], pieces = p.item_start[b + 1] - first;
      float m = -std::numeric_limits<float>::infinity();
      for (int k = 0; k < pieces; ++k) m = std::max(m, p.part[size_t(first + k) * item_floats + size_t(hq) * (D + 2) + D]);
      float* o = p.out + (size_t(b) * Hq + hq) * D;
      std::fill(o, o + D, 0.f);
      float l = 0.f;
      for (int k = 0; k < pieces; ++k) {
        const float* st = p.part + size_t(first + k) * item_floats + size_t(hq) * (D + 2);
        const float c = std::exp(st[D] - m);
        l += st[D + 1] * c;
        for (int d = 0; d < D; ++d) o[d] += c * st[d];
      }
      const float inv = 1.f / l;
      for (int d = 0; d < D; ++d) o[d] *= inv;
    }
  }
#if defined(__AVX512F__)
  if (fast) return bf16_avx512::ISA;
#endif
  return "generic";
}

// Which item a call with these values runs: "avx512bf16" / "avx512f" (the specialised bf16 item, by the ISA it
// was compiled for) or "generic".
inline const char* cpu_decode_attention_path(int dtype, int group, int head_dim) {
#if defined(__AVX512F__)
  if (dtype == CPU_BF16 && bf16_avx512::pick(group, head_dim)) return bf16_avx512::ISA;
#endif
  (void)dtype, (void)group, (void)head_dim;
  return "generic";
}

// Runs the call; returns the item that ran ("avx512bf16", "avx512f" or "generic"), so tests can tell.
inline const char* cpu_decode_attention(const CpuDecodeParams& p) {
  if (p.dtype == CPU_BF16) return cpu_decode_attention_t<LoadBf16>(p);
  if (p.dtype == CPU_FP16) return cpu_decode_attention_t<LoadFp16>(p);
  return cpu_decode_attention_t<LoadFp32>(p);
}

}  // namespace directkv
