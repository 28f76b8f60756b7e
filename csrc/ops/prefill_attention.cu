// Launcher of prefill attention: argument checks, dtype / head_dim / host-load dispatch, launch on the
// caller's stream. The split plan (kv_chunk, num_splits, threads) is host-side arithmetic done by the Python
// wrapper.
#include <string>
#include <type_traits>
#include <utility>

#include "directkv/dispatch.h"
#include "directkv/prefill_attention.cuh"
#include "directkv/prefill_checks.h"

namespace directkv {
namespace {

using prefill::PrefillParams;

template <typename T, int D, bool L1>
void launch_variant(const PrefillParams& p, int variant, int threads, cudaStream_t stream) {
  constexpr size_t kRowBytes = prefill::kStride<D> * sizeof(T);
  if (variant == 0) {
    const size_t smem = 2 * 2 * prefill::kTileKV * kRowBytes;
    const int64_t rows = static_cast<int64_t>(p.q_len) * (p.num_heads / p.num_kv_heads);
    const int64_t ctas = (rows + prefill::kNaiveWarps * prefill::kWarpRows - 1) / (prefill::kNaiveWarps * prefill::kWarpRows);
    require(ctas < (int64_t{1} << 31), "prefill_attention: grid too large");
    allow_max_smem("prefill_attention", prefill::prefill_naive_kernel<T, D, L1>, smem);
    prefill::prefill_naive_kernel<T, D, L1><<<dim3(static_cast<unsigned>(ctas), p.num_kv_heads), prefill::kNaiveWarps * 32, smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "prefill_attention: naive kernel launch");
  } else if (variant == 1) {
    const size_t smem = static_cast<size_t>(p.num_buffers) * 2 * p.kv_chunk * kRowBytes;
    allow_max_smem("prefill_attention", prefill::prefill_tiled_kernel<T, D, L1>, smem);
    prefill::prefill_tiled_kernel<T, D, L1><<<p.num_kv_heads * p.num_splits, threads, smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "prefill_attention: tiled kernel launch");
    constexpr int kMergeWarps = 8;
    const int64_t rows = static_cast<int64_t>(p.q_len) * p.num_heads;
    prefill::prefill_merge_kernel<T, D><<<static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps), kMergeWarps * 32, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "prefill_attention: merge kernel launch");
  } else {
    throw std::runtime_error("prefill_attention: variant code " + std::to_string(variant) + " is not naive (0) or tiled (1)");
  }
}

void launch(const PrefillParams& p, int variant, int dtype, int head_dim, int threads, int host_load,
            cudaStream_t stream) {
  prefill::check_params(p, variant, threads, "prefill_attention");
  dispatch_dtype("prefill_attention", dtype, [&](auto t) {
    dispatch_head_dim("prefill_attention", head_dim, [&](auto hd) {
      dispatch_host_load("prefill_attention", host_load, [&](auto l1) {
        launch_variant<decltype(t), decltype(hd)::value, decltype(l1)::value>(p, variant, threads, stream);
      });
    });
  });
}

}  // namespace

// {number of SMs, opt-in shared memory per block}: what the Python split plan sizes against.
std::pair<int, int> prefill_device_limits() {
  return {device_attribute(cudaDevAttrMultiProcessorCount), device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)};
}

void prefill_attention_run(uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t host_k, uintptr_t host_v,
                           uintptr_t hbm_k, uintptr_t hbm_v, uintptr_t block_table, uintptr_t out, uintptr_t out_f32,
                           uintptr_t lse_out, uintptr_t part_o, uintptr_t part_ml, int q_len, int past_len,
                           int num_heads, int num_kv_heads, int head_dim, int page_size, bool causal, bool include_new,
                           int variant, int kv_chunk, int num_splits, int threads, int num_buffers, bool half_state,
                           float sm_scale, int dtype, int host_load, uintptr_t stream) {
  PrefillParams p{};
  p.q = reinterpret_cast<const void*>(q);
  p.k_new = reinterpret_cast<const void*>(k_new);
  p.v_new = reinterpret_cast<const void*>(v_new);
  p.host_k = reinterpret_cast<const void*>(host_k);
  p.host_v = reinterpret_cast<const void*>(host_v);
  p.hbm_k = reinterpret_cast<const void*>(hbm_k);
  p.hbm_v = reinterpret_cast<const void*>(hbm_v);
  p.block_table = reinterpret_cast<const int*>(block_table);
  p.out = reinterpret_cast<void*>(out);
  p.out_f32 = reinterpret_cast<float*>(out_f32);
  p.lse_out = reinterpret_cast<float*>(lse_out);
  p.part_o = reinterpret_cast<float*>(part_o);
  p.part_ml = reinterpret_cast<float*>(part_ml);
  p.q_len = q_len;
  p.past_len = past_len;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.page_size = page_size;
  p.causal = causal ? 1 : 0;
  p.include_new = include_new ? 1 : 0;
  p.kv_chunk = kv_chunk;
  p.num_chunks = kv_chunk > 0 ? (prefill::num_keys(p) + kv_chunk - 1) / kv_chunk : 0;
  p.num_splits = num_splits;
  p.num_buffers = num_buffers;
  p.half_state = half_state ? 1 : 0;
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  launch(p, variant, dtype, head_dim, threads, host_load, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace directkv
