// GEMM case study: the fp32 partial C of `tiled` / `pipelined` (one per k-split, or the one atomic sum) converted into
// C. No torch headers (see build.py).
#pragma once

#include <type_traits>

#include "directkv/gemm_case_study.cuh"

namespace directkv::gemm {

// C[row, col] = sum over the k-splits of the partial C (the one sum when atomic), converted to OutT. One thread per 4
// consecutive columns of a padded row (ldp is a multiple of 128, so a row's 4 floats are one 16-byte load), stored in
// one 8- or 16-byte store when C's rows allow it. (One thread per element moved 1.5 TB/s: 0.43 ms at 10240^2,
// 2026-12-04.)
template <typename OutT>
__global__ void gemm_reduce_kernel(const GemmParams p) {
  const int quads = p.ldp / 4;
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<size_t>(p.m) * quads) return;
  const int row = static_cast<int>(idx / quads), col = static_cast<int>(idx % quads) * 4;
  if (col >= p.n) return;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < (p.atomic ? 1 : p.k_splits); ++s) {
    const float4 v = __ldcs(reinterpret_cast<const float4*>(p.part + (static_cast<size_t>(s) * p.m + row) * p.ldp + col));
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  OutT* c = static_cast<OutT*>(p.c) + static_cast<size_t>(row) * p.n + col;
  const float v[4] = {sum.x, sum.y, sum.z, sum.w};
  if (col + 4 <= p.n && p.n % 4 == 0 && reinterpret_cast<uintptr_t>(p.c) % (4 * sizeof(OutT)) == 0) {
    if constexpr (std::is_same_v<OutT, float>) {
      *reinterpret_cast<float4*>(c) = sum;
    } else {
      const __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(c) = packed;
    }
  } else {
    for (int e = 0; e < 4 && col + e < p.n; ++e) c[e] = from_float(v[e], OutT());
  }
}

}  // namespace directkv::gemm
