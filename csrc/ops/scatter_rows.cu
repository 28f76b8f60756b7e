// Launcher of scatter_rows: checks and launch on the caller's stream.
#include <string>
#include <vector>

#include "directkv/scatter_rows.cuh"

namespace directkv {

void scatter_rows_run(const std::vector<uintptr_t>& dst, const std::vector<uintptr_t>& src, uintptr_t dst_rows,
                      uintptr_t src_rows, int64_t n, int64_t dst_rows_total, int64_t src_rows_total,
                      int64_t row_bytes, uintptr_t stream) {
  require(!dst.empty() && dst.size() <= 2 && dst.size() == src.size(),
          "scatter_rows: one or two (dst, src) pairs; got " + std::to_string(dst.size()) + " dst and " +
              std::to_string(src.size()) + " src");
  require(row_bytes >= 16 && row_bytes % 16 == 0,
          "scatter_rows: row_bytes " + std::to_string(row_bytes) + " must be a positive multiple of 16");
  require(n >= 0 && dst_rows_total >= 0 && src_rows_total >= 0,
          "scatter_rows: row counts must be >= 0; got n " + std::to_string(n) + ", dst rows " +
              std::to_string(dst_rows_total) + ", src rows " + std::to_string(src_rows_total));
  for (size_t i = 0; i < dst.size(); ++i) {
    require(dst[i] % 16 == 0 && src[i] % 16 == 0, "scatter_rows: pair " + std::to_string(i) + ": dst " +
                                                      std::to_string(dst[i]) + " and src " + std::to_string(src[i]) +
                                                      " must be 16-byte aligned");
  }
  if (n == 0) return;
  ScatterRowsParams p{};
  for (size_t i = 0; i < dst.size(); ++i) {
    p.dst[i] = reinterpret_cast<void*>(dst[i]);
    p.src[i] = reinterpret_cast<const void*>(src[i]);
  }
  p.dst_rows = reinterpret_cast<const int64_t*>(dst_rows);
  p.src_rows = reinterpret_cast<const int64_t*>(src_rows);
  p.n = n;
  p.dst_rows_total = dst_rows_total;
  p.src_rows_total = src_rows_total;
  p.row_vecs = static_cast<int>(row_bytes / 16);
  launch_scatter_rows(p, static_cast<int>(dst.size()), reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace directkv
