// Merge of attention passes stacked in one buffer: out[r] = sum_p softmax_p(lse[p, r]) * o[p, r]. The stream
// variants attend to a cache in several passes (one per ring chunk, plus one over HBM pages); each pass gives a
// normalised O and its log-sum-exp, and this weighs them. One launch instead of the eight or so elementwise
// kernels (and their host-side dispatch) the same merge costs as torch ops, once per layer in serving.
#pragma once

#include "directkv/dispatch.h"

namespace directkv {

struct MergeStackedParams {
  const float* o;    // [num_parts, rows, head_dim] fp32, contiguous
  const float* lse;  // [num_parts, rows] fp32 natural-log LSE; -inf where a pass saw no key of the row
  void* out;         // rows of head_dim elements in the output dtype, out_row_stride elements apart
  int64_t rows;
  int64_t out_row_stride;
  int num_parts;
  int head_dim;      // a multiple of 4: each thread merges one float4 of a row
};

// 4 dims of one row merged over the passes: acc = sum_k softmax_k(lse(k)) * O_k, where lse(k) gives pass k's LSE
// and load(k, x) its 4 values. A row whose passes all have -inf LSEs gets zeros, a pass of weight 0 is not loaded
// (its O may be unwritten), and a NaN LSE makes the row NaN (fmaxf alone would drop it). Shared with merge_strided.
template <typename Lse, typename Load>
__device__ __forceinline__ void merge4(int num_parts, Lse lse, Load load, float (&acc)[4]) {
  float m = -INFINITY;
  for (int k = 0; k < num_parts; ++k) {
    const float l = lse(k);
    m = isnan(l) ? l : fmaxf(m, l);
    if (isnan(m)) break;
  }
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
  if (m == -INFINITY) return;
  float sum = 0.f;
  for (int k = 0; k < num_parts; ++k) {
    const float l = lse(k);
    if (l == -INFINITY) continue;
    const float w = __expf(l - m);
    sum += w;
    float x[4];
    load(k, x);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] += w * x[j];
  }
  const float inv = 1.f / sum;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] *= inv;
}

// One thread per 4 dims of a row (merge4's rules for -inf and NaN LSEs).
template <typename T>
__global__ void merge_stacked_kernel(const MergeStackedParams p) {
  const int vecs = p.head_dim / 4;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.rows * vecs) return;
  const int64_t row = i / vecs;
  const int v = static_cast<int>(i % vecs);
  float acc[4];
  merge4(
      p.num_parts, [&](int k) { return p.lse[k * p.rows + row]; },
      [&](int k, float(&x)[4]) {
        const float4 f = reinterpret_cast<const float4*>(p.o + (k * p.rows + row) * p.head_dim)[v];
        x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
      },
      acc);
  T* dst = static_cast<T*>(p.out) + row * p.out_row_stride + v * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) dst[j] = from_float(acc[j], T());
}

// Launch with the output dtype `dtype` (fp16 0, bf16 1, fp32 2) on `stream`; p.rows > 0. Shared by the
// merge_stacked op and the stream decode loop.
inline void launch_merge_stacked(const MergeStackedParams& p, int dtype, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t threads = p.rows * (p.head_dim / 4);
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads));
  dispatch_out_dtype("merge_stacked", dtype, [&](auto t) {
    merge_stacked_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "merge_stacked: kernel launch");
}

}  // namespace directkv
