// Bandwidth probe: the plainest streaming read, a grid-stride loop of 16-byte loads. Pointed at a zero-copy
// view of pinned memory it measures what SMs can pull across the link, the ceiling every zero-copy kernel
// is judged against (DESIGN.md §2).
#pragma once

#include "directkv/common.cuh"

namespace directkv {

struct StreamReadParams {
  const float4* src;  // [num_vec] 16-byte vectors (host memory through UVA, or HBM)
  int64_t num_vec;
  float* sink;        // [gridDim.x * blockDim.x]: one partial sum per thread so the loads cannot be elided
};

__global__ void stream_read_kernel(const StreamReadParams p) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  float acc = 0.f;
  for (int64_t i = tid; i < p.num_vec; i += stride) {
    const float4 v = p.src[i];
    acc += (v.x + v.y) + (v.z + v.w);
  }
  p.sink[tid] = acc;
}

}  // namespace directkv
