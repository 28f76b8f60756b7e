// Launcher of the CPU decode attention: integer checks, the work-item plan (pieces of each sequence's pages),
// the merge scratch. Tensor checks (dtypes, shapes, page ids) are the Python wrapper's.
#include "directkv/cpu_decode_attention.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace directkv {

namespace {
void require(bool cond, const std::string& msg) {
  if (!cond) throw std::invalid_argument("cpu_decode_attention: " + msg);
}
}  // namespace

void cpu_decode_attention_run(uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, uintptr_t block_table,
                              uintptr_t seq_lens, uintptr_t out, int batch, int num_heads, int num_kv_heads,
                              int head_dim, int page_size, int table_width, int piece_pages, int num_threads,
                              float scale, int dtype) {
  require(q && k_pool && v_pool && block_table && seq_lens && out, "null pointer");
  require(batch >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
          "need batch >= 1 and num_heads a multiple of num_kv_heads");
  require(head_dim >= 1 && page_size >= 1 && table_width >= 1 && piece_pages >= 1 && num_threads >= 1,
          "head_dim, page_size, table_width, piece_pages and num_threads must be >= 1");
  const auto* lens = reinterpret_cast<const int32_t*>(seq_lens);
  std::vector<int32_t> start(size_t(batch) + 1, 0);
  for (int b = 0; b < batch; ++b) {
    require(lens[b] >= 1 && int64_t(lens[b]) <= int64_t(table_width) * page_size,
            "seq_lens[" + std::to_string(b) + "] = " + std::to_string(lens[b]) + " must be in 1.." +
                std::to_string(int64_t(table_width) * page_size));
    const int pages = (lens[b] + page_size - 1) / page_size;
    start[b + 1] = start[b] + (pages + piece_pages - 1) / piece_pages;
  }
  std::vector<float> part(size_t(start[batch]) * num_heads * (head_dim + 2));
  require(dtype == CPU_FP16 || dtype == CPU_BF16 || dtype == CPU_FP32, "dtype code " + std::to_string(dtype) +
                                                                          " is not 0 (fp16), 1 (bf16) or 2 (fp32)");
  CpuDecodeParams p{reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k_pool),
                    reinterpret_cast<const void*>(v_pool), reinterpret_cast<const int32_t*>(block_table), lens,
                    start.data(), reinterpret_cast<float*>(out), part.data(), batch, num_heads, num_kv_heads,
                    head_dim, page_size, table_width, piece_pages, num_threads, scale, dtype};
  cpu_decode_attention(p);
}

std::string cpu_decode_attention_item(int dtype, int num_heads, int num_kv_heads, int head_dim) {
  require(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "need num_heads a multiple of num_kv_heads");
  return cpu_decode_attention_path(dtype, num_heads / num_kv_heads, head_dim);
}

}  // namespace directkv
