// Launcher of proj_attention: argument checks, dtype / head_dim / host-load dispatch, launch on the caller's
// stream. variant 0 (separate): the tiled prefill kernel reading the new K/V back from their cache pages (the
// projection ran before, in cuBLAS); variant 1 (fused): proj_attention_fused_kernel. Both end with the tiled
// kernel's merge. The split plan is host-side arithmetic done by the Python wrapper.
#include <string>
#include <type_traits>

#include "directkv/dispatch.h"
#include "directkv/prefill_checks.h"
#include "directkv/proj_attention.cuh"

namespace directkv {
namespace {

using proj::ProjParams;

constexpr const char* kOp = "proj_attention";

template <typename T, int D, bool L1>
void launch_variant(const ProjParams& pp, int variant, int threads, cudaStream_t stream) {
  const prefill::PrefillParams& p = pp.attn;
  const size_t chunks = static_cast<size_t>(p.num_buffers) * 2 * p.kv_chunk * prefill::kStride<D> * sizeof(T);
  if (variant == 0) {
    allow_max_smem(kOp, prefill::prefill_tiled_kernel<T, D, L1>, chunks);
    prefill::prefill_tiled_kernel<T, D, L1><<<p.num_kv_heads * p.num_splits, threads, chunks, stream>>>(p);
  } else {
    const size_t smem = chunks + proj::kStageBytes<T, D>;
    allow_max_smem(kOp, proj::proj_attention_fused_kernel<T, D, L1>, smem);
    proj::proj_attention_fused_kernel<T, D, L1><<<p.num_kv_heads * p.num_splits, threads, smem, stream>>>(pp);
  }
  check_cuda(cudaGetLastError(), "proj_attention: kernel launch");
  constexpr int kMergeWarps = 8;
  const int64_t rows = static_cast<int64_t>(p.q_len) * p.num_heads;
  prefill::prefill_merge_kernel<T, D><<<static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps), kMergeWarps * 32, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "proj_attention: merge kernel launch");
}

void launch(const ProjParams& pp, int variant, int dtype, int head_dim, int threads, int host_load, cudaStream_t stream) {
  require(variant == 0 || variant == 1, "proj_attention: variant code " + std::to_string(variant) +
                                            " is not separate (0) or fused (1)");
  prefill::check_params(pp.attn, 1, threads, kOp);
  require(pp.attn.include_new == 1 && pp.attn.new_in_pages == 1 && !pp.attn.out_f32,
          "proj_attention: the new tokens' K/V live in their pages (include_new = new_in_pages = 1, out in T)");
  if (variant == 1) {
    require(pp.x && pp.wk && pp.wv, "proj_attention: fused needs x, wk and wv");
    require(pp.hidden >= proj::kHiddenStep && pp.hidden % proj::kHiddenStep == 0,
            "proj_attention: hidden " + std::to_string(pp.hidden) + " is not a positive multiple of " +
                std::to_string(proj::kHiddenStep));
    require(!pp.rope_cos == !pp.rope_sin, "proj_attention: rope_cos and rope_sin come together");
    for (const void* ptr : {pp.x, pp.wk, pp.wv}) {
      require(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "proj_attention: x, wk and wv must be 16-byte aligned");
    }
  }
  dispatch_dtype(kOp, dtype, [&](auto t) {
    dispatch_head_dim(kOp, head_dim, [&](auto hd) {
      dispatch_host_load(kOp, host_load, [&](auto l1) {
        launch_variant<decltype(t), decltype(hd)::value, decltype(l1)::value>(pp, variant, threads, stream);
      });
    });
  });
}

}  // namespace

void proj_attention_run(uintptr_t q, uintptr_t x, uintptr_t wk, uintptr_t wv, uintptr_t rope_cos, uintptr_t rope_sin,
                        uintptr_t host_k, uintptr_t host_v, uintptr_t hbm_k, uintptr_t hbm_v, uintptr_t block_table,
                        uintptr_t out, uintptr_t part_o, uintptr_t part_ml, int q_len, int past_len, int hidden,
                        int num_heads, int num_kv_heads, int head_dim, int page_size, bool causal, int variant,
                        int kv_chunk, int num_splits, int threads, float sm_scale, int dtype, int host_load,
                        uintptr_t stream) {
  ProjParams pp{};
  prefill::PrefillParams& p = pp.attn;
  p.q = reinterpret_cast<const void*>(q);
  // The new K/V are read from (separate) or written to (fused) their pages; k_new / v_new only pass the
  // launch checks and are never dereferenced (new_in_pages).
  p.k_new = p.v_new = p.q;
  p.host_k = reinterpret_cast<const void*>(host_k);
  p.host_v = reinterpret_cast<const void*>(host_v);
  p.hbm_k = reinterpret_cast<const void*>(hbm_k);
  p.hbm_v = reinterpret_cast<const void*>(hbm_v);
  p.block_table = reinterpret_cast<const int*>(block_table);
  p.out = reinterpret_cast<void*>(out);
  p.part_o = reinterpret_cast<float*>(part_o);
  p.part_ml = reinterpret_cast<float*>(part_ml);
  p.q_len = q_len;
  p.past_len = past_len;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.page_size = page_size;
  p.causal = causal ? 1 : 0;
  p.include_new = 1;
  p.new_in_pages = 1;
  p.kv_chunk = kv_chunk;
  p.num_chunks = kv_chunk > 0 ? (prefill::num_keys(p) + kv_chunk - 1) / kv_chunk : 0;
  p.num_splits = num_splits;
  p.num_buffers = 1;
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  pp.x = reinterpret_cast<const void*>(x);
  pp.wk = reinterpret_cast<const void*>(wk);
  pp.wv = reinterpret_cast<const void*>(wv);
  pp.rope_cos = reinterpret_cast<const float*>(rope_cos);
  pp.rope_sin = reinterpret_cast<const float*>(rope_sin);
  pp.hidden = hidden;
  launch(pp, variant, dtype, head_dim, threads, host_load, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace directkv
