// GEMM case study, B-stationary variants `tiled` and `pipelined` (their schedules: gemm_case_study.cuh's header) on
// Hopper wgmma; the reduction of their k-splits is gemm_reduce.cuh. No torch headers (see build.py).
#pragma once

#include "directkv/gemm_case_study.cuh"
#include "directkv/wgmma.cuh"

namespace directkv::gemm {

// The B chunk is stored as two 64-column blocks [2][kChunkK][128 B] (MN-major for wgmma: one 128-byte row per k), A
// tiles as rows of 64 k values (K-major, one 128-byte row per m). A warpgroup computes a 64 x 128 block of C with four
// m64n128k16 per 64-deep k tile. A tiles come by TMA when rows are 16-byte aligned (VEC), else by element loads.

constexpr uint32_t kARowsBytes = 64 * wg::kSwizzleRow;            // 8 KB: 64 rows of an A tile (one warpgroup's)
constexpr uint32_t kATileBytes = kBM * wg::kSwizzleRow;           // 16 KB: a 128-row A tile (tiled)
constexpr uint32_t kBBlockBytes = kChunkK * wg::kSwizzleRow;      // 64 KB: one 64-column block of the B chunk
constexpr uint32_t kBChunkBytes = 2 * kBBlockBytes;               // 128 KB, stationary
constexpr int kWgStages = 6;                                      // tiled: 128-row A ring
constexpr int kWgAhead = kWgStages - 2;                           // tiled: A tiles loaded ahead (one stage drains a wgmma)
constexpr int kPipeStages = 6;                                    // pipelined: 64-row stages per warpgroup ring
constexpr int kWgAccum = 64;                                      // fp32 accumulators per thread
// Dynamic shared memory: slack to round the base up to a swizzle atom, the B chunk, the A ring(s), the mbarriers.
constexpr size_t kTiledSmem = wg::kSwizzleAtom + kBChunkBytes + static_cast<size_t>(kWgStages) * kATileBytes + kWgStages * sizeof(uint64_t);
constexpr size_t kPipeSmem = wg::kSwizzleAtom + kBChunkBytes + 2 * static_cast<size_t>(kPipeStages) * kARowsBytes +
                             (4 * kPipeStages + 8) * sizeof(uint64_t);

// The first swizzle atom boundary at or after p (wgmma's swizzle is on address bits).
__device__ __forceinline__ unsigned char* align_atom(unsigned char* p) {
  return p + ((wg::kSwizzleAtom - (tc::smem_u32(p) & (wg::kSwizzleAtom - 1))) & (wg::kSwizzleAtom - 1));
}

// copy_tile into 128-byte swizzled shared memory at s: 16-byte chunk c of row r lands in 64-column block c / 8
// (block_bytes apart) at wg::swizzle128(r, c % 8).
template <bool VEC, bool L1, int CHUNKS>
__device__ __forceinline__ void load_tile_sw(unsigned char* s, uint32_t block_bytes, const __half* g, int ld, int rows,
                                             int rows_valid, int cols_valid, int tid, int nthreads) {
  copy_tile<VEC, L1, CHUNKS>([&](int r, int c) { return s + (c >> 3) * block_bytes + wg::swizzle128(r, c & 7); }, g,
                             ld, rows, rows_valid, cols_valid, tid, nthreads);
}

// The B chunk starting at k row k0 of the CTA's strip: rows [k0, k0 + krows), zero rows up to the k tile.
template <bool VEC, bool L1>
__device__ __forceinline__ void load_b_chunk(unsigned char* bchunk, const GemmParams& p, int k0, int krows, int n0, int tid, int nthreads) {
  const int rows = (krows + kBK - 1) / kBK * kBK;
  load_tile_sw<VEC, L1, kBN / 8>(bchunk, kBBlockBytes, p.b + static_cast<size_t>(k0) * p.n + n0, p.n, rows, krows, p.n - n0, tid, nthreads);
}

// The ROWS x 64 A tile at rows m0.., columns kc.. by element loads (rows not 16-byte aligned); zeros past m and past
// cols_valid columns (the end of k).
template <int ROWS>
__device__ __forceinline__ void load_a_tile(unsigned char* stage, const GemmParams& p, int m0, int kc, int cols_valid, int tid, int nthreads) {
  load_tile_sw<false, false, kBK / 8>(stage, 0, p.a + static_cast<size_t>(m0) * p.k + kc, p.k, ROWS, p.m - m0, cols_valid, tid, nthreads);
}

// The same tile by TMA (one thread; p.a_map's box is ROWS x 64): the copy unit zero-fills rows past m and columns
// past k, and completes the tile's bytes on `full`.
template <int ROWS>
__device__ __forceinline__ void tma_a_tile(unsigned char* stage, uint64_t* full, const GemmParams& p, int m0, int kc) {
  wg::mbar_arrive_expect_tx(full, ROWS * wg::kSwizzleRow);
  wg::tma_load_2d(stage, &p.a_map, kc, m0, full);
}

// acc (+)= the 64 A rows at a_rows x k tile kt of the B chunk, for the calling warpgroup; `first` starts the sum at
// zero. Committed as one wgmma group, not waited for.
__device__ __forceinline__ void wg_mma_step(float (&acc)[kWgAccum], const unsigned char* a_rows, const unsigned char* bchunk, int kt, bool first) {
  wg::fence();
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    const uint64_t da = wg::desc128(a_rows + ks * 32, 16, wg::kSwizzleAtom);
    const uint64_t db = wg::desc128(bchunk + (kt * kBK + ks * 16) * wg::kSwizzleRow, kBBlockBytes, wg::kSwizzleAtom);
    wg::mma_m64n128k16(acc, da, db, !first || ks > 0);
  }
  wg::commit();
}

// Calls f(h, row, col) for this thread's two fragment rows (h = 0, 1: 8 rows apart) of the warpgroup's 64 x 128 block
// at rows row0.., columns n0..: row `row` holds the pairs acc[4 j + 2 h], acc[4 j + 2 h + 1] at columns col + 8 j,
// col + 8 j + 1 (layout in wgmma.cuh). One row pointer serves all 16 pairs, so their addresses are immediate offsets.
template <typename F>
__device__ __forceinline__ void for_wg_rows(int row0, int n0, int warp, int lane, F&& f) {
  const int row = row0 + (warp % 4) * 16 + (lane >> 2), col = n0 + 2 * (lane & 3);
  f(0, row, col);
  f(1, row + 8, col);
}

// Pulls the 128-byte line at p into L2 (normal priority: the partial C is read once more, soon).
__device__ __forceinline__ void prefetch_line(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ float* partial_tile(const GemmParams& p, int split) {
  return p.part + static_cast<size_t>(p.atomic ? 0 : split) * p.m * p.ldp;
}

// *q += v in L2, by one 16-byte vector reduction (no value comes back, so the thread does not wait for it).
__device__ __forceinline__ void red_add4(float4* q, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(q), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

// Adds fragment row h of acc into the C row at q (this thread's column pair in the row's first 8-column group) by
// 16-byte reductions: lanes 2i and 2i + 1 hold adjacent pairs, so each swaps one pair with the other and sends four
// consecutive floats, the even lane those of the even 8-column groups, the odd lane the odd ones. Half the requests
// of one 8-byte reduction a pair, for the same bytes (L2 was 89% busy with those at 10240^3, ncu 2026-12-04).
// Called by all 32 lanes (the swaps need them); only rows inside C (`valid`) are added.
__device__ __forceinline__ void red_add_row(const float (&acc)[kWgAccum], int h, float* q, bool valid, int lane) {
  const bool odd = lane & 1;
  float* base = q - (odd ? 2 : 0);  // the 4-float run starts at the even lane's pair
#pragma unroll
  for (int j = 0; j < 16; j += 2) {  // indices fixed at compile time and values selected, so acc stays in registers
    const float e0 = acc[4 * j + 2 * h], e1 = acc[4 * j + 2 * h + 1];              // group j's pair
    const float o0 = acc[4 * j + 4 + 2 * h], o1 = acc[4 * j + 4 + 2 * h + 1];      // group j + 1's pair
    const float x = __shfl_xor_sync(0xffffffffu, odd ? e0 : o0, 1), y = __shfl_xor_sync(0xffffffffu, odd ? e1 : o1, 1);
    const float4 v = odd ? make_float4(x, y, o0, o1) : make_float4(e0, e1, x, y);
    if (valid) red_add4(reinterpret_cast<float4*>(base + 8 * (odd ? j + 1 : j)), v);
  }
}

// pipelined in a cluster pair: each CTA's producer fetches half the tile's rows (p.a_map's box is 32 x 64) into the
// stage of both CTAs, so each 64-row tile is read from L2 once for two column strips; each CTA's `full` expects the
// whole tile, its own half and the peer's.
__device__ __forceinline__ void tma_a_half(unsigned char* stage, uint64_t* full, const GemmParams& p, int m0, int kc, int rank) {
  wg::mbar_arrive_expect_tx(full, 64 * wg::kSwizzleRow);
  wg::tma_load_2d_multicast(stage + rank * 32 * wg::kSwizzleRow, &p.a_map, kc, m0 + 32 * rank, full, 0x3);
}

// Pulls the block's partial C of earlier chunks into L2 when its k loop starts, so the end of the block reads it from
// L2. (Holding it in registers across the k loop was slower: the wgmma fence waits for those loads; session 38.)
__device__ __forceinline__ void prefetch_partial(bool first, const float* part, const GemmParams& p, int row0, int n0, int warp, int lane) {
  if (first || p.atomic) return;
  // The four lanes sharing a fragment row cover its 128 floats: one of them pulls the row's four 128-byte lines.
  for_wg_rows(row0, n0, warp, lane, [&](int, int row, int col) {
    if (row < p.m && (lane & 3) == 0) {
      const float* q = part + static_cast<size_t>(row) * p.ldp + col;
      prefetch_line(q);
      prefetch_line(q + 32);
      prefetch_line(q + 64);
      prefetch_line(q + 96);
    }
  });
}

// Waits for the warpgroup's wgmma, adds the partial C of earlier chunks (unless first) and stores the block into the
// split's partial C; when atomic, adds the block into the shared fp32 C in L2 instead.
__device__ __forceinline__ void finish_block(float (&acc)[kWgAccum], bool first, float* part, const GemmParams& p, int row0, int n0, int warp, int lane) {
  wg::wait<0>();
  wg::touch(acc);
  for_wg_rows(row0, n0, warp, lane, [&](int h, int row, int col) {
    if (p.atomic) {  // row may be past m: the pointer is only formed, never used, there
      red_add_row(acc, h, part + static_cast<size_t>(row) * p.ldp + col, row < p.m, lane);
      return;
    }
    if (row < p.m) {
      float2* q = reinterpret_cast<float2*>(part + static_cast<size_t>(row) * p.ldp + col);
      if (!first) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float2 v = __ldcg(q + 4 * j);
          acc[4 * j + 2 * h] += v.x;
          acc[4 * j + 2 * h + 1] += v.y;
        }
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) __stcg(q + 4 * j, make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
    }
  });
}

// Pulls the B chunk at k row k0 of the CTA's strip into L2, by the 64 B-loading producer threads: prefetch hints
// (kPrefetchHint, one a 128-byte line) or plain loads whose values are dropped (kPrefetchLoad, one a 32-byte sector,
// kTouchDepth in flight a thread), which L2 must serve, where a hint may be dropped. Each row's lines / sectors are
// counted from its length, so a row that does not start on one (n % 64 resp. n % 16 != 0) misses its last. Measured
// (2026-12-04): no form faster than none; kept to show it.
constexpr int kTouchDepth = 8;
__device__ __forceinline__ void prefetch_b_chunk(const GemmParams& p, int k0, int n0, int tid) {
  const int rows = min(kChunkK, p.k - k0), bytes = min(kBN, p.n - n0) * 2;
  const __half* base = p.b + static_cast<size_t>(k0) * p.n + n0;
  if (p.prefetch == kPrefetchHint) {
    const int lines = (bytes + 127) / 128;
    for (int u = tid; u < rows * lines; u += 64) tc::prefetch_l2(base + static_cast<size_t>(u / lines) * p.n + (u % lines) * 64);
    return;
  }
  // one element (2 bytes: a row may start at any element) every 16, so every 32 bytes
  const int sectors = (bytes + 31) / 32, total = rows * sectors;
  unsigned short sink = 0;
  for (int u0 = tid; u0 < total; u0 += 64 * kTouchDepth) {
    unsigned short v[kTouchDepth];
#pragma unroll
    for (int d = 0; d < kTouchDepth; ++d) {
      const int u = u0 + d * 64;
      v[d] = u < total ? __ldcg(reinterpret_cast<const unsigned short*>(base + static_cast<size_t>(u / sectors) * p.n + (u % sectors) * 16)) : 0;
    }
#pragma unroll
    for (int d = 0; d < kTouchDepth; ++d) sink ^= v[d];
  }
  asm volatile("" ::"h"(sink));  // the loads' values are used, so they are kept
}

// The CTA's column strip (n0) and k-split. Splits outer, strips inner: the CTAs resident together work on the same
// split, so they stream the same columns of A (one split's 512 k columns of every row, ~10 MB at m = 10240) row by
// row at about the same pace, and L2 serves one CTA's A tiles to the others. With strips outer (one strip's splits
// together), each resident CTA streamed other columns of A, and A's re-reads came from DRAM: ncu, 10240^3, 20
// splits, 2026-12-04: 17-23 GB of DRAM reads per call, 8.6 GB of them beyond the partial C.
// When atomic, splits in groups of kAtomicGroup, strips inner, the group's splits innermost: the CTAs resident together
// are a few strips x a group of splits, so each strip's rows of C take the group's additions while L2 holds them, and
// each split's columns of A serve several strips. (All splits of a strip together kept C in L2 but sent A's re-reads
// to DRAM: 16.8 GB read a call at 10240^3, 2026-12-04.)
// In clusters of C = 2 (pipelined), a cluster is a pair of adjacent strips on the same split, ordered as one CTA.
constexpr int kAtomicGroup = 8;
template <int C>
__device__ __forceinline__ void strip_and_split(const GemmParams& p, int block, int& n0, int& split) {
  constexpr int c = C;
  const int id = block / c, rank = block % c;
  const int strips = (p.n + kBN - 1) / kBN / c;  // of the cluster's c strips
  int strip;
  if (p.atomic) {
    const int per_group = strips * kAtomicGroup, g = id / per_group;
    const int r = id % per_group, size = min(kAtomicGroup, p.k_splits - g * kAtomicGroup);
    strip = r / size;
    split = g * kAtomicGroup + r % size;
  } else {
    strip = id % strips;
    split = id / strips;
  }
  n0 = (strip * c + rank) * kBN;
}

// A CTA's share of a strip: chunks [begin, end) of split `split`.
__device__ __forceinline__ void split_range(const GemmParams& p, int split, int& begin, int& end) {
  begin = static_cast<int>(static_cast<int64_t>(split) * p.chunks / p.k_splits);
  end = static_cast<int>(static_cast<int64_t>(split + 1) * p.chunks / p.k_splits);
}

// pipelined's work items, (column strip n0, chunk c) in the order the CTA takes them: its k-split's chunks of one
// strip; or, persistent (p.stage; one chunk a split), items b, b + G, b + 2 G, ... of the strips x chunks items in
// strip_and_split's order (b = the CTA's cluster, G = the grid's clusters), so the CTAs at work together keep the
// one-chunk-a-CTA grid's L2 sharing.
template <int CL>
struct WorkItems {
  int count;
  __device__ explicit WorkItems(const GemmParams& p) {
    if (p.stage) {
      const int clusters = static_cast<int>(gridDim.x) / CL, total = (p.n + kBN - 1) / kBN / CL * p.chunks;
      const int b = static_cast<int>(blockIdx.x) / CL;
      count = b < total ? (total - b + clusters - 1) / clusters : 0;
    } else {
      int n0, split, begin, end;
      strip_and_split<CL>(p, static_cast<int>(blockIdx.x), n0, split);
      split_range(p, split, begin, end);
      count = end - begin;
    }
  }
  __device__ void at(const GemmParams& p, int u, int& n0, int& c) const {
    const int rank = static_cast<int>(blockIdx.x) % CL;
    if (p.stage) {
      const int item = static_cast<int>(blockIdx.x) / CL + u * (static_cast<int>(gridDim.x) / CL);
      strip_and_split<CL>(p, item * CL + rank, n0, c);
    } else {
      int split, end;
      strip_and_split<CL>(p, static_cast<int>(blockIdx.x), n0, split);
      split_range(p, split, c, end);
      c += u;
    }
  }
};

// persistent: the B-loading producer threads (tid 0..nthreads-1) copy the chunk at k0 of strip n0 from host memory
// into an HBM slot of the CTA, already in the shared-memory layout (load_b_chunk's: swizzled, zeros past k and n),
// while the consumers compute an earlier chunk; load_staged_chunk later moves the slot into shared memory at HBM
// speed. With one slot the same threads do both and copy the same 16-byte pieces in both, so each thread's program
// order puts its stores before its reloads; with two, the slot_full / slot_empty mbarriers order them.
// DEPTH loads in flight a thread: one slot, 64 threads x 2 x 16 B = 2 KB an SM, 270 KB over 132 SMs, about twice
// what the link needs in flight (51 GB/s x ~2 us); deeper spilled within the producers' registers then.
template <int DEPTH>
__device__ __forceinline__ void stage_b_chunk(unsigned char* slot, const GemmParams& p, int k0, int krows, int n0, int tid, int nthreads) {
  const int pieces = (krows + kBK - 1) / kBK * kBK * (kBN / 8), cols = p.n - n0;
  const __half* base = p.b + static_cast<size_t>(k0) * p.n + n0;
  for (int u0 = tid; u0 < pieces; u0 += nthreads * DEPTH) {
    uint4 v[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int u = u0 + d * nthreads, r = u / (kBN / 8), c = u % (kBN / 8);
      v[d] = u < pieces && r < krows && c * 8 < cols ? __ldcg(reinterpret_cast<const uint4*>(base + static_cast<size_t>(r) * p.n + c * 8))
                                                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int u = u0 + d * nthreads, r = u / (kBN / 8), c = u % (kBN / 8);
      if (u < pieces) __stcg(reinterpret_cast<uint4*>(slot + (c >> 3) * kBBlockBytes + wg::swizzle128(r, c & 7)), v[d]);
    }
  }
}

// The staged chunk from the slot into shared memory by cp.async (.cg: an earlier chunk's bytes of the slot may sit in
// L1); the caller waits for it.
__device__ __forceinline__ void load_staged_chunk(unsigned char* bchunk, const unsigned char* slot, int krows, int tid, int nthreads) {
  const int pieces = (krows + kBK - 1) / kBK * kBK * (kBN / 8);
  for (int u = tid; u < pieces; u += nthreads) {
    const int r = u / (kBN / 8), c = u % (kBN / 8);
    const uint32_t off = (c >> 3) * kBBlockBytes + wg::swizzle128(r, c & 7);
    cp_async16<0>(bchunk + off, slot + off);
  }
}

// grid (ceil(n / 128) * k_splits), 256 threads (two warpgroups, which also load), smem kTiledSmem. One 128-row A ring
// shared by both warpgroups (rows [64 w, 64 w + 64) of each tile are warpgroup w's), refilled after a CTA barrier;
// A tiles by TMA (p.a_map box 128 x 64) when VEC.
template <bool VEC, bool L1>
__global__ void __launch_bounds__(kThreads, 1) gemm_tiled_kernel(const __grid_constant__ GemmParams p) {
  static_assert(VEC || !L1, "the L1 form is a cp.async: 16-byte path only");
  extern __shared__ unsigned char smem_sw[];
  unsigned char* bchunk = align_atom(smem_sw);
  unsigned char* as = bchunk + kBChunkBytes;
  uint64_t* a_full = reinterpret_cast<uint64_t*>(as + kWgStages * kATileBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wgi = wg::warpgroup_index();
  int n0, split;
  strip_and_split<1>(p, static_cast<int>(blockIdx.x), n0, split);
  const int mtiles = (p.m + kBM - 1) / kBM;
  float* part = partial_tile(p, split);
  int c_begin, c_end;
  split_range(p, split, c_begin, c_end);
  if (VEC && threadIdx.x == 0) {
    for (int s = 0; s < kWgStages; ++s) tc::mbar_init(a_full + s, 1);
    wg::fence_mbarrier_init();
  }
  float acc[kWgAccum];
  int g = 0;  // A ring position, continuous over the CTA's chunks
  for (int c = c_begin; c < c_end; ++c) {
    const int k0 = c * kChunkK, krows = min(kChunkK, p.k - k0), ktiles = (krows + kBK - 1) / kBK;
    __syncthreads();  // every wgmma of the previous chunk has been waited for (and the mbarriers are initialised)
    load_b_chunk<VEC, L1>(bchunk, p, k0, krows, n0, threadIdx.x, kThreads);
    cp_async_commit();
    tc::cp_async_wait_all();
    wg::fence_proxy_async();
    __syncthreads();
    const bool first = c == c_begin;
    const int steps = mtiles * ktiles;  // (row tile, k tile) pairs, A tiles streamed in this order
    // The A tile of step `step` (of this chunk) into ring stage `st`.
    auto load_a = [&](int step, int st) {
      const int m0 = (step / ktiles) * kBM, kt = step % ktiles;
      if constexpr (VEC) {
        if (threadIdx.x == 0) tma_a_tile<kBM>(as + st * kATileBytes, a_full + st, p, m0, k0 + kt * kBK);
      } else {
        load_a_tile<kBM>(as + st * kATileBytes, p, m0, k0 + kt * kBK, krows - kt * kBK, threadIdx.x, kThreads);
      }
    };
    for (int s = 0; s < kWgAhead && s < steps; ++s) load_a(s, (g + s) % kWgStages);
    // Row tiles outer, k tiles inner, so every k step ends in the same wgmma state (one group in flight) and the
    // tile's end in none: ptxas then keeps the wgmma of step i running while step i + 1 is set up (a loop whose
    // steps end in either state got a full wait injected at every step).
    for (int t = 0, i = 0; t < mtiles; ++t) {
      const int row0 = t * kBM + wgi * 64;
      prefetch_partial(first, part, p, row0, n0, warp, lane);
      for (int kt = 0; kt < ktiles; ++kt, ++i, ++g) {
        const int st = g % kWgStages;
        if constexpr (VEC) {
          tc::mbar_wait(a_full + st, (g / kWgStages) & 1);
        } else {
          wg::fence_proxy_async();
        }
        // A tile i landed for everyone, and the wgmma of step i - 2, which read the stage refilled next, is done
        // in both warpgroups (each waited for it in step i - 1).
        __syncthreads();
        if (i + kWgAhead < steps) load_a(i + kWgAhead, (g + kWgAhead) % kWgStages);
        wg_mma_step(acc, as + st * kATileBytes + wgi * kARowsBytes, bchunk, kt, kt == 0);
        wg::wait<1>();  // step i - 1 done; step i may run on
      }
      finish_block(acc, first, part, p, row0, n0, warp, lane);
    }
  }
}

// Registers per thread after the split: the producer warpgroup needs few, the consumers hold the accumulators.
// 128 x (2 x 224 + 56) = 64,512 of the SM's 65,536 (the producers' B staging spilled within 40).
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
constexpr int kPipeThreads = kThreads + 128;

// A producer thread's hand-off of a buffer it filled (its cp.async landed, or plain stores): the proxy fence makes the
// bytes visible to wgmma, and the arrival (a release) orders everything the thread saw before it, so a consumer that
// waits on `bar` also sees what the producer had acquired: the partial C stored by the other warpgroup before it
// released the previous B chunk (an arrival triggered by cp.async completion carries no such ordering).
__device__ __forceinline__ void producer_arrive(uint64_t* bar) {
  wg::fence_proxy_async();
  tc::mbar_arrive(bar);
}

// One arrival per consumer warp on `bar` once the whole warp is past its reads of the buffer (or its turn).
__device__ __forceinline__ void warp_arrive(uint64_t* bar, int lane) {
  __syncwarp();
  if (lane == 0) tc::mbar_arrive(bar);
}

// A consumer warp's release of an A ring stage: in a cluster pair (CL = 2) the peer's producer writes half of this
// stage too, so the release goes to the same `empty` in both CTAs.
template <int CL>
__device__ __forceinline__ void release_stage(uint64_t* bar, int lane, int rank) {
  warp_arrive(bar, lane);
  if constexpr (CL > 1) {
    if (lane == 0) wg::mbar_arrive_cluster(bar, rank ^ 1);
  }
}

// persistent with two HBM slots (p.stage_slots 2): producer warp 10 moves each item's chunk into shared memory
// (the first straight from the host, the others from their slot) once the consumers are done with the previous
// one, and warp 11 stages the chunks of items 1, 2, ... into the two slots in turn, as far ahead as a free slot
// allows, so a CTA's share of the link is not idle while warp 10 waits for the consumers (with one slot the staging
// of the next chunk starts only once the current one is in shared memory). Item u >= 1 uses slot u % 2 for the
// ((u - 1) / 2)-th time. DEPTH 4: 32 stager threads x 4 x 16 B = 2 KB in flight an SM, as one slot's 64 x 2.
template <bool L1, int CL>
__device__ __forceinline__ void b_producers_two_slots(unsigned char* bchunk, const GemmParams& p, const WorkItems<CL>& items, uint64_t* b_full,
                                                      uint64_t* b_empty, uint64_t* slot_full, uint64_t* slot_empty, bool loader, int lane) {
  unsigned char* slots = p.stage + static_cast<size_t>(blockIdx.x) * 2 * kBChunkBytes;
  if (loader) {
    for (int u = 0; u < items.count; ++u) {
      int n0, c;
      items.at(p, u, n0, c);
      const int k0 = c * kChunkK, krows = min(kChunkK, p.k - k0), s = u & 1;
      if (u > 0) {
        tc::mbar_wait(b_empty, (u - 1) & 1);
        tc::mbar_wait(slot_full + s, ((u - 1) >> 1) & 1);
        load_staged_chunk(bchunk, slots + s * kBChunkBytes, krows, lane, 32);
      } else {
        load_b_chunk<true, L1>(bchunk, p, k0, krows, n0, lane, 32);
      }
      tc::cp_async_wait_all();
      if (u > 0) tc::mbar_arrive(slot_empty + s);  // the slot's bytes are in shared memory: the stager may refill it
      producer_arrive(b_full);
    }
  } else {
    for (int u = 1; u < items.count; ++u) {
      const int s = u & 1, use = (u - 1) >> 1;
      if (use > 0) tc::mbar_wait(slot_empty + s, (use - 1) & 1);
      int n0, c;
      items.at(p, u, n0, c);
      stage_b_chunk<4>(slots + s * kBChunkBytes, p, c * kChunkK, min(kChunkK, p.k - c * kChunkK), n0, lane, 32);
      producer_arrive(slot_full + s);  // a release: the loader's acquire sees the slot's stores
    }
  }
}

// grid (ceil(n / 128) * k_splits), or persistent (p.stage) as many CTAs as are resident at once, 384 threads, smem
// kPipeSmem; clusters of (CL, 1, 1). Warp specialisation with ping-pong consumers:
// - the C strip of each item (WorkItems) is cut into 64-row blocks, taken by the two consumer warpgroups in turn
//   (block b of the CTA's whole sequence, over all its items, is warpgroup b % 2's), each with its own A ring of
//   64-row tiles;
// - the warpgroups take turns at the tensor cores (`turn` mbarriers): one issues all the wgmma of its block and hands
//   the turn over, then stores its block while the other computes, so stores overlap math;
// - producer warp 8 + w fills ring w (one thread by TMA, box 64 x 64, when VEC; the warp's lanes otherwise), warps 10
//   and 11 load each B chunk once its last reader is done, then copy the next item's chunk from the host into the
//   CTA's HBM slot (persistent) or pull it into L2 (p.prefetch); with two slots (p.stage_slots 2) warp 11 stages
//   ahead while warp 10 loads (b_producers_two_slots);
// - in a cluster pair (CL = 2: two adjacent strips, same split, so the same A tiles in the same order) each
//   ring producer fetches half of every A tile for both CTAs (tma_a_half), and a stage is refilled once the
//   consumers of both CTAs have released it.
template <bool VEC, bool L1, int CL>
__global__ void __launch_bounds__(kPipeThreads, 1) gemm_pipelined_kernel(const __grid_constant__ GemmParams p) {
  static_assert(VEC || !L1, "the L1 form is a cp.async: 16-byte path only");
  static_assert(CL == 1 || (CL == 2 && VEC), "cluster pairs share A tiles by TMA multicast: 16-byte path only");
  extern __shared__ unsigned char smem_sw[];
  unsigned char* bchunk = align_atom(smem_sw);
  unsigned char* rings = bchunk + kBChunkBytes;  // [2][kPipeStages][64 rows]
  uint64_t* full = reinterpret_cast<uint64_t*>(rings + 2 * kPipeStages * kARowsBytes);  // [2][kPipeStages]
  uint64_t* empty = full + 2 * kPipeStages;                                             // [2][kPipeStages]
  uint64_t* b_full = empty + 2 * kPipeStages;
  uint64_t* b_empty = b_full + 1;
  uint64_t* turn = b_empty + 1;  // [2]: warpgroup w may issue its next block's wgmma
  uint64_t* slot_full = turn + 2;  // [2]: two-slot staging (b_producers_two_slots)
  uint64_t* slot_empty = slot_full + 2;
  const bool two_slots = VEC && p.stage && p.stage_slots == 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wgi = wg::warpgroup_index();
  const int rank = static_cast<int>(blockIdx.x) % CL;  // = %cluster_ctarank: clusters are (CL, 1, 1)
  const int blocks = (p.m + 63) / 64;  // 64-row blocks of C per chunk
  const WorkItems<CL> items(p);
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2 * kPipeStages; ++s) {
      tc::mbar_init(full + s, VEC ? 1 : 32);  // the TMA issuer's arrival, or one per lane of the ring's producer warp
      tc::mbar_init(empty + s, 4 * CL);  // one per warp of the ring's consumer warpgroups (in each CTA)
    }
    tc::mbar_init(b_full, two_slots ? 32 : 64);  // one per B-loading producer thread (two slots: the loader warp's)
    for (int s = 0; s < 2; ++s) {
      tc::mbar_init(slot_full + s, 32);   // one per stager thread
      tc::mbar_init(slot_empty + s, 32);  // one per loader thread
    }
    tc::mbar_init(b_empty, kConsumerWarps);       // one per consumer warp
    tc::mbar_init(turn, 4);
    tc::mbar_init(turn + 1, 4);
    wg::fence_mbarrier_init();
  }
  if constexpr (CL > 1) {
    wg::cluster_sync();  // the peer's barriers are initialised before this CTA signals them
  } else {
    __syncthreads();
  }

  if (wgi == 2) {  // producer warpgroup
    wg::set_max_regs_dec<kProducerRegs>();
    const int pw = warp - kConsumerWarps;  // 0, 1: ring producers; 2, 3: B chunk
    if (pw >= 2 && two_slots) {
      if constexpr (VEC) b_producers_two_slots<L1, CL>(bchunk, p, items, b_full, b_empty, slot_full, slot_empty, pw == 2, lane);
    } else if (pw >= 2) {
      const int tid = threadIdx.x - kThreads - 64;
      unsigned char* slot = p.stage + static_cast<size_t>(blockIdx.x) * kBChunkBytes;
      for (int u = 0; u < items.count; ++u) {
        int n0, c;
        items.at(p, u, n0, c);
        const int k0 = c * kChunkK, krows = min(kChunkK, p.k - k0);
        if (u > 0) tc::mbar_wait(b_empty, (u - 1) & 1);
        const bool staged = VEC && p.stage;  // persistent runs on the 16-byte path only (the launcher's check)
        if (staged && u > 0) {
          load_staged_chunk(bchunk, slot, krows, tid, 64);  // staged while the previous chunk was computed
        } else {
          load_b_chunk<VEC, L1>(bchunk, p, k0, krows, n0, tid, 64);
        }
        if constexpr (VEC) tc::cp_async_wait_all();
        producer_arrive(b_full);
        if (u + 1 == items.count) continue;
        int n1, c1;
        items.at(p, u + 1, n1, c1);
        if (staged) {  // the next chunk crosses the link into HBM while this one is computed
          stage_b_chunk<2>(slot, p, c1 * kChunkK, min(kChunkK, p.k - c1 * kChunkK), n1, tid, 64);
        } else if (p.prefetch != kPrefetchNone) {
          // The same into L2. Issued only now: prefetches issued beside the chunk's own loads shared the link with
          // them and delayed the chunk (no gain measured, 2026-12-04).
          prefetch_b_chunk(p, c1 * kChunkK, n1, tid);
        }
      }
    } else if (!VEC || lane == 0) {
      unsigned char* ring = rings + pw * kPipeStages * kARowsBytes;
      uint64_t *rfull = full + pw * kPipeStages, *rempty = empty + pw * kPipeStages;
      int i = 0;  // ring position
      for (int u = 0; u < items.count; ++u) {
        int n0, c;
        items.at(p, u, n0, c);
        const int k0 = c * kChunkK, krows = min(kChunkK, p.k - k0), ktiles = (krows + kBK - 1) / kBK;
        for (int b = (pw + u * blocks) % 2; b < blocks; b += 2) {  // this ring's blocks of the chunk
          for (int kt = 0; kt < ktiles; ++kt, ++i) {
            const int s = i % kPipeStages;
            if (i >= kPipeStages) tc::mbar_wait(rempty + s, ((i / kPipeStages) - 1) & 1);
            if constexpr (VEC) {
              if constexpr (CL > 1) {
                tma_a_half(ring + s * kARowsBytes, rfull + s, p, b * 64, k0 + kt * kBK, rank);
              } else {
                tma_a_tile<64>(ring + s * kARowsBytes, rfull + s, p, b * 64, k0 + kt * kBK);
              }
            } else {
              load_a_tile<64>(ring + s * kARowsBytes, p, b * 64, k0 + kt * kBK, krows - kt * kBK, lane, 32);
              producer_arrive(rfull + s);
            }
          }
        }
      }
    }
  } else {  // consumer warpgroup wgi
    wg::set_max_regs_inc<kConsumerRegs>();
    int n0, split = 0;  // the CTA's k-split (persistent CTAs have none: they add into the one fp32 C)
    if (!p.stage) strip_and_split<CL>(p, static_cast<int>(blockIdx.x), n0, split);
    float* part = partial_tile(p, split);
    unsigned char* ring = rings + wgi * kPipeStages * kARowsBytes;
    uint64_t *rfull = full + wgi * kPipeStages, *rempty = empty + wgi * kPipeStages;
    float acc[kWgAccum];
    int i = 0, turns = 0;  // ring position; turns taken
    for (int u = 0; u < items.count; ++u) {
      int c;
      items.at(p, u, n0, c);
      const int krows = min(kChunkK, p.k - c * kChunkK), ktiles = (krows + kBK - 1) / kBK;
      const bool first = u == 0;
      tc::mbar_wait(b_full, u & 1);
      wg::fence_proxy_async();  // the B chunk's generic-proxy writes (cp.async or stores) made visible to wgmma
      for (int b = (wgi + u * blocks) % 2; b < blocks; b += 2) {
        const int row0 = b * 64;
        prefetch_partial(first, part, p, row0, n0, warp, lane);
        // Warpgroup 0 opens the CTA's sequence; after that each waits until the other has issued its block.
        if (wgi == 1 || turns > 0) tc::mbar_wait(turn + wgi, (turns - (wgi == 0)) & 1);
        int held = 0;  // the ring stage of the previous step, whose wgmma may still be reading it
        for (int kt = 0; kt < ktiles; ++kt, ++i) {
          const int s = i % kPipeStages;
          tc::mbar_wait(rfull + s, (i / kPipeStages) & 1);
          if constexpr (!VEC) wg::fence_proxy_async();  // TMA writes are already in the async proxy
          wg_mma_step(acc, ring + s * kARowsBytes, bchunk, kt, kt == 0);
          wg::wait<1>();
          if (kt > 0) release_stage<CL>(rempty + held, lane, rank);
          held = s;
        }
        warp_arrive(turn + (1 - wgi), lane);  // every wgmma of this block is issued: the other warpgroup's turn
        ++turns;
        finish_block(acc, first, part, p, row0, n0, warp, lane);
        release_stage<CL>(rempty + held, lane, rank);
      }
      warp_arrive(b_empty, lane);  // every wgmma reading this chunk has been waited for
    }
  }
  if constexpr (CL > 1) wg::cluster_sync();  // no CTA leaves while its peer may still write its stages or barriers
}

}  // namespace directkv::gemm
