// Launcher of decode attention: argument checks, dtype / head_dim / heads-per-CTA / tile dispatch, launch
// on the caller's stream. Also the occupancy query the Python split plan uses, and an async copy helper for
// the copy-engine ("stream") variant.
#include <stdexcept>
#include <utility>
#include <vector>
#include <type_traits>

#include "directkv/dispatch.h"
#include "directkv/decode_attention.cuh"

namespace directkv {
namespace {

constexpr int kStages = 3;

template <typename F>
void dispatch_heads_per_cta(int hpc, F&& f) {
  switch (hpc) {
    case 1: return f(Int<1>());
    case 2: return f(Int<2>());
    case 4: return f(Int<4>());
    case 8: return f(Int<8>());
    default: throw std::runtime_error("decode_attention: heads_per_cta " + std::to_string(hpc) + " is not 1, 2, 4 or 8");
  }
}

template <typename F>
void dispatch_tile(int tile, F&& f) {
  switch (tile) {
    case 32: return f(Int<32>());
    case 64: return f(Int<64>());
    default: throw std::runtime_error("decode_attention: tile_kv " + std::to_string(tile) + " is not 32 or 64");
  }
}

// Calls f(kernel pointer, shared-memory bytes) for the instantiation that serves these arguments.
template <typename F>
void with_kernel(int dtype, int head_dim, int hpc, int tile, F&& f) {
  dispatch_dtype("decode_attention", dtype, [&](auto t) {
    dispatch_head_dim("decode_attention", head_dim, [&](auto hd) {
      dispatch_heads_per_cta(hpc, [&](auto h) {
        dispatch_tile(tile, [&](auto tl) {
          using T = decltype(t);
          using Cfg = DecodeConfig<T, hd.value, h.value, tl.value, kStages>;
          auto kernel = decode_attention_kernel<T, hd.value, h.value, tl.value, kStages>;
          // Above 48 KB a kernel must opt in to its dynamic shared memory; once per instantiation.
          static const cudaError_t attr = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSmemBytes));
          check_cuda(attr, "decode_attention: cudaFuncSetAttribute");
          f(kernel, Cfg::kSmemBytes, Cfg::kThreads);
        });
      });
    });
  });
}

}  // namespace

// Returns {number of SMs, resident CTAs per SM} of the kernel serving these arguments.
std::pair<int, int> decode_attention_occupancy(int dtype, int head_dim, int heads_per_cta, int tile) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  int per_sm = 0;
  with_kernel(dtype, head_dim, heads_per_cta, tile, [&](auto kernel, size_t smem, int threads) {
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  });
  return {sms, per_sm};
}

namespace {

void launch(const DecodeParams& p, int dtype, int head_dim, int heads_per_cta, int tile, cudaStream_t stream) {
  require(p.batch >= 1 && p.num_heads >= 1 && p.num_kv_heads >= 1, "decode_attention: empty batch or heads");
  require(p.num_heads % p.num_kv_heads == 0, "decode_attention: num_heads " + std::to_string(p.num_heads) +
                                                 " is not a multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  const int group = p.num_heads / p.num_kv_heads;
  require(group % heads_per_cta == 0, "decode_attention: heads_per_cta " + std::to_string(heads_per_cta) +
                                          " does not divide the GQA group " + std::to_string(group));
  require(p.page_shift >= 0 && p.page_shift < 24, "decode_attention: page_size must be a power of two");
  require((1 << p.page_shift) >= 8, "decode_attention: page_size must be >= 8");
  require(p.num_splits >= 1 && p.tiles_per_split >= 1, "decode_attention: num_splits and tiles_per_split must be >= 1");
  require(p.num_splits == 1 || (p.part_o && p.part_lse && p.counters),
          "decode_attention: num_splits > 1 needs the part_o / part_lse / counters workspace");
  require(p.out || p.out_f32, "decode_attention: no output pointer");
  for (const void* ptr : {p.q, p.host_k, p.host_v, p.hbm_k, p.hbm_v}) {
    require(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "decode_attention: q and KV pools must be 16-byte aligned");
  }
  require(p.batch <= 65535 && p.num_splits <= 65535, "decode_attention: batch and num_splits must be <= 65535");
  require(p.load_mode >= kCpAsyncL2 && p.load_mode <= kCpAsyncL2Pair,
          "decode_attention: load_mode " + std::to_string(p.load_mode) + " is not in 0..4 (see DecodeLoad)");
  with_kernel(dtype, head_dim, heads_per_cta, tile, [&](auto kernel, size_t smem, int threads) {
    const int groups = p.num_heads / heads_per_cta;
    const dim3 grid = p.split_major ? dim3(p.num_splits, groups, p.batch) : dim3(groups, p.batch, p.num_splits);
    kernel<<<grid, threads, smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "decode_attention: kernel launch");
  });
}

}  // namespace

void decode_attention_run(uintptr_t q, uintptr_t host_k, uintptr_t host_v, uintptr_t hbm_k, uintptr_t hbm_v,
                          uintptr_t block_table, uintptr_t seq_lens, uintptr_t out, uintptr_t out_f32,
                          uintptr_t lse_out, uintptr_t part_o, uintptr_t part_lse, uintptr_t counters, int batch,
                          int num_heads, int num_kv_heads, int head_dim, int max_pages, int page_size,
                          int num_splits, int tiles_per_split, int heads_per_cta, int tile, float sm_scale,
                          int dtype, int load_mode, int split_major, uintptr_t stream) {
  require(is_pow2(page_size), "decode_attention: page_size " + std::to_string(page_size) + " is not a power of two");
  DecodeParams p{};
  p.q = reinterpret_cast<const void*>(q);
  p.host_k = reinterpret_cast<const void*>(host_k);
  p.host_v = reinterpret_cast<const void*>(host_v);
  p.hbm_k = reinterpret_cast<const void*>(hbm_k);
  p.hbm_v = reinterpret_cast<const void*>(hbm_v);
  p.block_table = reinterpret_cast<const int*>(block_table);
  p.seq_lens = reinterpret_cast<const int*>(seq_lens);
  p.out = reinterpret_cast<void*>(out);
  p.out_f32 = reinterpret_cast<float*>(out_f32);
  p.lse_out = reinterpret_cast<float*>(lse_out);
  p.part_o = reinterpret_cast<float*>(part_o);
  p.part_lse = reinterpret_cast<float*>(part_lse);
  p.counters = reinterpret_cast<int*>(counters);
  p.batch = batch;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.max_pages = max_pages;
  p.page_shift = log2_int(page_size);
  p.num_splits = num_splits;
  p.tiles_per_split = tiles_per_split;
  p.load_mode = load_mode;
  p.split_major = split_major;
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  launch(p, dtype, head_dim, heads_per_cta, tile, reinterpret_cast<cudaStream_t>(stream));
}

// Asynchronous copy with the kind inferred from UVA (host pinned -> HBM uses the copy engine).
void copy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
  check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                             cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)),
             "decode_attention: cudaMemcpyAsync");
}

// copy_async for many page runs in one call: for each (src page, dst page, pages) and each (dst, src) base pair,
// pages * unit_bytes bytes. Issued from C++ because a ring chunk of scattered pages is hundreds of copies, and
// one Python call per copy cost more CPU time than the copy engine needed for the bytes. With CUDA 13's
// cudaMemcpyBatchAsync the whole set is one call (the driver may also pack the DMA work); where the runtime
// refuses it, the copies go one cudaMemcpyAsync at a time, and later calls do not try the batch again.
// `runs` points at num_runs x 3 int64 (host memory): a serving path packs its runs once per step and issues
// them every layer, so they are not converted from Python tuples on every call.
void copy_runs_packed(const std::vector<uintptr_t>& dst_bases, const std::vector<uintptr_t>& src_bases,
                      uintptr_t runs, int64_t num_runs, size_t unit_bytes, uintptr_t stream) {
  if (dst_bases.size() != src_bases.size()) {
    throw std::invalid_argument("copy_runs_packed: one src base per dst base; got " + std::to_string(dst_bases.size()) +
                                " dst and " + std::to_string(src_bases.size()) + " src");
  }
  if (num_runs < 0 || (num_runs > 0 && runs == 0)) {
    throw std::invalid_argument("copy_runs_packed: num_runs " + std::to_string(num_runs) +
                                " must be >= 0, with a runs array when > 0");
  }
  const auto* r = reinterpret_cast<const int64_t*>(runs);
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(static_cast<size_t>(num_runs) * dst_bases.size());
  srcs.reserve(dsts.capacity());
  sizes.reserve(dsts.capacity());
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t src = r[3 * i], dst = r[3 * i + 1], n = r[3 * i + 2];
    for (size_t b = 0; b < dst_bases.size(); ++b) {
      dsts.push_back(reinterpret_cast<void*>(dst_bases[b] + static_cast<size_t>(dst) * unit_bytes));
      srcs.push_back(reinterpret_cast<const void*>(src_bases[b] + static_cast<size_t>(src) * unit_bytes));
      sizes.push_back(static_cast<size_t>(n) * unit_bytes);
    }
  }
  if (dsts.empty()) return;
  const auto s = reinterpret_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 13000
  static bool batch_ok = true;
  if (batch_ok && dsts.size() > 1) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the pinned pages may be written by earlier work
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_index = 0;
    if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &attr_index, 1, s) ==
        cudaSuccess) {
      return;
    }
    (void)cudaGetLastError();  // clear the refusal; fall back for this and every later call
    batch_ok = false;
  }
#endif
  for (size_t i = 0; i < dsts.size(); ++i) {
    check_cuda(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, s), "decode_attention: cudaMemcpyAsync");
  }
}

}  // namespace directkv
