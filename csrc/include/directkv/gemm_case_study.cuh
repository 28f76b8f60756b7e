// GEMM case study: C = A B, fp16 operands, fp32 accumulation. A [m, k] lives in HBM, B [k, n] in pinned host
// memory read through UVA (zero-copy; HBM works too).
//
// naive     : output-stationary, mma.sync m16n8k16. A CTA owns one 128x128 C tile and streams A and B k-tiles
//             through a 3-stage cp.async ring. CTAs are rastered along n first, so the CTAs running together share
//             an A row tile and each B tile is fetched across the link again for every row tile: ceil(m / 128)
//             times. 8 warps as 2 (m) x 4 (n), 64x32 C per warp.
// raster    : naive's kernel with the CTA order transposed: the grid runs down the m tiles first, so the CTAs
//             resident together (one column of C tiles and more) ask for the same B tiles at about the same
//             time, and B crosses the link once per tile if L2 serves the repeats; A row tiles are then
//             re-read from HBM / L2 once per column of C tiles. An experiment on L2 and host memory, not a
//             variant of the paper.
// tiled     : B-stationary, Hopper wgmma (wgmma.cuh). A CTA owns a 128-wide column strip of C and a contiguous
//             run of 512-row B chunks (its k-split). Each chunk is loaded into shared memory once and stays while
//             the CTA sweeps all m / 128 row tiles, streaming A tiles from HBM (by TMA) through a 6-stage ring
//             refilled after a CTA barrier. Each chunk's fp32 product is added into one fp32 C by red.global.add
//             (atomic, the default; the CTAs resident together then share rows of C and columns of A in L2), or
//             read-modified-written in the split's own buffer, which gemm_reduce_kernel sums into C. B crosses
//             the link exactly once. Two warpgroups, 64 rows of the C tile each.
// pipelined : tiled with warp specialisation: producer warps stream A into one ring per consumer warpgroup,
//             load each B chunk once its last reader is done and, when the CTA owns further chunks, prefetch the
//             next one into L2; the two consumer warpgroups take 64-row blocks in turn (ping-pong), so one stores
//             its block while the other computes. Clusters of two CTAs on adjacent strips share each A tile by
//             TMA multicast. Persistent (p.stage): one CTA (pair) an SM walks (strip, chunk) items, and its B
//             producers stage the next item's chunk from the host in an HBM slot while the current one is computed.
// tiled and pipelined are in gemm_stationary.cuh, the reduction of their k-splits in gemm_reduce.cuh, ring in
// gemm_ring.cuh; this file holds the shared parameters, naive / raster and the stream variant's panel copy.
//
// L1 (all variants, 16-byte path only) copies the B tiles with cp.async.ca (through L1) instead of .cg (L2
// only). B is an input no CTA writes, so a non-coherent L1 cannot serve stale bytes; A is read .cg (naive) or by
// TMA / element loads (tiled, pipelined), and the partial C goes through ld/st.cg or red, never through L1.
#pragma once

#include "directkv/prefill_common.cuh"

namespace directkv::gemm {

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kChunkK = 512;                 // B rows per stationary chunk (128 KB of shared memory)
constexpr int kAStride = kBK + 8;            // +16 B per row: conflict-free ldmatrix
constexpr int kBStride = kBN + 8;
constexpr int kATile = kBM * kAStride;       // elements
constexpr int kBTile = kBK * kBStride;
constexpr int kConsumerWarps = 8, kThreads = kConsumerWarps * 32;
constexpr int kNaiveStages = 3;

struct GemmParams {
  CUtensorMap a_map;  // tiled / pipelined with 16-byte rows: A [m, k] as a TMA tensor, box 64 k x (kBM rows tiled, 64 pipelined), 128-byte swizzle
  const __half* a;   // [m, k] HBM
  const __half* b;   // [k, n] pinned host (UVA) or HBM
  void* c;           // [m, n] fp16 or fp32: naive output, reduce output
  float* part;       // tiled / pipelined: [k_splits, m, ldp] fp32 partial C of each split; [1, m, ldp], zeroed, when atomic
  int m, n, k, ldp;  // ldp = 128 * ceil(n / 128): partial rows padded so every fragment store is in bounds
  int k_splits;      // tiled / pipelined: CTAs per column strip (<= chunks)
  int chunks;        // ceil(k / kChunkK)
  int prefetch;      // pipelined: how the next B chunk is pulled into L2 (kPrefetch*)
  int atomic;        // tiled / pipelined: every chunk's product is added into part[0] by red.global.add (no read-back)
  unsigned char* stage;  // pipelined, persistent: [gridDim.x][stage_slots][128 KB] HBM slots, a B chunk each in its
                         // shared-memory layout; null: one k-split of one strip a CTA
  int stage_slots;       // persistent: 1 (the B producers load and stage in turn) or 2 (b_producers_two_slots)
  int ring_band;         // ring (gemm_ring.cuh): 128-column strips a band
  int ring_slots;        // ring: bands the HBM ring (`stage`) holds
  unsigned* ring_sync;   // ring: a slice count per unit, then a done count per band (RingPlan), zeroed before the launch
};

constexpr int kPrefetchNone = 0, kPrefetchHint = 1, kPrefetchLoad = 2;  // = the index in Python's PREFETCHES

// Copies ROWS x (8 CHUNKS) fp16 at g (leading dimension ld) into shared memory, 16-byte chunk c of row r to
// dst(r, c); elements outside [0, rows_valid) x [0, cols_valid) read as zeros. VEC: 16-byte cp.async (needs
// ld % 8 == 0, 16-B aligned g and cols_valid % 8 == 0 or >= 8 CHUNKS), through L1 when L1; otherwise element
// loads through registers (odd shapes only).
template <bool VEC, bool L1, int CHUNKS, typename Dst>
__device__ __forceinline__ void copy_tile(Dst&& dst, const __half* g, int ld, int rows, int rows_valid, int cols_valid,
                                          int tid, int nthreads) {
  for (int u = tid; u < rows * CHUNKS; u += nthreads) {
    const int r = u / CHUNKS, c = u % CHUNKS;
    void* d = dst(r, c);
    const __half* src = g + static_cast<size_t>(r) * ld + c * 8;
    if constexpr (VEC) {
      const bool ok = r < rows_valid && c * 8 < cols_valid;
      tc::cp_async16_zfill<L1>(d, ok ? src : g, ok);
    } else {
      alignas(16) __half v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = (r < rows_valid && c * 8 + e < cols_valid) ? src[e] : __float2half_rn(0.f);
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

// copy_tile into a padded row-major tile: ROWS x COLS at s, row stride S elements.
template <bool VEC, bool L1, int COLS, int S>
__device__ __forceinline__ void load_tile(__half* s, const __half* g, int ld, int rows, int rows_valid,
                                          int cols_valid, int tid, int nthreads) {
  copy_tile<VEC, L1, COLS / 8>([&](int r, int c) { return s + r * S + c * 8; }, g, ld, rows, rows_valid, cols_valid,
                               tid, nthreads);
}

// acc += A tile (as: [128][kAStride]) x B rows (bs: [64][kBStride]) for this warp's 64x32 block.
__device__ __forceinline__ void mma_tile(float (&acc)[4][4][4], const __half* as, const __half* bs, int warp, int lane) {
  const int wm = warp / 4, wn = warp % 4;
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    uint32_t af[4][4], bf[2][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      tc::ldsm_x4(af[i], as + (wm * 64 + i * 16 + (lane & 15)) * kAStride + ks * 16 + (lane >> 4) * 8);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      tc::ldsm_x4_trans(bf[j], bs + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kBStride + wn * 32 + j * 16 + (lane >> 4) * 8);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int jn = 0; jn < 4; ++jn) tc::mma16816<__half>(acc[i][jn], af[i], bf[jn >> 1][(jn & 1) * 2], bf[jn >> 1][(jn & 1) * 2 + 1]);
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[4][4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
}

// Calls f(i, j, h, row, col) for the fragment pair acc[i][j][2h], acc[i][j][2h + 1] at C (row, col), (row, col + 1).
template <typename F>
__device__ __forceinline__ void for_pairs(int m0, int n0, int warp, int lane, F&& f) {
  const int r = m0 + (warp / 4) * 64 + (lane >> 2), c = n0 + (warp % 4) * 32 + 2 * (lane & 3);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) f(i, j, h, r + i * 16 + h * 8, c + j * 8);
}

__device__ __forceinline__ void store_c(__half* p, float v0, float v1, bool pair, bool second) {
  if (pair) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v0, v1);
  } else {
    p[0] = __float2half_rn(v0);
    if (second) p[1] = __float2half_rn(v1);
  }
}

__device__ __forceinline__ void store_c(float* p, float v0, float v1, bool pair, bool second) {
  if (pair) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  } else {
    p[0] = v0;
    if (second) p[1] = v1;
  }
}

template <typename OutT>
__device__ __forceinline__ void store_output(const float (&acc)[4][4][4], const GemmParams& p, int m0, int n0, int warp, int lane) {
  OutT* c = static_cast<OutT*>(p.c);
  const bool even = p.n % 2 == 0;  // pairs start at even columns, so an even row length keeps them aligned
  for_pairs(m0, n0, warp, lane, [&](int i, int j, int h, int row, int col) {
    if (row < p.m && col < p.n) {
      store_c(c + static_cast<size_t>(row) * p.n + col, acc[i][j][2 * h], acc[i][j][2 * h + 1], even && col + 1 < p.n, col + 1 < p.n);
    }
  });
}

// grid (ceil(n / 128), ceil(m / 128)), or (ceil(m / 128), ceil(n / 128)) when M_FAST (raster), 256 threads,
// smem 3 x (A tile + B tile).
template <bool VEC, bool L1, bool M_FAST, typename OutT>
__global__ void __launch_bounds__(kThreads) gemm_naive_kernel(const GemmParams p) {
  static_assert(VEC || !L1, "the L1 form is a cp.async: 16-byte path only");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* as = reinterpret_cast<__half*>(smem_raw);
  __half* bs = as + kNaiveStages * kATile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (M_FAST ? blockIdx.y : blockIdx.x) * kBN, m0 = (M_FAST ? blockIdx.x : blockIdx.y) * kBM;
  const int ktiles = (p.k + kBK - 1) / kBK;
  auto load = [&](int kt) {
    const int k0 = kt * kBK, st = kt % kNaiveStages;
    load_tile<VEC, false, kBK, kAStride>(as + st * kATile, p.a + static_cast<size_t>(m0) * p.k + k0, p.k, kBM, p.m - m0, p.k - k0, threadIdx.x, kThreads);
    load_tile<VEC, L1, kBN, kBStride>(bs + st * kBTile, p.b + static_cast<size_t>(k0) * p.n + n0, p.n, kBK, p.k - k0, p.n - n0, threadIdx.x, kThreads);
  };
  float acc[4][4][4];
  zero(acc);
#pragma unroll
  for (int s = 0; s < kNaiveStages - 1; ++s) {
    if (s < ktiles) load(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kNaiveStages - 2>();
    __syncthreads();  // tile kt landed for everyone, and everyone is done with the stage refilled next
    if (kt + kNaiveStages - 1 < ktiles) load(kt + kNaiveStages - 1);
    cp_async_commit();
    mma_tile(acc, as + (kt % kNaiveStages) * kATile, bs + (kt % kNaiveStages) * kBTile, warp, lane);
  }
  store_output<OutT>(acc, p, m0, n0, warp, lane);
}

// The stream variant's panel copy by SM loads (copy "sm", beyond the paper): `height` rows of `width` T's, row
// r read from src + r * src_pitch bytes (pinned host through its device address: zero-copy) and written to
// dst + r * dst_pitch bytes (the HBM ring), by a few CTAs on the copy's side stream. Every thread keeps
// kCopyUnroll loads in flight: PCIe reads take ~1-2 us, so a few CTAs can cover the link's bandwidth-delay
// product and leave the other SMs to the concurrent cuBLAS product. Loads use the streaming hint (read once).
struct PanelCopyParams {
  const char* src;
  char* dst;
  long long src_pitch, dst_pitch;  // bytes
  long long width;                 // T's per row
  long long height;                // rows
};

constexpr int kCopyUnroll = 4, kCopyThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCopyThreads) copy_panel_kernel(const PanelCopyParams p) {
  const long long total = p.width * p.height;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long base = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += stride * kCopyUnroll) {
    T v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {  // all loads first: kCopyUnroll requests in flight per thread
      const long long i = base + u * stride;
      if (i < total) {
        const long long r = i / p.width;
        v[u] = __ldcs(reinterpret_cast<const T*>(p.src + r * p.src_pitch) + (i - r * p.width));
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const long long i = base + u * stride;
      if (i < total) {
        const long long r = i / p.width;
        reinterpret_cast<T*>(p.dst + r * p.dst_pitch)[i - r * p.width] = v[u];
      }
    }
  }
}

}  // namespace directkv::gemm
