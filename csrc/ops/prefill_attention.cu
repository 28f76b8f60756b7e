// Launcher of prefill attention: argument checks, dtype / head_dim / host-load dispatch, launch on the
// caller's stream. The split plan (kv_chunk, num_splits, threads) is host-side arithmetic done by the Python
// wrapper.
#include <string>
#include <type_traits>
#include <utility>

#include "directkv/dispatch.h"
#include "directkv/prefill_attention.cuh"

namespace directkv {
namespace {

using prefill::PrefillParams;

int max_smem_optin() { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin); }

// Lets `kernel` use up to the device's opt-in shared memory (above 48 KB a kernel must ask).
template <typename K>
void allow_smem(K kernel, size_t smem) {
  const int limit = max_smem_optin();
  require(smem <= static_cast<size_t>(limit), "prefill_attention: needs " + std::to_string(smem) +
                                                  " B of shared memory; the device allows " + std::to_string(limit));
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit),
             "prefill_attention: cudaFuncSetAttribute");
}

void check_params(const PrefillParams& p, int variant, int threads) {
  require(p.q_len >= 1 && p.past_len >= 0, "prefill_attention: need q_len >= 1 and past_len >= 0");
  require(p.num_heads >= 1 && p.num_kv_heads >= 1 && p.num_heads % p.num_kv_heads == 0,
          "prefill_attention: num_heads " + std::to_string(p.num_heads) + " is not a multiple of num_kv_heads " +
              std::to_string(p.num_kv_heads));
  require(p.num_kv_heads <= 65535, "prefill_attention: num_kv_heads must be <= 65535");
  require(p.page_size >= 1, "prefill_attention: page_size must be >= 1");
  require(p.past_len == 0 || p.block_table, "prefill_attention: no block table for a non-empty past");
  for (const void* ptr : {p.q, p.k_new, p.v_new, p.host_k, p.host_v, p.hbm_k, p.hbm_v, static_cast<const void*>(p.out),
                          static_cast<const void*>(p.out_f32)}) {
    require(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "prefill_attention: tensors and KV pools must be 16-byte aligned");
  }
  require(reinterpret_cast<uintptr_t>(p.lse_out) % 4 == 0, "prefill_attention: lse_out must be 4-byte aligned");
  require(!p.out_f32 == !p.lse_out, "prefill_attention: out_f32 and lse_out come together");
  require(p.q && p.k_new && p.v_new && (p.out || p.out_f32), "prefill_attention: null q, k_new, v_new or out");
  // Zero keys would leave the tiled kernel no chunk to give a split: the caller skips such a pass.
  require(prefill::num_keys(p) >= 1, "prefill_attention: no keys (past_len 0 and include_new 0)");
  if (variant == 0) {
    require(p.half_state == 0, "prefill_attention: half_state is an option of the tiled variant (1); got naive (0)");
    // The stream variant runs its passes on the tiled kernel only; naive keeps the one-call form.
    require(p.include_new == 1 && !p.out_f32, "prefill_attention: include_new 0 and out_f32 / lse_out need the tiled "
                                              "variant (1); got naive (0)");
  }
  if (variant == 1) {
    require(p.kv_chunk >= prefill::kTileKV && p.kv_chunk % prefill::kTileKV == 0,
            "prefill_attention: kv_chunk " + std::to_string(p.kv_chunk) + " is not a positive multiple of 64");
    require(p.num_chunks == (prefill::num_keys(p) + p.kv_chunk - 1) / p.kv_chunk,
            "prefill_attention: num_chunks does not match the key count and kv_chunk");
    require(p.num_splits >= 1 && p.num_splits <= p.num_chunks,
            "prefill_attention: num_splits must be in 1.." + std::to_string(p.num_chunks));
    require(p.part_o && p.part_ml, "prefill_attention: the tiled variant needs the part_o / part_ml workspace");
    require(threads == 128 || threads == 256, "prefill_attention: threads must be 128 or 256");
    require(p.num_buffers == 1 || p.num_buffers == 2, "prefill_attention: num_buffers must be 1 or 2");
    require(p.half_state == 0 || p.half_state == 1, "prefill_attention: half_state must be 0 or 1");
    require(static_cast<int64_t>(p.num_kv_heads) * p.num_splits < (int64_t{1} << 31), "prefill_attention: grid too large");
  }
}

template <typename T, int D, bool L1>
void launch_variant(const PrefillParams& p, int variant, int threads, cudaStream_t stream) {
  constexpr size_t kRowBytes = prefill::kStride<D> * sizeof(T);
  if (variant == 0) {
    const size_t smem = 2 * 2 * prefill::kTileKV * kRowBytes;
    const int64_t rows = static_cast<int64_t>(p.q_len) * (p.num_heads / p.num_kv_heads);
    const int64_t ctas = (rows + prefill::kNaiveWarps * prefill::kWarpRows - 1) / (prefill::kNaiveWarps * prefill::kWarpRows);
    require(ctas < (int64_t{1} << 31), "prefill_attention: grid too large");
    allow_smem(prefill::prefill_naive_kernel<T, D, L1>, smem);
    prefill::prefill_naive_kernel<T, D, L1><<<dim3(static_cast<unsigned>(ctas), p.num_kv_heads), prefill::kNaiveWarps * 32, smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "prefill_attention: naive kernel launch");
  } else if (variant == 1) {
    const size_t smem = static_cast<size_t>(p.num_buffers) * 2 * p.kv_chunk * kRowBytes;
    allow_smem(prefill::prefill_tiled_kernel<T, D, L1>, smem);
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
  check_params(p, variant, threads);
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
  return {device_attribute(cudaDevAttrMultiProcessorCount), max_smem_optin()};
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
