// Row scatter: dst[dst_rows[i]] = src[src_rows[i]] (src row i without src_rows) for one or two (dst, src) pairs
// of equal row size, in one launch. A serving step stores each layer's new K and V into the KV pools (or a
// staging pool, or the stream ring) this way: torch's index_put costs a launch and ~15-30 us of host dispatch
// per tensor, per layer; here K and V go together. A dst may be a zero-copy view of pinned host memory (its
// stores then cross the link).
#pragma once

#include "directkv/common.cuh"

namespace directkv {

struct ScatterRowsParams {
  void* dst[2];             // [dst_rows_total, row_bytes] each; dst[1] unused when pairs == 1
  const void* src[2];       // [src rows, row_bytes] each
  const int64_t* dst_rows;  // [n] row of dst each row goes to
  const int64_t* src_rows;  // [n] row of src to take, or null: row i
  int64_t n;
  int64_t dst_rows_total;   // rows dst holds: an index outside [0, dst_rows_total) traps, as torch's index check does
  int64_t src_rows_total;
  int row_vecs;             // 16-byte vectors per row
};

// grid.y = pair; one thread per 16-byte vector of a row.
__global__ void scatter_rows_kernel(const ScatterRowsParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n * p.row_vecs) return;
  const int64_t k = i / p.row_vecs;
  const int v = static_cast<int>(i % p.row_vecs);
  const int64_t d = p.dst_rows[k];
  const int64_t s = p.src_rows ? p.src_rows[k] : k;
  if (d < 0 || d >= p.dst_rows_total || s < 0 || s >= p.src_rows_total) __trap();
  const uint4* src = static_cast<const uint4*>(p.src[blockIdx.y]);
  uint4* dst = static_cast<uint4*>(p.dst[blockIdx.y]);
  dst[d * p.row_vecs + v] = src[s * p.row_vecs + v];
}

// Launch for `pairs` (1 or 2) pairs on `stream`; p.n > 0. Shared by the scatter_rows op and the stream decode
// loop (the ring's last-token rows).
inline void launch_scatter_rows(const ScatterRowsParams& p, int pairs, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const int64_t threads = p.n * p.row_vecs;
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads), static_cast<unsigned>(pairs));
  scatter_rows_kernel<<<grid, kThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "scatter_rows: kernel launch");
}

}  // namespace directkv
