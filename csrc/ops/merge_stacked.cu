// Launcher of merge_stacked: checks, output dtype dispatch, launch on the caller's stream.
#include <string>

#include "directkv/merge_stacked.cuh"

namespace directkv {

void merge_stacked_run(uintptr_t o, uintptr_t lse, uintptr_t out, int64_t rows, int64_t out_row_stride,
                       int num_parts, int head_dim, int dtype, uintptr_t stream) {
  require(num_parts >= 1, "merge_stacked: num_parts " + std::to_string(num_parts) + " must be >= 1");
  require(rows >= 0, "merge_stacked: rows " + std::to_string(rows) + " must be >= 0");
  require(head_dim >= 4 && head_dim % 4 == 0, "merge_stacked: head_dim " + std::to_string(head_dim) +
                                                   " must be a positive multiple of 4");
  require(out_row_stride >= head_dim, "merge_stacked: out_row_stride " + std::to_string(out_row_stride) +
                                          " must be >= head_dim " + std::to_string(head_dim) + " (rows would overlap)");
  require(o % 16 == 0, "merge_stacked: o at address " + std::to_string(o) + " is not 16-byte aligned");
  if (rows == 0) return;
  const MergeStackedParams p{reinterpret_cast<const float*>(o), reinterpret_cast<const float*>(lse),
                             reinterpret_cast<void*>(out), rows, out_row_stride, num_parts, head_dim};
  launch_merge_stacked(p, dtype, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace directkv
