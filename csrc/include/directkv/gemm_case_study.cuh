// GEMM case study: C = A B, fp16 operands, fp32 accumulation on mma.sync m16n8k16. A [m, k] lives in HBM,
// B [k, n] in pinned host memory read through UVA (zero-copy; HBM works too).
//
// naive     : output-stationary. A CTA owns one 128x128 C tile and streams A and B k-tiles through a 3-stage
//             cp.async ring. CTAs are rastered along n first, so the CTAs running together share an A row
//             tile and each B tile is fetched across the link again for every row tile: ceil(m / 128) times.
// raster    : naive's kernel with the CTA order transposed: the grid runs down the m tiles first, so the CTAs
//             resident together (one column of C tiles and more) ask for the same B tiles at about the same
//             time, and B crosses the link once per tile if L2 serves the repeats; A row tiles are then
//             re-read from HBM / L2 once per column of C tiles. An experiment on L2 and host memory, not a
//             variant of the paper.
// tiled     : B-stationary. A CTA owns a 128-wide column strip of C and a contiguous run of 512-row B chunks
//             (its k-split). Each chunk is loaded into shared memory once and stays while the CTA sweeps all
//             m / 128 row tiles, streaming A tiles from HBM; the fp32 partial C tile is read-modified-written
//             in the split's own HBM buffer (no two CTAs touch the same bytes), and gemm_reduce_kernel sums
//             the splits into C. B crosses the link exactly once.
// pipelined : tiled with warp specialisation: a producer warp streams A tiles into a 4-stage ring handed over
//             with mbarriers, loads the B chunk, and prefetches the next B chunk into L2 while the eight
//             consumer warps compute, so the link transfer of chunk i+1 overlaps the math of chunk i.
//
// Warp layout (all variants): 8 consumer warps as 2 (m) x 4 (n), 64x32 C per warp, 64 fp32 accumulators.
//
// L1 (all variants, 16-byte path only) copies the B tiles with cp.async.ca (through L1) instead of .cg (L2
// only). B is an input no CTA writes, so a non-coherent L1 cannot serve stale bytes; A keeps .cg, and the
// partial C each CTA writes and re-reads goes through ld/st.cg, never through L1.
#pragma once

#include "directkv/prefill_common.cuh"

namespace directkv::gemm {

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kChunkK = 512;                 // B rows per stationary chunk (136 KB of shared memory)
constexpr int kAStride = kBK + 8;            // +16 B per row: conflict-free ldmatrix
constexpr int kBStride = kBN + 8;
constexpr int kATile = kBM * kAStride;       // elements
constexpr int kBTile = kBK * kBStride;
constexpr int kConsumerWarps = 8, kThreads = kConsumerWarps * 32;
constexpr int kNaiveStages = 3, kTiledStages = 3, kPipeStages = 4;

struct GemmParams {
  const __half* a;   // [m, k] HBM
  const __half* b;   // [k, n] pinned host (UVA) or HBM
  void* c;           // [m, n] fp16 or fp32: naive output, reduce output
  float* part;       // tiled / pipelined: [k_splits, m, ldp] fp32 partial C of each split
  int m, n, k, ldp;  // ldp = 128 * ceil(n / 128): partial rows padded so every fragment store is in bounds
  int k_splits;      // tiled / pipelined: CTAs per column strip (<= chunks)
  int chunks;        // ceil(k / kChunkK)
  int prefetch;      // pipelined: prefetch the next B chunk into L2
};

// Copies a ROWS x COLS tile at g (leading dimension ld) into s (row stride S); elements outside
// [0, rows_valid) x [0, cols_valid) read as zeros. VEC: 16-byte cp.async (needs ld % 8 == 0, 16-B aligned g
// and cols_valid % 8 == 0 or >= COLS), through L1 when L1; otherwise element loads through registers (odd
// shapes only).
template <bool VEC, bool L1, int COLS, int S>
__device__ __forceinline__ void load_tile(__half* s, const __half* g, int ld, int rows, int rows_valid,
                                          int cols_valid, int tid, int nthreads) {
  constexpr int P = COLS / 8;
  for (int u = tid; u < rows * P; u += nthreads) {
    const int r = u / P, c = (u % P) * 8;
    __half* dst = s + r * S + c;
    const __half* src = g + static_cast<size_t>(r) * ld + c;
    if constexpr (VEC) {
      const bool ok = r < rows_valid && c < cols_valid;
      tc::cp_async16_zfill<L1>(dst, ok ? src : g, ok);
    } else {
      alignas(16) __half v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = (r < rows_valid && c + e < cols_valid) ? src[e] : __float2half_rn(0.f);
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
    }
  }
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

// acc += old, element-wise: the partial C of earlier k chunks folded into this chunk's fragments.
__device__ __forceinline__ void accumulate(float (&acc)[4][4][4], const float (&old)[4][4][4]) {
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][b][e] += old[a][b][e];
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

__device__ __forceinline__ float* partial_tile(const GemmParams& p, int split) {
  return p.part + static_cast<size_t>(split) * p.m * p.ldp;
}

__device__ __forceinline__ void load_partial(float (&old)[4][4][4], const float* part, const GemmParams& p, int m0, int n0, int warp, int lane) {
  for_pairs(m0, n0, warp, lane, [&](int i, int j, int h, int row, int col) {
    const float2 v = row < p.m ? __ldcg(reinterpret_cast<const float2*>(part + static_cast<size_t>(row) * p.ldp + col)) : make_float2(0.f, 0.f);
    old[i][j][2 * h] = v.x;
    old[i][j][2 * h + 1] = v.y;
  });
}

__device__ __forceinline__ void store_partial(const float (&acc)[4][4][4], float* part, const GemmParams& p, int m0, int n0, int warp, int lane) {
  for_pairs(m0, n0, warp, lane, [&](int i, int j, int h, int row, int col) {
    if (row < p.m) __stcg(reinterpret_cast<float2*>(part + static_cast<size_t>(row) * p.ldp + col), make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
  });
}

// A CTA's share of a strip: chunks [begin, end) of split `split`.
__device__ __forceinline__ void split_range(const GemmParams& p, int split, int& begin, int& end) {
  begin = static_cast<int>(static_cast<int64_t>(split) * p.chunks / p.k_splits);
  end = static_cast<int>(static_cast<int64_t>(split + 1) * p.chunks / p.k_splits);
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

// grid (ceil(n / 128) * k_splits), 256 threads, smem B chunk + 3 A tiles.
template <bool VEC, bool L1>
__global__ void __launch_bounds__(kThreads, 1) gemm_tiled_kernel(const GemmParams p) {
  static_assert(VEC || !L1, "the L1 form is a cp.async: 16-byte path only");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* bchunk = reinterpret_cast<__half*>(smem_raw);  // [kChunkK][kBStride], stationary
  __half* as = bchunk + kChunkK * kBStride;              // [kTiledStages][kBM][kAStride]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x % p.k_splits, n0 = (blockIdx.x / p.k_splits) * kBN;
  const int mtiles = (p.m + kBM - 1) / kBM;
  float* part = partial_tile(p, split);
  int c_begin, c_end;
  split_range(p, split, c_begin, c_end);
  float acc[4][4][4], old[4][4][4];
  for (int c = c_begin; c < c_end; ++c) {
    const int k0 = c * kChunkK, krows = min(kChunkK, p.k - k0), ktiles = (krows + kBK - 1) / kBK;
    __syncthreads();  // everyone is done with the previous chunk
    load_tile<VEC, L1, kBN, kBStride>(bchunk, p.b + static_cast<size_t>(k0) * p.n + n0, p.n, ktiles * kBK, krows, p.n - n0, threadIdx.x, kThreads);
    cp_async_commit();
    tc::cp_async_wait_all();
    __syncthreads();
    const bool first = c == c_begin;
    const int steps = mtiles * ktiles;  // (row tile, k tile) pairs, A tiles streamed in this order
    auto load_a = [&](int i) {
      const int m0 = (i / ktiles) * kBM, kk = (i % ktiles) * kBK;
      load_tile<VEC, false, kBK, kAStride>(as + (i % kTiledStages) * kATile, p.a + static_cast<size_t>(m0) * p.k + k0 + kk, p.k, kBM, p.m - m0, krows - kk, threadIdx.x, kThreads);
    };
#pragma unroll
    for (int s = 0; s < kTiledStages - 1; ++s) {
      if (s < steps) load_a(s);
      cp_async_commit();
    }
    for (int i = 0; i < steps; ++i) {
      cp_async_wait<kTiledStages - 2>();
      __syncthreads();
      if (i + kTiledStages - 1 < steps) load_a(i + kTiledStages - 1);
      cp_async_commit();
      const int m0 = (i / ktiles) * kBM, kt = i % ktiles;
      if (kt == 0) {
        zero(acc);
        if (!first) load_partial(old, part, p, m0, n0, warp, lane);  // in flight during the k loop
      }
      mma_tile(acc, as + (i % kTiledStages) * kATile, bchunk + kt * kBK * kBStride, warp, lane);
      if (kt == ktiles - 1) {
        if (!first) accumulate(acc, old);
        store_partial(acc, part, p, m0, n0, warp, lane);
      }
    }
  }
}

// Shared memory of the pipelined kernel: B chunk, A ring, then the mbarriers.
constexpr size_t kPipeSmem = (static_cast<size_t>(kChunkK) * kBStride + kPipeStages * kATile) * sizeof(__half) + (2 * kPipeStages + 2) * sizeof(uint64_t);

// The producer lanes' hand-off after filling a buffer: cp.async completion or plain stores.
template <bool VEC>
__device__ __forceinline__ void producer_arrive(uint64_t* bar) {
  if constexpr (VEC) {
    tc::mbar_arrive_cp_async(bar);
  } else {
    tc::mbar_arrive(bar);
  }
}

// grid (ceil(n / 128) * k_splits), 288 threads (8 consumer warps + 1 producer warp), smem kPipeSmem.
template <bool VEC, bool L1>
__global__ void __launch_bounds__(kThreads + 32, 1) gemm_pipelined_kernel(const GemmParams p) {
  static_assert(VEC || !L1, "the L1 form is a cp.async: 16-byte path only");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* bchunk = reinterpret_cast<__half*>(smem_raw);
  __half* as = bchunk + kChunkK * kBStride;
  uint64_t* a_full = reinterpret_cast<uint64_t*>(as + kPipeStages * kATile);
  uint64_t* a_empty = a_full + kPipeStages;
  uint64_t* b_full = a_empty + kPipeStages;
  uint64_t* b_empty = b_full + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x % p.k_splits, n0 = (blockIdx.x / p.k_splits) * kBN;
  const int mtiles = (p.m + kBM - 1) / kBM;
  int c_begin, c_end;
  split_range(p, split, c_begin, c_end);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kPipeStages; ++s) {
      tc::mbar_init(a_full + s, 32);               // one arrival per producer lane
      tc::mbar_init(a_empty + s, kConsumerWarps);  // one per consumer warp
    }
    tc::mbar_init(b_full, 32);
    tc::mbar_init(b_empty, kConsumerWarps);
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // producer
    int i = 0;                   // A ring position, continuous over the CTA's chunks
    for (int c = c_begin, u = 0; c < c_end; ++c, ++u) {
      const int k0 = c * kChunkK, krows = min(kChunkK, p.k - k0), ktiles = (krows + kBK - 1) / kBK;
      if (u > 0) tc::mbar_wait(b_empty, (u - 1) & 1);
      load_tile<VEC, L1, kBN, kBStride>(bchunk, p.b + static_cast<size_t>(k0) * p.n + n0, p.n, ktiles * kBK, krows, p.n - n0, lane, 32);
      producer_arrive<VEC>(b_full);
      if (p.prefetch && c + 1 < c_end) {  // the next chunk crosses the link while this one is computed
        const int nk0 = k0 + kChunkK, nrows = min(kChunkK, p.k - nk0);
        const int lines = (min(kBN, p.n - n0) * 2 + 127) / 128;
        for (int u2 = lane; u2 < nrows * lines; u2 += 32) {
          tc::prefetch_l2(p.b + static_cast<size_t>(nk0 + u2 / lines) * p.n + n0 + (u2 % lines) * 64);
        }
      }
      for (int step = 0; step < mtiles * ktiles; ++step, ++i) {
        const int s = i % kPipeStages, m0 = (step / ktiles) * kBM, kk = (step % ktiles) * kBK;
        if (i >= kPipeStages) tc::mbar_wait(a_empty + s, ((i / kPipeStages) - 1) & 1);
        load_tile<VEC, false, kBK, kAStride>(as + s * kATile, p.a + static_cast<size_t>(m0) * p.k + k0 + kk, p.k, kBM, p.m - m0, krows - kk, lane, 32);
        producer_arrive<VEC>(a_full + s);
      }
    }
  } else {  // consumers
    float* part = partial_tile(p, split);
    float acc[4][4][4], old[4][4][4];
    int i = 0;
    for (int c = c_begin, u = 0; c < c_end; ++c, ++u) {
      const int krows = min(kChunkK, p.k - c * kChunkK), ktiles = (krows + kBK - 1) / kBK;
      const bool first = c == c_begin;
      tc::mbar_wait(b_full, u & 1);
      for (int step = 0; step < mtiles * ktiles; ++step, ++i) {
        const int s = i % kPipeStages, m0 = (step / ktiles) * kBM, kt = step % ktiles;
        if (kt == 0) {
          zero(acc);
          if (!first) load_partial(old, part, p, m0, n0, warp, lane);
        }
        tc::mbar_wait(a_full + s, (i / kPipeStages) & 1);
        mma_tile(acc, as + s * kATile, bchunk + kt * kBK * kBStride, warp, lane);
        __syncwarp();
        if (lane == 0) tc::mbar_arrive(a_empty + s);
        if (kt == ktiles - 1) {
          if (!first) accumulate(acc, old);
          store_partial(acc, part, p, m0, n0, warp, lane);
        }
      }
      __syncwarp();
      if (lane == 0) tc::mbar_arrive(b_empty);
    }
  }
}

// C[row, col] = sum over the k-splits of the partial C, converted to OutT. One thread per element.
template <typename OutT>
__global__ void gemm_reduce_kernel(const GemmParams p) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<size_t>(p.m) * p.n) return;
  const int row = static_cast<int>(idx / p.n), col = static_cast<int>(idx % p.n);
  float sum = 0.f;
  for (int s = 0; s < p.k_splits; ++s) sum += __ldcg(p.part + (static_cast<size_t>(s) * p.m + row) * p.ldp + col);
  static_cast<OutT*>(p.c)[idx] = from_float(sum, OutT());
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
