// GEMM case study, variant `ring`: B streamed once across the link by SM loads into a small HBM ring shared by all
// CTAs, and consumed output-stationary (Hopper wgmma, A and B tiles by TMA). Beyond the paper's schedules: the
// B-stationary kernels (gemm_stationary.cuh) add every chunk's fp32 product into C (8.4 GB of reductions at
// 10240^3), where here each C tile is summed in registers over all of k and written once.
//
// Schedule. Column strips of 128 are grouped into bands of p.ring_band strips. A tile is 256 rows x one strip; the
// tiles are numbered band by band, and within a band row tile outer, strip inner, so the CTAs at work together read
// the same A rows at about the same time (L2 serves the band's other strips). Persistent CTAs (all resident at once)
// take tiles c, c + G, c + 2G, ... Three stager warps per CTA copy B from the host into the ring one unit at a time
// (64 k rows x one strip, 16 KB, already in the 128-byte swizzled layout wgmma reads), units numbered band by band,
// k tile outer and strip inner. Each unit is cut into kRingSlices slices of 2 KB, stager s of the grid's 3G taking
// slices s, s + 3G, ... of that order, so the ~400 stagers work on ~50 consecutive units at a time and units land in
// order, a few microseconds apart (a unit a stager landed ~400 units at once, every ~130 us at 10240^3: measured
// 4.47 ms against 4.08 of link). A unit's count goes up (release) as each slice is stored; the tile's TMA producer
// waits for (acquires) all its slices before copying the unit into shared memory. The ring holds p.ring_slots bands; a band's slot is refilled once every tile of the band that
// used it has read all its units (the band's `done` count). So B crosses the link once, every CTA's share of the
// link is busy whatever its consumers do, and a tile starts on its band's first k rows while the rest arrive.
//
// Deadlock freedom rests on every CTA being resident at once (the launcher sizes the grid by occupancy) and on
// each CTA taking its tiles, and each stager its units, in increasing order: the units of band b wait only for the
// tiles of band b - slots, which wait only for units of that band. A wait that outlives kRingWatchdogNs traps (a
// launch failure, not a hang). The residency check assumes the GPU is otherwise idle: kernels of other streams, MPS
// or green contexts that keep some CTAs from starting make the others wait for their stagers, and the trap then
// ends the process's CUDA context. (Handing out slices and tiles by atomic tickets, in order, would let any number
// of resident CTAs finish: not done.) No torch headers (see build.py).
#pragma once

#include <type_traits>

#include "directkv/gemm_stationary.cuh"  // align_atom, warp_arrive, the register split; gemm_case_study.cuh, wgmma.cuh

namespace directkv::gemm {

constexpr int kRingBM = 256;                                         // C rows per tile: two warpgroups x 128
constexpr uint32_t kRingATileBytes = kRingBM * wg::kSwizzleRow;      // 32 KB: 256 rows x 64 k
constexpr uint32_t kRingBBlockBytes = kBK * wg::kSwizzleRow;         // 8 KB: 64 k rows x 64 columns
constexpr uint32_t kRingUnitBytes = 2 * kRingBBlockBytes;            // 16 KB: 64 k rows x one 128-column strip
constexpr uint32_t kRingStageBytes = kRingATileBytes + kRingUnitBytes;
constexpr int kRingStages = 4;
constexpr int kRingStagerWarps = 3, kRingStagerDepth = 4;            // 3 x 32 x 4 x 16 B = 6 KB in flight an SM
constexpr int kRingSlices = kBK * (kBN / 8) / (32 * kRingStagerDepth); // 8 slices of 2 KB (one load round of a warp) a unit
constexpr int kRingThreads = kThreads + 128;                         // two consumer warpgroups, one producer
constexpr size_t kRingSmem = wg::kSwizzleAtom + kRingStages * static_cast<size_t>(kRingStageBytes) + 2 * kRingStages * sizeof(uint64_t);
static_assert(kRingSmem <= 232448, "ring: shared memory past the H200's 227 KB a block");
constexpr unsigned long long kRingWatchdogNs = 4000000000ull;

// The ring's geometry, from p (the same arithmetic on host and device).
struct RingPlan {
  int strips, ktiles, mtiles, band, bands, slots;
  __host__ __device__ explicit RingPlan(const GemmParams& p)
      : strips((p.n + kBN - 1) / kBN), ktiles((p.k + kBK - 1) / kBK), mtiles((p.m + kRingBM - 1) / kRingBM), band(p.ring_band),
        bands((strips + p.ring_band - 1) / p.ring_band), slots(p.ring_slots) {}
  __host__ __device__ int width(int b) const { return min(band, strips - b * band); }  // strips of band b
  __host__ __device__ int tiles() const { return mtiles * strips; }
  __host__ __device__ int unit_slots() const { return bands * band * ktiles; }  // unit numbers (the last band's partly unused)
  // Tile w: band b, strip s (of all), row tile mt.
  __host__ __device__ void tile(int w, int& b, int& s, int& mt) const {
    b = w / (mtiles * band);
    const int r = w - b * mtiles * band, wb = width(b);
    mt = r / wb;
    s = b * band + r % wb;
  }
  // The unit number of k tile t of strip s in band b, and its bytes in the ring.
  __host__ __device__ int unit(int b, int s, int t) const { return b * band * ktiles + t * width(b) + (s - b * band); }
  __host__ __device__ size_t offset(int b, int s, int t) const {
    return (static_cast<size_t>(b % slots) * band * ktiles + t * width(b) + (s - b * band)) * kRingUnitBytes;
  }
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
  return t;
}

// Spins until *p >= want (acquire: what the writer stored before its release is visible after). Traps after
// kRingWatchdogNs, so a broken hand-off ends the launch with an error instead of hanging the GPU.
__device__ __forceinline__ void wait_at_least(const unsigned* p, unsigned want) {
  if (ld_acquire(p) >= want) return;
  const unsigned long long t0 = global_ns();
  while (ld_acquire(p) < want) {
    __nanosleep(128);
    if (global_ns() - t0 > kRingWatchdogNs) __trap();
  }
}

// Orders this thread's generic-proxy accesses to global memory against its async-proxy (TMA) ones: the stagers'
// plain stores are read by another CTA's bulk copy.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// `bytes` (a multiple of 16) from global src into shared dst by the copy unit, completed on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(tc::smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(tc::smem_u32(bar))
               : "memory");
}

// One stager warp copies slice `slice` of unit (k tile t of the strip at column n0) from the host into the unit's
// bytes `dst` in the ring: the unit is 64 rows x 16 pieces of 16 B, piece (r, c) going to 64-column block c / 8 at
// swizzle128(r, c % 8); the slice is pieces [128 slice, 128 slice + 128), 8 rows, one load per lane and depth step.
// Zeros past k and n.
__device__ __forceinline__ void stage_slice(unsigned char* dst, const GemmParams& p, int t, int n0, int slice, int lane) {
  const int k0 = t * kBK, rows = min(kBK, p.k - k0), cols = p.n - n0;
  const __half* base = p.b + static_cast<size_t>(k0) * p.n + n0;
  const int u0 = slice * 32 * kRingStagerDepth + lane;
  uint4 v[kRingStagerDepth];
#pragma unroll
  for (int d = 0; d < kRingStagerDepth; ++d) {
    const int u = u0 + 32 * d, r = u / (kBN / 8), c = u % (kBN / 8);
    v[d] = r < rows && c * 8 < cols ? __ldcg(reinterpret_cast<const uint4*>(base + static_cast<size_t>(r) * p.n + c * 8)) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int d = 0; d < kRingStagerDepth; ++d) {
    const int u = u0 + 32 * d, r = u / (kBN / 8), c = u % (kBN / 8);
    __stcg(reinterpret_cast<uint4*>(dst + (c >> 3) * kRingBBlockBytes + wg::swizzle128(r, c & 7)), v[d]);
  }
}

// Stager warp `g` of the grid's `count`: its slices in order, each once its band's ring slot is free, then a count
// on its unit.
__device__ __forceinline__ void ring_stager(const GemmParams& p, const RingPlan& plan, int g, int count, int lane) {
  unsigned* counts = p.ring_sync;
  const unsigned* done = p.ring_sync + plan.unit_slots();
  int free_below = plan.slots;  // the bands known to have a free slot
  for (int q = g; q < plan.unit_slots() * kRingSlices; q += count) {
    const int u = q / kRingSlices, slice = q % kRingSlices;
    const int b = u / (plan.band * plan.ktiles), r = u - b * plan.band * plan.ktiles, wb = plan.width(b);
    if (r >= wb * plan.ktiles) continue;  // a number the narrower last band does not use
    const int t = r / wb, s = b * plan.band + r % wb;
    if (b >= free_below) {  // the slot's previous band: every tile has read its units (two warpgroups a tile)
      if (lane == 0) wait_at_least(done + (b - plan.slots), 2u * plan.mtiles * plan.width(b - plan.slots));
      __syncwarp();
      free_below = b + 1;
    }
    stage_slice(p.stage + plan.offset(b, s, t), p, t, s * kBN, slice, lane);
    fence_proxy_async_global();
    __threadfence();
    __syncwarp();
    if (lane == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counts + u) : "memory");
  }
}

// One warpgroup's 128 x 128 block: acc0 rows 0..63, acc1 rows 64..127, each (+)= the stage's A rows x its B unit.
__device__ __forceinline__ void ring_mma_step(float (&acc0)[kWgAccum], float (&acc1)[kWgAccum], const unsigned char* a_rows,
                                              const unsigned char* unit, bool first) {
  wg::fence();
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    const uint64_t db = wg::desc128(unit + ks * 16 * wg::kSwizzleRow, kRingBBlockBytes, wg::kSwizzleAtom);
    wg::mma_m64n128k16(acc0, wg::desc128(a_rows + ks * 32, 16, wg::kSwizzleAtom), db, !first || ks > 0);
    wg::mma_m64n128k16(acc1, wg::desc128(a_rows + 64 * wg::kSwizzleRow + ks * 32, 16, wg::kSwizzleAtom), db, !first || ks > 0);
  }
  wg::commit();
}

// Stores a 64 x 128 fragment block (rows row0.., columns n0..) into C, converted to OutT; rows past m and columns
// past n are left out (n is a multiple of 8, so a column pair is in or out as a whole).
template <typename OutT>
__device__ __forceinline__ void ring_store(const float (&acc)[kWgAccum], const GemmParams& p, int row0, int n0, int warp, int lane) {
  const int col = n0 + 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + (warp % 4) * 16 + (lane >> 2) + 8 * h;
    if (row >= p.m) continue;
    OutT* c = static_cast<OutT*>(p.c) + static_cast<size_t>(row) * p.n + col;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (col + 8 * j >= p.n) continue;
      const float x = acc[4 * j + 2 * h], y = acc[4 * j + 2 * h + 1];
      if constexpr (std::is_same_v<OutT, float>) {
        *reinterpret_cast<float2*>(c + 8 * j) = make_float2(x, y);
      } else {
        *reinterpret_cast<__half2*>(c + 8 * j) = __floats2half2_rn(x, y);
      }
    }
  }
}

// grid: at most as many CTAs as are resident at once (gemm_ring_ctas), kRingThreads threads, kRingSmem bytes, in
// clusters of (CL, 1, 1). Warps 0-7: two consumer warpgroups, rows [128 w, 128 w + 128) of each tile; warp 8: the
// TMA producer of the stages (A box 256 x 64 by p.a_map, the B unit by one bulk copy); warps 9-11: stagers.
// Cluster c takes tile pairs c, c + G / CL, ... (tiles CL q + rank: with an even band, the two CTAs of a pair have
// one row tile and adjacent strips), so with CL = 2 each producer fetches half of the pair's A tile (box 128 x 64)
// into the stage of both CTAs by TMA multicast, and a stage is refilled once the consumers of both have released it.
template <typename OutT, int CL>
__global__ void __launch_bounds__(kRingThreads, 1) gemm_ring_kernel(const __grid_constant__ GemmParams p) {
  static_assert(CL == 1 || CL == 2, "ring: single CTAs or pairs");
  extern __shared__ unsigned char smem_sw[];
  unsigned char* stages = align_atom(smem_sw);
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kRingStages * kRingStageBytes);
  uint64_t* empty = full + kRingStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wgi = wg::warpgroup_index();
  const int rank = static_cast<int>(blockIdx.x) % CL;  // = %cluster_ctarank: clusters are (CL, 1, 1)
  const int first_pair = static_cast<int>(blockIdx.x) / CL, pair_step = static_cast<int>(gridDim.x) / CL;
  const RingPlan plan(p);
  const int pairs = plan.tiles() / CL;  // the launcher's check: CL divides every band's strips
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRingStages; ++s) {
      tc::mbar_init(full + s, 1);                     // the producer's arrival with the stage's bytes
      tc::mbar_init(empty + s, CL * kConsumerWarps);  // one per consumer warp of each CTA of the cluster
    }
    wg::fence_mbarrier_init();
  }
  if constexpr (CL > 1) {
    wg::cluster_sync();  // the peer's barriers are initialised before this CTA signals them
  } else {
    __syncthreads();
  }
  if (wgi == 2) {
    wg::set_max_regs_dec<kProducerRegs>();
    if (warp > kConsumerWarps) {
      ring_stager(p, plan, static_cast<int>(blockIdx.x) * kRingStagerWarps + warp - kConsumerWarps - 1,
                  static_cast<int>(gridDim.x) * kRingStagerWarps, lane);
    } else if (lane == 0) {
      int i = 0;  // stage sequence number over the CTA's tiles (the same in both CTAs of a pair)
      for (int q = first_pair; q < pairs; q += pair_step) {
        int b, s, mt;
        plan.tile(q * CL + rank, b, s, mt);
        for (int t = 0; t < plan.ktiles; ++t, ++i) {
          const int st = i % kRingStages;
          if (i >= kRingStages) tc::mbar_wait(empty + st, ((i / kRingStages) - 1) & 1);
          wait_at_least(p.ring_sync + plan.unit(b, s, t), kRingSlices);
          fence_proxy_async_global();  // the acquired stores, then this thread's bulk read of them
          unsigned char* stage = stages + st * kRingStageBytes;
          wg::mbar_arrive_expect_tx(full + st, kRingStageBytes);  // the whole A tile, both halves, and the unit
          if constexpr (CL > 1) {
            constexpr uint32_t half = kRingATileBytes / 2;
            wg::tma_load_2d_multicast(stage + rank * half, &p.a_map, t * kBK, mt * kRingBM + rank * (kRingBM / 2), full + st, 0x3);
          } else {
            wg::tma_load_2d(stage, &p.a_map, t * kBK, mt * kRingBM, full + st);
          }
          bulk_load(stage + kRingATileBytes, p.stage + plan.offset(b, s, t), kRingUnitBytes, full + st);
        }
      }
    }
  } else {
    wg::set_max_regs_inc<kConsumerRegs>();
    unsigned* done = p.ring_sync + plan.unit_slots();
    float acc0[kWgAccum], acc1[kWgAccum];
    int i = 0;
    for (int q = first_pair; q < pairs; q += pair_step) {
      int b, s, mt;
      plan.tile(q * CL + rank, b, s, mt);
      int held = 0;  // the stage of the previous k tile, whose wgmma may still be reading it
      for (int t = 0; t < plan.ktiles; ++t, ++i) {
        const int st = i % kRingStages;
        tc::mbar_wait(full + st, (i / kRingStages) & 1);
        if (t + 1 == plan.ktiles && threadIdx.x % 128 == 0) {
          // every unit of this tile is in shared memory: the band's ring slot no longer needs this warpgroup
          fence_proxy_async_global();
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(done + b) : "memory");
        }
        const unsigned char* stage = stages + st * kRingStageBytes;
        ring_mma_step(acc0, acc1, stage + wgi * 128 * wg::kSwizzleRow, stage + kRingATileBytes, t == 0);
        wg::wait<1>();
        if (t > 0) release_stage<CL>(empty + held, lane, rank);
        held = st;
      }
      wg::wait<0>();
      wg::touch(acc0);
      wg::touch(acc1);
      release_stage<CL>(empty + held, lane, rank);
      const int row0 = mt * kRingBM + wgi * 128;
      ring_store<OutT>(acc0, p, row0, s * kBN, warp, lane);
      ring_store<OutT>(acc1, p, row0 + 64, s * kBN, warp, lane);
    }
  }
  if constexpr (CL > 1) wg::cluster_sync();  // no CTA leaves while its peer may still write its stages or barriers
}

}  // namespace directkv::gemm
