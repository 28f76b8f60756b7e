// Launcher of decode attention: argument checks, dtype / head_dim / heads-per-CTA / tile dispatch, launch
// on the caller's stream. Also the occupancy query the Python split plan uses, the copy helpers of the
// copy-engine ("stream") variant and its per-layer loop (StreamQueue).
#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>


#include "directkv/dispatch.h"
#include "directkv/decode_attention.cuh"
#include "directkv/merge_stacked.cuh"
#include "directkv/scatter_rows.cuh"
#include "directkv/stream_queue.h"

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

// The checks of a launch's parameters (the stream loop makes them once per layer, before its first copy).
void check_launch(const DecodeParams& p, int heads_per_cta, int tile) {
  dispatch_tile(tile, [](auto) {});  // a supported tile before the plan is measured in tiles
  require(p.batch >= 1 && p.num_heads >= 1 && p.num_kv_heads >= 1, "decode_attention: empty batch or heads");
  require(p.num_heads % p.num_kv_heads == 0, "decode_attention: num_heads " + std::to_string(p.num_heads) +
                                                 " is not a multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  const int group = p.num_heads / p.num_kv_heads;
  require(group % heads_per_cta == 0, "decode_attention: heads_per_cta " + std::to_string(heads_per_cta) +
                                          " does not divide the GQA group " + std::to_string(group));
  require(p.page_shift >= 0 && p.page_shift < 24, "decode_attention: page_size must be a power of two");
  require((1 << p.page_shift) >= 8, "decode_attention: page_size must be >= 8");
  require(p.num_splits >= 1 && p.tiles_per_split >= 1, "decode_attention: num_splits and tiles_per_split must be >= 1");
  // A split plan shorter than the block table would leave a sequence's tail unread, and on the global-merge path its
  // last split would never arrive: no output, and an arrival counter left non-zero that breaks the next launch.
  const int64_t planned = int64_t(p.num_splits) * p.tiles_per_split * tile;
  const int64_t table = int64_t(p.max_pages) << p.page_shift;
  require(planned >= table, "decode_attention: the split plan covers " + std::to_string(p.num_splits) + " x " +
                                std::to_string(p.tiles_per_split) + " tiles of " + std::to_string(tile) + " = " +
                                std::to_string(planned) + " tokens, fewer than the block table's " +
                                std::to_string(p.max_pages) + " pages x " + std::to_string(1 << p.page_shift) +
                                " = " + std::to_string(table));
  require(p.num_splits == 1 || (p.part_o && p.part_lse && p.counters),
          "decode_attention: num_splits > 1 needs the part_o / part_lse / counters workspace");
  require(p.out || p.out_f32, "decode_attention: no output pointer");
  for (const void* ptr : {p.q, p.host_k, p.host_v, p.hbm_k, p.hbm_v}) {
    require(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "decode_attention: q and KV pools must be 16-byte aligned");
  }
  require(p.batch <= 65535 && p.num_splits <= 65535, "decode_attention: batch and num_splits must be <= 65535");
  require(!p.cluster_merge || (p.num_splits >= 2 && p.num_splits <= kDecodeClusterMax),
          "decode_attention: cluster_merge needs 2.." + std::to_string(kDecodeClusterMax) + " splits, got " +
              std::to_string(p.num_splits));
  require(p.load_mode >= kCpAsyncL2 && p.load_mode <= kCpAsyncL2Pair,
          "decode_attention: load_mode " + std::to_string(p.load_mode) + " is not in 0..4 (see DecodeLoad)");
}

// The launch of checked parameters (with_kernel refuses an unsupported dtype / head_dim / hpc / tile).
void launch_checked(const DecodeParams& p, int dtype, int head_dim, int heads_per_cta, int tile, cudaStream_t stream) {
  with_kernel(dtype, head_dim, heads_per_cta, tile, [&](auto kernel, size_t smem, int threads) {
    const int groups = p.num_heads / heads_per_cta;
    const dim3 grid = p.split_major ? dim3(p.num_splits, groups, p.batch) : dim3(groups, p.batch, p.num_splits);
    if (!p.cluster_merge) {
      kernel<<<grid, threads, smem, stream>>>(p);
      check_cuda(cudaGetLastError(), "decode_attention: kernel launch");
      return;
    }
    // one cluster per (sequence, head group): all its splits, so a CTA's cluster rank is its split
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    const unsigned s = static_cast<unsigned>(p.num_splits);
    attr.val.clusterDim.x = p.split_major ? s : 1;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = p.split_major ? 1 : s;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    check_cuda(cudaLaunchKernelEx(&cfg, kernel, p), "decode_attention: cluster launch");
  });
}

void launch(const DecodeParams& p, int dtype, int head_dim, int heads_per_cta, int tile, cudaStream_t stream) {
  check_launch(p, heads_per_cta, tile);
  launch_checked(p, dtype, head_dim, heads_per_cta, tile, stream);
}

}  // namespace

void decode_attention_run(uintptr_t q, uintptr_t host_k, uintptr_t host_v, uintptr_t hbm_k, uintptr_t hbm_v,
                          uintptr_t block_table, uintptr_t seq_lens, uintptr_t out, uintptr_t out_f32,
                          uintptr_t lse_out, uintptr_t part_o, uintptr_t part_lse, uintptr_t counters, int batch,
                          int num_heads, int num_kv_heads, int head_dim, int max_pages, int page_size,
                          int num_splits, int tiles_per_split, int heads_per_cta, int tile, float sm_scale,
                          int dtype, int load_mode, int split_major, int cluster_merge, uintptr_t stream) {
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
  p.cluster_merge = cluster_merge;
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  launch(p, dtype, head_dim, heads_per_cta, tile, reinterpret_cast<cudaStream_t>(stream));
}

// Asynchronous copy with the kind inferred from UVA (host pinned -> HBM uses the copy engine).
void copy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
  check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                             cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)),
             "decode_attention: cudaMemcpyAsync");
}

namespace {

// copy_async for many page runs in one call: for each (src page, dst page, pages) and each (dst, src) base pair,
// pages * unit_bytes bytes. Issued from C++ because a ring chunk of scattered pages is hundreds of copies, and
// one Python call per copy cost more CPU time than the copy engine needed for the bytes. With CUDA 13's
// cudaMemcpyBatchAsync the whole set is one call (the driver may also pack the DMA work); where the runtime
// refuses it, the copies go one cudaMemcpyAsync at a time, and later calls do not try the batch again.
// `runs` points at num_runs x 3 int64 (host memory): a serving path packs its runs once per step and issues
// them every layer, so they are not converted from Python tuples on every call.
void issue_runs(const uintptr_t* dst_bases, const uintptr_t* src_bases, size_t bases, const int64_t* r,
                int64_t num_runs, size_t unit_bytes, cudaStream_t s) {
  thread_local std::vector<void*> dsts;  // reused: this runs per ring chunk, per layer
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<size_t> sizes;
  dsts.clear();
  srcs.clear();
  sizes.clear();
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t src = r[3 * i], dst = r[3 * i + 1], n = r[3 * i + 2];
    for (size_t b = 0; b < bases; ++b) {
      dsts.push_back(reinterpret_cast<void*>(dst_bases[b] + static_cast<size_t>(dst) * unit_bytes));
      srcs.push_back(reinterpret_cast<const void*>(src_bases[b] + static_cast<size_t>(src) * unit_bytes));
      sizes.push_back(static_cast<size_t>(n) * unit_bytes);
    }
  }
  if (dsts.empty()) return;
#if CUDART_VERSION >= 13000
  static std::atomic<bool> batch_ok{true};  // atomic: safe should a binding ever release the GIL
  // Under stream capture (a CUDA graph of a stream call) the plain copies become graph nodes; a refused batch
  // there would invalidate the capture and switch the batch off for every later eager call of the process.
  // The legacy default stream is refused by the batch API: plain copies there too, batching left on for the rest.
  const bool legacy = s == nullptr || s == cudaStreamLegacy;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (!legacy) check_cuda(cudaStreamIsCapturing(s, &capturing), "decode_attention: cudaStreamIsCapturing");
  if (batch_ok && dsts.size() > 1 && !legacy && capturing == cudaStreamCaptureStatusNone) {
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

// Busy-waits `cycles` GPU clock cycles: a test's delay of a kernel behind its copy (torch.cuda._sleep's job).
__global__ void spin_kernel(int64_t cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

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
  issue_runs(dst_bases.data(), src_bases.data(), dst_bases.size(), reinterpret_cast<const int64_t*>(runs), num_runs,
             unit_bytes, reinterpret_cast<cudaStream_t>(stream));
}

// --- StreamQueue (directkv/stream_queue.h) ---------------------------------------------------------------

StreamQueue::StreamQueue(uintptr_t ring_k, uintptr_t ring_v, int64_t slot_bytes, int64_t page_bytes,
                         std::vector<uintptr_t> runs, std::vector<int64_t> num_runs, std::vector<uintptr_t> filled,
                         std::vector<uintptr_t> freed, uintptr_t side, std::vector<int64_t> last_n,
                         std::vector<uintptr_t> last_rows, std::vector<uintptr_t> last_at, int64_t ring_rows,
                         int64_t row_bytes)
    : ring_k_(ring_k), ring_v_(ring_v), slot_bytes_(slot_bytes), page_bytes_(page_bytes), runs_(std::move(runs)),
      num_runs_(std::move(num_runs)), filled_(std::move(filled)), freed_(std::move(freed)), side_(side),
      last_n_(std::move(last_n)), last_rows_(std::move(last_rows)), last_at_(std::move(last_at)),
      ring_rows_(ring_rows), row_bytes_(row_bytes) {
  const size_t slots = filled_.size();
  require(slots >= 2 && freed_.size() == slots, "StreamQueue: >= 2 ring slots, one filled and one freed event each; got " +
                                                    std::to_string(filled_.size()) + " and " +
                                                    std::to_string(freed_.size()));
  for (size_t i = 0; i < slots; ++i) {
    require(filled_[i] != 0 && freed_[i] != 0, "StreamQueue: slot " + std::to_string(i) + " has an uncreated event");
  }
  require(num_runs_.size() == runs_.size(), "StreamQueue: one run count per chunk's runs array; got " +
                                               std::to_string(num_runs_.size()) + " counts for " +
                                               std::to_string(runs_.size()) + " arrays");
  for (size_t c = 0; c < runs_.size(); ++c) {
    require(num_runs_[c] >= 0 && (num_runs_[c] == 0 || runs_[c] != 0),
            "StreamQueue: chunk " + std::to_string(c) + " needs a run count >= 0 and, above 0, a runs array; got " +
                std::to_string(num_runs_[c]) + " runs" + (runs_[c] ? "" : " and no array"));
  }
  const size_t early = std::min(slots, runs_.size());
  require(last_n_.size() == early && last_rows_.size() == early && last_at_.size() == early * slots,
          "StreamQueue: last-token rows for each of the first min(slots, chunks) = " + std::to_string(early) +
              " chunks, per slot; got " + std::to_string(last_n_.size()) + " counts, " +
              std::to_string(last_rows_.size()) + " row arrays, " + std::to_string(last_at_.size()) +
              " ring-row arrays");
  require(row_bytes_ >= 16 && row_bytes_ % 16 == 0 && slot_bytes_ > 0 && page_bytes_ > 0 && ring_rows_ > 0,
          "StreamQueue: a token row of a positive multiple of 16 bytes and a non-empty ring; got row_bytes " +
              std::to_string(row_bytes_) + ", slot_bytes " + std::to_string(slot_bytes_));
}

void StreamQueue::set_queue(std::vector<uintptr_t> host_k, std::vector<uintptr_t> host_v) {
  require(host_k.size() == host_v.size(), "StreamQueue: one host V pool per host K pool");
  queue_k_ = std::move(host_k);
  queue_v_ = std::move(host_v);
}

int64_t StreamQueue::fill(int64_t copied, int64_t consumed, int64_t upto, bool wait_readers) {
  const int64_t slots = num_slots(), n = num_chunks();
  const int64_t limit = std::min({upto, consumed + slots, static_cast<int64_t>(queue_k_.size()) * n});
  const auto side = reinterpret_cast<cudaStream_t>(side_);
  for (; copied < limit; ++copied) {
    const int64_t g = copied, slot = g % slots, c = g % n, call = g / n;
    if (g >= slots && wait_readers) {  // the first chunks follow the caller's wait_stream before them
      check_cuda(cudaStreamWaitEvent(side, reinterpret_cast<cudaEvent_t>(freed_[slot]), 0), "StreamQueue: wait freed");
    }
    const uintptr_t dst[2] = {ring_k_ + slot * slot_bytes_, ring_v_ + slot * slot_bytes_};
    const uintptr_t src[2] = {queue_k_[call], queue_v_[call]};
    issue_runs(dst, src, 2, reinterpret_cast<const int64_t*>(runs_[c]), num_runs_[c], page_bytes_, side);
    check_cuda(cudaEventRecord(reinterpret_cast<cudaEvent_t>(filled_[slot]), side), "StreamQueue: record filled");
  }
  return copied;
}

std::pair<int64_t, int64_t> StreamQueue::run_layer(uintptr_t main, int64_t first, int64_t copied,
                                                   const StreamLaunch& a, uintptr_t last_k, uintptr_t last_v,
                                                   int64_t last_src_rows, int64_t lag_cycles, bool wait_readers) {
  const int64_t slots = num_slots(), n = num_chunks();
  // chunks copied before the call began were copied before its caller stored this step's tokens
  const int64_t early = copied;
  require(n == 0 || (first % n == 0 && first / n < static_cast<int64_t>(queue_k_.size()) && first <= copied &&
                     copied <= first + slots),
          "StreamQueue: call at chunk " + std::to_string(first) + " with " + std::to_string(copied) +
              " chunks copied is not a call of the queue (" + std::to_string(queue_k_.size()) + " calls of " +
              std::to_string(n) + " chunks, " + std::to_string(slots) + " slots)");
  require(a.num_passes == n + (a.hbm_pass ? 1 : 0),
          "StreamQueue: " + std::to_string(a.num_passes) + " passes for " + std::to_string(n) + " chunks" +
              (a.hbm_pass ? " and an HBM pass" : ""));
  const bool single = n == 1 && !a.hbm_pass;
  require(single || (a.o_parts && a.lse_parts), "StreamQueue: more than one pass needs o_parts and lse_parts");
  require(is_pow2(a.page_size), "StreamQueue: page_size " + std::to_string(a.page_size) + " is not a power of two");
  const auto stream = reinterpret_cast<cudaStream_t>(main);
  DecodeParams p{};
  p.q = reinterpret_cast<const void*>(a.q);
  p.part_o = reinterpret_cast<float*>(a.part_o);
  p.part_lse = reinterpret_cast<float*>(a.part_lse);
  p.counters = reinterpret_cast<int*>(a.counters);
  p.batch = a.batch;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.max_pages = a.width;
  p.page_shift = log2_int(a.page_size);
  p.num_splits = a.num_splits;
  p.tiles_per_split = a.tiles_per_split;
  p.load_mode = a.load_mode;
  p.split_major = a.split_major;
  p.scale_log2 = a.sm_scale * 1.4426950408889634f;
  const int64_t table_elems = int64_t(a.batch) * a.width, rows = int64_t(a.batch) * a.num_heads;
  // the decode kernel's checks before the first copy, so a refused launch leaves the queue as it was (the
  // scatter's and merge's own checks cover what the Python wrapper already guarantees: 16-byte rows, head_dim)
  p.host_k = p.hbm_k = reinterpret_cast<const void*>(ring_k_);
  p.host_v = p.hbm_v = reinterpret_cast<const void*>(ring_v_);
  p.out = reinterpret_cast<void*>(a.out);
  check_launch(p, a.heads_per_cta, a.tile);
  with_kernel(a.dtype, a.head_dim, a.heads_per_cta, a.tile, [](auto, size_t, int) {});  // a supported kernel
  require(slot_bytes_ % 16 == 0 && a.hbm_k % 16 == 0 && a.hbm_v % 16 == 0,
          "StreamQueue: ring slots and HBM pools must be 16-byte aligned");
  auto pass = [&](int i, uintptr_t k, uintptr_t v) {  // the kernel over pass i's table, pools k / v
    p.host_k = p.hbm_k = reinterpret_cast<const void*>(k);
    p.host_v = p.hbm_v = reinterpret_cast<const void*>(v);
    p.block_table = reinterpret_cast<const int*>(a.passes) + i * table_elems;
    p.seq_lens = reinterpret_cast<const int*>(a.lens) + int64_t(i) * a.batch;
    p.out = single ? reinterpret_cast<void*>(a.out) : nullptr;
    p.out_f32 = single ? nullptr : reinterpret_cast<float*>(a.o_parts) + i * rows * a.head_dim;
    p.lse_out = single ? nullptr : reinterpret_cast<float*>(a.lse_parts) + i * rows;
    launch_checked(p, a.dtype, a.head_dim, a.heads_per_cta, a.tile, stream);  // checked above, once per layer
  };
  int64_t consumed = first;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t g = first + c, slot = g % slots;
    copied = fill(copied, consumed, g + 1, wait_readers);
    // the copy must not land on top of the last tokens written next
    check_cuda(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(filled_[slot]), 0), "StreamQueue: wait filled");
    if (g < early && last_k && last_n_[c] > 0) {  // g < early <= first + slots: c < min(slots, n)
      // copied before the caller stored this step's tokens: write them in just before this chunk's kernel,
      // which so waits for its own copy only (not for every early chunk's)
      ScatterRowsParams s{};
      s.dst[0] = reinterpret_cast<void*>(ring_k_);
      s.dst[1] = reinterpret_cast<void*>(ring_v_);
      s.src[0] = reinterpret_cast<const void*>(last_k);
      s.src[1] = reinterpret_cast<const void*>(last_v);
      s.dst_rows = reinterpret_cast<const int64_t*>(last_at_[c * slots + slot]);
      s.src_rows = reinterpret_cast<const int64_t*>(last_rows_[c]);
      s.n = last_n_[c];
      s.dst_rows_total = ring_rows_;
      s.src_rows_total = last_src_rows;
      s.row_vecs = static_cast<int>(row_bytes_ / 16);
      launch_scatter_rows(s, 2, stream);
    }
    if (lag_cycles > 0) {
      spin_kernel<<<1, 1, 0, stream>>>(lag_cycles);
      check_cuda(cudaGetLastError(), "StreamQueue: spin kernel launch");
    }
    pass(static_cast<int>(c), ring_k_ + slot * slot_bytes_, ring_v_ + slot * slot_bytes_);
    check_cuda(cudaEventRecord(reinterpret_cast<cudaEvent_t>(freed_[slot]), stream), "StreamQueue: record freed");
    consumed = g + 1;
    copied = fill(copied, consumed, consumed + slots, wait_readers);  // this call's next chunk, or a later call's
  }
  if (a.hbm_pass) pass(a.num_passes - 1, a.hbm_k, a.hbm_v);
  if (!single) {
    // a pass without a sequence's tokens has LSE -inf there: weight 0
    const MergeStackedParams m{reinterpret_cast<const float*>(a.o_parts), reinterpret_cast<const float*>(a.lse_parts),
                               reinterpret_cast<void*>(a.out), rows, a.head_dim, a.num_passes, a.head_dim};
    launch_merge_stacked(m, a.dtype, stream);
  }
  return {copied, consumed};
}

}  // namespace directkv
