// Merge of attention passes that each live in their own tensor, in any layout: out[r] = sum_p softmax_p(lse_p[r]) *
// o_p[r] over rows r = (a, b, c). The prefill stream variant's passes come out of torch's flash kernel as permuted
// views ([Hkv, tokens * G, D] for a ring chunk, [Hq, tokens, D] for the new tokens) in the query dtype, or as fp32
// from the tiled kernel; merging them with torch ops cost a stack, a softmax and an fp32 read-modify-write of the
// whole output per pass. Here each pass's O is read once, where it lies, in one launch.
#pragma once

#include "directkv/merge_stacked.cuh"

namespace directkv {

constexpr int kMergeMaxParts = 32;  // passes per launch (the prefill stream's: new tokens', ring runs', HBM pages')

struct MergePart {
  const void* o;           // O of the pass, dtype `dtype`: (a, b, c, d) at a*o_stride[0] + b*o_stride[1] + c*o_stride[2] + d
  const float* lse;        // natural-log LSE, fp32: row (a, b, c) at the same sum over lse_stride
  int64_t o_stride[3];     // elements; multiples of 4, like o's address (in elements): each thread reads 4 dims
  int64_t lse_stride[3];   // elements
  int dtype;               // kFloat16, kBFloat16 or kFloat32
};

struct MergeStridedParams {
  MergePart parts[kMergeMaxParts];
  void* out;        // [A, B, C, head_dim] contiguous, the output dtype
  int64_t dims[3];  // A, B, C
  int num_parts;    // 1 .. kMergeMaxParts
  int head_dim;     // a multiple of 4
};
static_assert(sizeof(MergeStridedParams) <= 4096, "kernel parameters are limited to 4 KB");

__device__ __forceinline__ void load4(const MergePart& part, int64_t off, float (&x)[4]) {
  if (part.dtype == kFloat32) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(part.o) + off);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if (part.dtype == kBFloat16) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(part.o) + off);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    x[0] = lo.x, x[1] = lo.y, x[2] = hi.x, x[3] = hi.y;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __half*>(part.o) + off);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    x[0] = lo.x, x[1] = lo.y, x[2] = hi.x, x[3] = hi.y;
  }
}

// One thread per 4 dims of a row, rows in the output's order (merge_stacked's merge4: its rules for -inf and
// NaN LSEs).
template <typename T>
__global__ void merge_strided_kernel(const MergeStridedParams p) {
  const int vecs = p.head_dim / 4;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rows = p.dims[0] * p.dims[1] * p.dims[2];
  if (i >= rows * vecs) return;
  const int64_t row = i / vecs;
  const int v = static_cast<int>(i % vecs);
  const int64_t c = row % p.dims[2], b = (row / p.dims[2]) % p.dims[1], a = row / (p.dims[2] * p.dims[1]);
  float acc[4];
  merge4(
      p.num_parts,
      [&](int k) {
        const MergePart& part = p.parts[k];
        return part.lse[a * part.lse_stride[0] + b * part.lse_stride[1] + c * part.lse_stride[2]];
      },
      [&](int k, float(&x)[4]) {
        const MergePart& part = p.parts[k];
        load4(part, a * part.o_stride[0] + b * part.o_stride[1] + c * part.o_stride[2] + v * 4, x);
      },
      acc);
  T* dst = static_cast<T*>(p.out) + row * p.head_dim + v * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) dst[j] = from_float(acc[j], T());
}

// Launch with the output dtype `dtype` (fp16 0, bf16 1, fp32 2) on `stream`; at least one row.
inline void launch_merge_strided(const MergeStridedParams& p, int dtype, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t threads = p.dims[0] * p.dims[1] * p.dims[2] * (p.head_dim / 4);
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads));
  dispatch_out_dtype("merge_strided", dtype, [&](auto t) {
    merge_strided_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "merge_strided: kernel launch");
}

}  // namespace directkv
