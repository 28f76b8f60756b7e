// Hopper warpgroup MMA (wgmma, sm_90a) for the GEMM case study: shared-memory matrix descriptors over tiles in
// the 128-byte swizzled layout, the async fences, one m64n128k16 fp16 shape with fp32 accumulators, and TMA
// tile loads that write that layout.
// A warpgroup is four consecutive warps whose first warp index is a multiple of 4; all 128 threads issue each
// wgmma together. Accumulator layout (PTX ISA "wgmma 64xNx16 D fragments"): warp q of the warpgroup holds rows
// 16 q + lane / 4 and 16 q + lane / 4 + 8, and d[4 j + 2 h + e] is row 16 q + lane / 4 + 8 h, column
// 8 j + 2 (lane % 4) + e, for the 16 eight-column blocks j. No torch headers (see build.py).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing links the driver library)

#include <cstdint>

#include "directkv/prefill_common.cuh"

namespace directkv::wg {

// 128-byte swizzle: a tile is stored as rows of 128 bytes, and 16-byte chunk c of row r sits at chunk c ^ (r % 8), so
// the eight rows of a 1024-byte atom spread any 16-byte column over all banks. The swizzle is applied by the
// hardware to address bits, so every tile starts on a 1024-byte boundary.
constexpr int kSwizzleRow = 128, kSwizzleAtom = 1024;

// Byte offset of 16-byte chunk `c` (c < 8) of row `r` in a 128-byte swizzled tile.
__device__ __forceinline__ uint32_t swizzle128(int r, int c) {
  return static_cast<uint32_t>(r * kSwizzleRow + ((c ^ (r & 7)) << 4));
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") for a 128-byte swizzled tile at `p`:
// start address, leading- and stride-dimension byte offsets (16-byte units), swizzle mode 1 (128 B).
// K-major operand (rows of 64 k values): lbo unused, sbo = the 1024-byte step between 8-row groups. MN-major
// operand (rows of 64 m or n values, one row per k): lbo = the step between 64-wide column blocks, sbo = the
// step between groups of 8 k rows.
__device__ __forceinline__ uint64_t desc128(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint64_t addr = tc::smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// Makes this thread's generic-proxy writes to shared memory (st.shared, landed cp.async) visible to the async
// proxy through which wgmma reads its operands; each writer runs it before the barrier that hands the tile over
// (the pipelined consumers also run it after each hand-off, so the ordering does not rest on one side alone).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders the calling thread's mbarrier.init before any later TMA completion on those barriers (the copy unit is
// another proxy); run by the initialising thread before the barrier that publishes them.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// Moves this warpgroup's register budget to N per thread (a multiple of 8 in 24..256): warp-specialised kernels give
// the producer few and the consumers, who hold the accumulators, many. Every warp of the warpgroup runs it.
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The warpgroup of the calling thread, computed so the compiler sees it is the same across the warp (a branch on it
// is then warp-uniform, which wgmma inside the branch needs to run unserialised).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0); }

// Orders this warpgroup's earlier register accesses before the wgmma issued next.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N committed wgmma groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Tells the compiler the accumulators may have changed here (the wgmma wrote them asynchronously), so no read of
// them is moved above the wait that precedes this.
__device__ __forceinline__ void touch(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 128, fp32) = A (64 x 16, K-major, descriptor da) x B (16 x 128, MN-major: n contiguous, descriptor db)
// + (accumulate ? d : 0), fp16 operands. Asynchronous: commit(), then wait<>() before d is read.
__device__ __forceinline__ void mma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
      :
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(static_cast<int>(accumulate)));
}

// ---- TMA: 2-D tiles of a tensor in global memory copied into shared memory by the copy unit ----

// Arrives on `bar` (counted as one arrival) and adds `bytes` to the bytes the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tc::smem_u32(bar)), "r"(bytes) : "memory");
}

// The box of `map` at element coordinates (x innermost, y) into shared memory at dst (laid out as the map's
// swizzle says); completes its bytes on `bar`. Elements outside the tensor arrive as zeros. `map` must live in
// parameter, constant or global memory (a __grid_constant__ kernel parameter).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          tc::smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(tc::smem_u32(bar))
      : "memory");
}

// The same box, written into the shared memory of every CTA of the cluster in `mask` (bit r: rank r) at dst's offset,
// each of them completing the bytes on its own mbarrier at bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(
          tc::smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(tc::smem_u32(bar)), "h"(mask)
      : "memory");
}

// ---- thread-block clusters ----

// Every thread of every CTA of the cluster arrives, then waits for all (release / acquire at cluster scope): the
// peers' mbarriers are initialised before anyone signals them, and no CTA leaves while a peer may still write to it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// One arrival on the mbarrier at bar's offset in the shared memory of cluster CTA `rank`. Release at CTA scope, as a
// local arrival: it hands over shared-memory stages read by this thread's finished wgmma. At cluster scope the
// arrival also waited for the thread's earlier global reductions to complete (pipelined 2.3x slower, 2026-12-04).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n mbarrier.arrive.release.cta.shared::cluster.b64 _, [remote];\n}\n" ::"r"(
          tc::smem_u32(bar)),
      "r"(rank)
      : "memory");
}

}  // namespace directkv::wg
