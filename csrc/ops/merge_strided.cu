// Launcher of merge_strided: checks, the parts' params, output dtype dispatch, launch on the caller's stream.
#include <string>
#include <vector>

#include "directkv/merge_strided.cuh"

namespace directkv {

// o_strides / lse_strides: 3 per part, elements; dtypes: one code per part.
void merge_strided_run(const std::vector<uintptr_t>& o, const std::vector<uintptr_t>& lse,
                       const std::vector<int64_t>& o_strides, const std::vector<int64_t>& lse_strides,
                       const std::vector<int>& dtypes, uintptr_t out, int64_t a, int64_t b, int64_t c, int head_dim,
                       int dtype, uintptr_t stream) {
  const size_t n = o.size();
  require(n >= 1 && n <= static_cast<size_t>(kMergeMaxParts),
          "merge_strided: " + std::to_string(n) + " parts; 1 to " + std::to_string(kMergeMaxParts) + " allowed");
  require(lse.size() == n && dtypes.size() == n && o_strides.size() == 3 * n && lse_strides.size() == 3 * n,
          "merge_strided: per-part lists of different lengths (o " + std::to_string(n) + ", lse " +
              std::to_string(lse.size()) + ", dtypes " + std::to_string(dtypes.size()) + ", o_strides " +
              std::to_string(o_strides.size()) + " and lse_strides " + std::to_string(lse_strides.size()) +
              ", 3 per part)");
  require(a >= 0 && b >= 0 && c >= 0, "merge_strided: row dims must be >= 0");
  require(head_dim >= 4 && head_dim % 4 == 0,
          "merge_strided: head_dim " + std::to_string(head_dim) + " must be a positive multiple of 4");
  MergeStridedParams p{};
  for (size_t k = 0; k < n; ++k) {
    require(dtypes[k] == kFloat16 || dtypes[k] == kBFloat16 || dtypes[k] == kFloat32,
            "merge_strided: part " + std::to_string(k) + " has dtype code " + std::to_string(dtypes[k]) +
                "; fp16 (0), bf16 (1) or fp32 (2) allowed");
    const int64_t vec_bytes = 4 * (dtypes[k] == kFloat32 ? 4 : 2);
    bool aligned = o[k] % vec_bytes == 0;
    for (int j = 0; j < 3; ++j) aligned = aligned && o_strides[3 * k + j] % 4 == 0;
    require(aligned, "merge_strided: part " + std::to_string(k) +
                         "'s O must start on a 4-element boundary with strides that are multiples of 4");
    p.parts[k] = MergePart{reinterpret_cast<const void*>(o[k]), reinterpret_cast<const float*>(lse[k]),
                           {o_strides[3 * k], o_strides[3 * k + 1], o_strides[3 * k + 2]},
                           {lse_strides[3 * k], lse_strides[3 * k + 1], lse_strides[3 * k + 2]}, dtypes[k]};
  }
  if (a * b * c == 0) return;
  p.out = reinterpret_cast<void*>(out);
  p.dims[0] = a, p.dims[1] = b, p.dims[2] = c;
  p.num_parts = static_cast<int>(n);
  p.head_dim = head_dim;
  launch_merge_strided(p, dtype, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace directkv
