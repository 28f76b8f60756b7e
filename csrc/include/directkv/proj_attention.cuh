// Fused K/V projection + attention of one sequence (the paper's fused kernel) over a paged two-tier KV cache.
//
// The tiled prefill schedule (prefill_attention.cuh: a K/V chunk stationary in shared memory meets every query
// row, partial state in HBM, merged at the end) with one change: the rows of the new tokens' keys are not
// loaded from anywhere. When a CTA's chunk reaches them, its warps project them from x with the KV head's
// slices of Wk / Wv (mma.sync, fp32 accumulation), rotate K (RoPE, rotate-half), round both to the cache
// dtype into the chunk buffer, and store them once to their cache pages (host pages through UVA: the new
// K/V cross the link once, as writes, and are never read back). Q is projected beforehand into HBM by the
// caller: the stationary-K/V loop needs every Q tile resident.
//
// Projection of a chunk: 16-row blocks of its new keys are dealt to the warps in rounds; per round the CTA
// streams Wk / Wv[:, kvh * D : (kvh + 1) * D] through a two-stage shared-memory ring of kHiddenStep rows
// (cp.async), and each warp multiplies its rows of x (A fragments read straight from HBM / L2) by the stage.
#pragma once

#include "directkv/prefill_attention.cuh"

namespace directkv::proj {

constexpr int kHiddenStep = 64;  // rows of Wk / Wv per shared-memory stage (hidden must be a multiple)

struct ProjParams {
  prefill::PrefillParams attn;  // keys = past + q_len new ones; include_new = 1, new_in_pages = 1
  const void* x;                // [q_len, hidden] in HBM
  const void* wk;               // [hidden, num_kv_heads * head_dim]
  const void* wv;               // [hidden, num_kv_heads * head_dim]
  const float* rope_cos;        // [q_len, head_dim / 2] at positions past_len + i; null: no RoPE
  const float* rope_sin;        // [q_len, head_dim / 2]
  int hidden;                   // a multiple of kHiddenStep
};

// Shared memory of the weight stages: 2 stages x (Wk, Wv) x [kHiddenStep][D + 8].
template <typename T, int D>
constexpr size_t kStageBytes = 2 * 2 * kHiddenStep * prefill::kStride<D> * sizeof(T);

template <typename T, int D>
struct Projector {
  const ProjParams& pp;
  T* ws;  // the weight stages

  // load_kv copies the past only: the new rows are this fill's
  __device__ __forceinline__ int load_end(const prefill::PrefillParams& p) const { return p.past_len; }

  // Rows of keys [max(key0, past_len), min(key0 + rows, num_keys)) of the chunk buffer ks / vs (load_kv
  // zero-fills the padding rows past num_keys).
  __device__ __forceinline__ void operator()(T* ks, T* vs, int kvh, int key0, int rows) const {
    using namespace prefill;
    constexpr int S = kStride<D>, kPieces = D / 8, kStage = 2 * kHiddenStep * S;
    const PrefillParams& p = pp.attn;
    const int keys = num_keys(p), new0 = max(key0, p.past_len), end = key0 + rows;
    if (new0 >= end) return;  // CTA uniform: a chunk of the past only
    const int tid = threadIdx.x, nthreads = blockDim.x, warp = tid / 32, lane = tid % 32, nwarps = nthreads / 32;
    // blocks of real keys only: padding rows past num_keys are zero-filled by load_kv, not projected
    const int blocks = (min(end, keys) - new0 + kWarpRows - 1) / kWarpRows, steps = pp.hidden / kHiddenStep;
    const size_t ldw = static_cast<size_t>(p.num_kv_heads) * D;
    const T* const wk = static_cast<const T*>(pp.wk) + static_cast<size_t>(kvh) * D;
    const T* const wv = static_cast<const T*>(pp.wv) + static_cast<size_t>(kvh) * D;
    const T* const x = static_cast<const T*>(pp.x);
    auto stage = [&](int s) {
      T* dst = ws + (s & 1) * kStage;
      for (int u = tid; u < 2 * kHiddenStep * kPieces; u += nthreads) {
        const int m = u / (kHiddenStep * kPieces), r = (u / kPieces) % kHiddenStep, c = (u % kPieces) * 8;
        const T* src = (m ? wv : wk) + static_cast<size_t>(s * kHiddenStep + r) * ldw + c;
        tc::cp_async16_zfill<false>(dst + (m * kHiddenStep + r) * S + c, src, true);
      }
      cp_async_commit();
    };
    for (int round = 0; round * nwarps < blocks; ++round) {
      const int b = round * nwarps + warp, r0 = new0 + b * kWarpRows;
      const bool active = b < blocks;
      const T* xr[2];  // the thread's two A rows of x; rows past the end alias the last token: computed, never stored
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n = min(r0 + (lane >> 2) + 8 * i - p.past_len, p.q_len - 1);
        xr[i] = x + static_cast<size_t>(n) * pp.hidden + 2 * (lane & 3);
      }
      float ak[D / 8][4], av[D / 8][4];
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ak[nb][e] = av[nb][e] = 0.f;
      }
      stage(0);
      for (int s = 0; s < steps; ++s) {
        if (s + 1 < steps) {
          stage(s + 1);
        } else {
          cp_async_commit();  // an empty group keeps wait<1> meaning "stage s has landed"
        }
        cp_async_wait<1>();
        __syncthreads();
        if (active) {
          const T* wks = ws + (s & 1) * kStage;
          const T* wvs = wks + kHiddenStep * S;
#pragma unroll
          for (int j = 0; j < kHiddenStep / 16; ++j) {
            const int col = s * kHiddenStep + j * 16;
            const uint32_t a[4] = {tc::ld_u32(xr[0] + col), tc::ld_u32(xr[1] + col), tc::ld_u32(xr[0] + col + 8),
                                   tc::ld_u32(xr[1] + col + 8)};
            const int srow = (j * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * S + ((lane >> 4) << 3);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {  // 16 output columns of K and of V per step
              uint32_t b[4];
              tc::ldsm_x4_trans(b, wks + srow + dp * 16);
              tc::mma16816<T>(ak[2 * dp], a, b[0], b[1]);
              tc::mma16816<T>(ak[2 * dp + 1], a, b[2], b[3]);
              tc::ldsm_x4_trans(b, wvs + srow + dp * 16);
              tc::mma16816<T>(av[2 * dp], a, b[0], b[1]);
              tc::mma16816<T>(av[2 * dp + 1], a, b[2], b[3]);
            }
          }
        }
        __syncthreads();  // every warp is done with stage s before stage s + 2 overwrites it
      }
      if (!active) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // C rows g and g + 8: columns nb * 8 + 2t, + 1 in elements 2i, 2i + 1
        const int key = r0 + (lane >> 2) + 8 * i;
        if (key >= end || key >= keys) continue;  // the next chunk's row, or padding
        T* krow = ks + (key - key0) * S + 2 * (lane & 3);
        T* vrow = vs + (key - key0) * S + 2 * (lane & 3);
        if (pp.rope_cos) {  // rotate-half: column c pairs with c + D / 2, held by the same thread
          const size_t t = static_cast<size_t>(key - p.past_len) * (D / 2) + 2 * (lane & 3);
#pragma unroll
          for (int nb = 0; nb < D / 16; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float cs = __ldg(pp.rope_cos + t + nb * 8 + e), sn = __ldg(pp.rope_sin + t + nb * 8 + e);
              const float x1 = ak[nb][2 * i + e], x2 = ak[nb + D / 16][2 * i + e];
              ak[nb][2 * i + e] = x1 * cs - x2 * sn;
              ak[nb + D / 16][2 * i + e] = x2 * cs + x1 * sn;
            }
          }
        }
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb) {
          *reinterpret_cast<uint32_t*>(krow + nb * 8) = tc::pack2<T>(ak[nb][2 * i], ak[nb][2 * i + 1]);
          *reinterpret_cast<uint32_t*>(vrow + nb * 8) = tc::pack2<T>(av[nb][2 * i], av[nb][2 * i + 1]);
        }
      }
    }
    __syncthreads();  // the projected rows are in shared memory
    // Each new row goes to its cache page once, 16 bytes per thread: the only link traffic of the new K/V.
    const int last = min(end, keys);
    for (int u = tid; u < (last - new0) * kPieces; u += nthreads) {
      const int key = new0 + u / kPieces, c = (u % kPieces) * 8;
      const T *k, *v;
      kv_rows<T, D>(p, key, kvh, k, v);  // new_in_pages: the page slot of the key
      *reinterpret_cast<uint4*>(const_cast<T*>(k) + c) = *reinterpret_cast<const uint4*>(ks + (key - key0) * S + c);
      *reinterpret_cast<uint4*>(const_cast<T*>(v) + c) = *reinterpret_cast<const uint4*>(vs + (key - key0) * S + c);
    }
  }
};

// grid (num_kv_heads * num_splits), 128 or 256 threads, dynamic smem num_buffers x (K, V) x [kv_chunk][D + 8]
// followed by the weight stages (kStageBytes). prefill_merge_kernel combines the splits afterwards.
template <typename T, int D, bool kL1>
__global__ void __launch_bounds__(prefill::kTiledMaxThreads, 1) proj_attention_fused_kernel(const ProjParams pp) {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* const ws = smem + static_cast<size_t>(pp.attn.num_buffers) * 2 * pp.attn.kv_chunk * prefill::kStride<D>;
  prefill::tiled_sweep<T, D, kL1>(pp.attn, smem, Projector<T, D>{pp, ws});
}

}  // namespace directkv::proj
