// Launcher of the GEMM case study: argument checks, variant / alignment / host-load / output-dtype dispatch,
// launch on the caller's stream. The k-split plan is host-side arithmetic done by the Python wrapper. Also
// the 2-D panel copy of the copy-engine ("stream") variant, whose math is cuBLAS through torch.
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "directkv/dispatch.h"
#include "directkv/gemm_reduce.cuh"
#include "directkv/gemm_ring.cuh"  // and gemm_stationary.cuh, gemm_case_study.cuh

namespace directkv {
namespace {

using gemm::GemmParams;

// The driver's tensor-map encoder, looked up once through the runtime (no link against the driver library).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found),
               "gemm_case_study: cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    require(found == cudaDriverEntryPointSuccess && f, "gemm_case_study: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [m, k] (fp16, rows 16-byte aligned) as the TMA tensor the tiled / pipelined kernels stream: boxes of box_rows
// rows x kBK columns in the 128-byte swizzle the wgmma descriptors expect; reads past m or k return zeros.
CUtensorMap a_tensor_map(const __half* a, int m, int k, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(m)};
  const cuuint64_t row_bytes[1] = {static_cast<cuuint64_t>(k) * sizeof(__half)};
  const cuuint32_t box[2] = {gemm::kBK, static_cast<cuuint32_t>(box_rows)}, unit[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<__half*>(a), dims, row_bytes, box, unit,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  require(r == CUDA_SUCCESS, "gemm_case_study: cuTensorMapEncodeTiled failed for A [" + std::to_string(m) + ", " + std::to_string(k) +
                                 "] (CUresult " + std::to_string(static_cast<int>(r)) + ")");
  return map;
}

enum Variant : int { kNaive = 0, kTiled = 1, kPipelined = 2, kRaster = 3 };

template <typename F>
void dispatch_out(int code, F&& f) {
  switch (code) {
    case kFloat16: return f(__half());
    case kFloat32: return f(float());
    default: throw std::runtime_error("gemm_case_study: output dtype code " + std::to_string(code) + " is not fp16 (0) or fp32 (2)");
  }
}

// 16-byte copies (VEC) need every row start 16-byte aligned, and the L1 host load is one of them: with VEC
// false it has nothing to change, so it maps to the one element-load kernel instead of a copy of it.
template <typename F>
void dispatch_vec_l1(bool vec, int host_load, F&& f) {
  dispatch_bool(vec, [&](auto v) {
    dispatch_host_load("gemm_case_study", host_load, [&](auto l1) {
      constexpr bool V = decltype(v)::value;
      f(Bool<V>(), Bool<V && decltype(l1)::value>());
    });
  });
}

// A launch of `grid` CTAs of `threads` threads and `smem` bytes (pipelined's by default) in clusters of
// (cluster, 1, 1). cfg points into the object's own attribute, so it is neither copied nor moved.
struct ClusterLaunch {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg{};
  ClusterLaunch(unsigned grid, int cluster, cudaStream_t stream, int threads = gemm::kPipeThreads, size_t smem = gemm::kPipeSmem) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

void launch(GemmParams& p, int variant, int out_dtype, int host_load, int cluster, int ctas, cudaStream_t stream) {
  require(p.m >= 1 && p.n >= 1 && p.k >= 1, "gemm_case_study: m, n, k must be >= 1");
  require(p.a && p.b && p.c, "gemm_case_study: null a, b or c");
  const bool vec = p.k % 8 == 0 && p.n % 8 == 0 && reinterpret_cast<uintptr_t>(p.a) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.b) % 16 == 0;
  const int64_t ntiles = (p.n + gemm::kBN - 1) / gemm::kBN, mtiles = (p.m + gemm::kBM - 1) / gemm::kBM;
  if (variant == kNaive || variant == kRaster) {
    const bool m_fast = variant == kRaster;
    require((m_fast ? ntiles : mtiles) <= 65535, "gemm_case_study: matrix too large for the naive / raster grid");
    dispatch_out(out_dtype, [&](auto o) {
      dispatch_vec_l1(vec, host_load, [&](auto v, auto l1) {
        dispatch_bool(m_fast, [&](auto mf) {
          auto kernel = gemm::gemm_naive_kernel<decltype(v)::value, decltype(l1)::value, decltype(mf)::value, decltype(o)>;
          const size_t smem = gemm::kNaiveStages * (gemm::kATile + gemm::kBTile) * sizeof(__half);
          allow_max_smem("gemm_case_study", kernel, smem);
          const dim3 grid = m_fast ? dim3(static_cast<unsigned>(mtiles), static_cast<unsigned>(ntiles))
                                   : dim3(static_cast<unsigned>(ntiles), static_cast<unsigned>(mtiles));
          kernel<<<grid, gemm::kThreads, smem, stream>>>(p);
          check_cuda(cudaGetLastError(), "gemm_case_study: naive / raster kernel launch");
        });
      });
    });
    return;
  }
  require(variant == kTiled || variant == kPipelined,
          "gemm_case_study: variant code " + std::to_string(variant) + " is not naive (0), tiled (1), pipelined (2) "
          "or raster (3)");
  require(p.part, "gemm_case_study: tiled / pipelined need the partial-C workspace");
  require(p.ldp == ntiles * gemm::kBN, "gemm_case_study: ldp must be 128 * ceil(n / 128)");
  require(p.chunks == (p.k + gemm::kChunkK - 1) / gemm::kChunkK, "gemm_case_study: chunks must be ceil(k / 512)");
  require(p.k_splits >= 1 && p.k_splits <= p.chunks, "gemm_case_study: k_splits must be in 1.." + std::to_string(p.chunks));
  require(ntiles * p.k_splits < (int64_t{1} << 31), "gemm_case_study: grid too large");
  // Pairs of strips share A tiles by TMA multicast: pipelined, A by TMA (16-byte rows), and strips that pair up.
  require(cluster == 1 || cluster == 2, "gemm_case_study: cluster " + std::to_string(cluster) + " must be 1 or 2");
  require(cluster == 1 || (variant == kPipelined && vec && ntiles % 2 == 0),
          "gemm_case_study: cluster 2 needs variant pipelined, k and n multiples of 8, 16-byte aligned A and B and an even "
          "number of 128-column strips; got variant " + std::to_string(variant) + ", n = " + std::to_string(p.n) + ", k = " +
              std::to_string(p.k) + ", 16-byte rows " + std::to_string(vec));
  const bool pair = cluster == 2;
  if (p.stage) {  // persistent: ctas CTAs walk the strips x chunks items, staging each next B chunk in HBM
    require(variant == kPipelined && p.atomic && vec && p.k_splits == p.chunks,
            "gemm_case_study: persistent CTAs need variant pipelined, accumulate atomic, 16-byte rows and one chunk a split; got "
            "variant " + std::to_string(variant) + ", atomic " + std::to_string(p.atomic) + ", 16-byte rows " + std::to_string(vec) +
                ", k_splits " + std::to_string(p.k_splits) + " of " + std::to_string(p.chunks) + " chunks");
    require(p.stage_slots == 1 || p.stage_slots == 2,
            "gemm_case_study: stage_slots " + std::to_string(p.stage_slots) + " must be 1 or 2");
    require(ctas >= cluster && ctas % cluster == 0 && ctas <= ntiles * p.chunks,
            "gemm_case_study: persistent grid " + std::to_string(ctas) + " must be a multiple of the cluster size " +
                std::to_string(cluster) + " in 1.." + std::to_string(ntiles * p.chunks) + " (the items)");
  }
  const unsigned grid = static_cast<unsigned>(p.stage ? ctas : ntiles * p.k_splits);
  // pipelined: 64-row blocks, each half (32 rows) from one CTA of a pair
  if (vec) p.a_map = a_tensor_map(p.a, p.m, p.k, variant == kTiled ? gemm::kBM : pair ? 32 : 64);
  dispatch_vec_l1(vec, host_load, [&](auto v, auto l1) {
    constexpr bool V = decltype(v)::value, L1 = decltype(l1)::value;
    if (variant == kTiled) {
      allow_max_smem("gemm_case_study", gemm::gemm_tiled_kernel<V, L1>, gemm::kTiledSmem);
      gemm::gemm_tiled_kernel<V, L1><<<grid, gemm::kThreads, gemm::kTiledSmem, stream>>>(p);
    } else if (!pair) {
      allow_max_smem("gemm_case_study", gemm::gemm_pipelined_kernel<V, L1, 1>, gemm::kPipeSmem);
      gemm::gemm_pipelined_kernel<V, L1, 1><<<grid, gemm::kPipeThreads, gemm::kPipeSmem, stream>>>(p);
    } else if constexpr (V) {  // pair implies 16-byte rows
      allow_max_smem("gemm_case_study", gemm::gemm_pipelined_kernel<V, L1, 2>, gemm::kPipeSmem);
      const ClusterLaunch pairs_launch(grid, 2, stream);
      check_cuda(cudaLaunchKernelEx(&pairs_launch.cfg, gemm::gemm_pipelined_kernel<V, L1, 2>, p), "gemm_case_study: clustered kernel launch");
    }
    check_cuda(cudaGetLastError(), "gemm_case_study: kernel launch");
  });
  dispatch_out(out_dtype, [&](auto o) {
    constexpr int kReduceThreads = 256;
    const int64_t quads = static_cast<int64_t>(p.m) * (p.ldp / 4);  // a thread per 4 columns of a padded row
    gemm::gemm_reduce_kernel<decltype(o)><<<static_cast<unsigned>((quads + kReduceThreads - 1) / kReduceThreads), kReduceThreads, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "gemm_case_study: reduce kernel launch");
  });
}

// The ring kernel for an output dtype and cluster size.
template <typename OutT>
auto ring_kernel(int cluster) {
  return cluster == 2 ? gemm::gemm_ring_kernel<OutT, 2> : gemm::gemm_ring_kernel<OutT, 1>;
}

// As many clusters of `cluster` CTAs of `kernel` (threads, smem) as can be resident at once on the current device,
// times the cluster size (one CTA an SM; pairs need two free SMs of one GPC). Cached by device: the ring asks at
// every launch.
template <typename Kernel>
int resident_ctas(Kernel kernel, int cluster, int threads, size_t smem, const char* what) {
  require(cluster == 1 || cluster == 2, "gemm_case_study: cluster " + std::to_string(cluster) + " must be 1 or 2");
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;  // (kernel, device, cluster) -> CTAs
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, cluster);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  allow_max_smem("gemm_case_study", kernel, smem);
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const ClusterLaunch full_grid(static_cast<unsigned>(sms / cluster * cluster), cluster, nullptr, threads, smem);
  int clusters = 0;
  check_cuda(cudaOccupancyMaxActiveClusters(&clusters, kernel, &full_grid.cfg), "gemm_case_study: cudaOccupancyMaxActiveClusters");
  require(clusters >= 1, "gemm_case_study: no cluster of " + std::to_string(cluster) + " " + what + " CTAs fits this GPU");
  return cache[key] = clusters * cluster;
}

}  // namespace

// CTAs of the persistent pipelined grid: the clusters resident at once, so no CTA waits for another to finish before
// taking its first item.
int gemm_persistent_ctas(int cluster) {
  auto kernel = cluster == 2 ? gemm::gemm_pipelined_kernel<true, false, 2> : gemm::gemm_pipelined_kernel<true, false, 1>;
  return resident_ctas(kernel, cluster, gemm::kPipeThreads, gemm::kPipeSmem, "pipelined");
}

void gemm_case_study_run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t part, uintptr_t stage, int stage_slots, int ctas,
                         int m, int n, int k, int ldp, int k_splits, int variant, int prefetch, bool atomic, int cluster,
                         int out_dtype, int host_load, uintptr_t stream) {
  require(prefetch >= gemm::kPrefetchNone && prefetch <= gemm::kPrefetchLoad,
          "gemm_case_study: prefetch code " + std::to_string(prefetch) + " must be 0 (none), 1 (hint) or 2 (load)");
  GemmParams p{};
  p.a = reinterpret_cast<const __half*>(a);
  p.b = reinterpret_cast<const __half*>(b);
  p.c = reinterpret_cast<void*>(c);
  p.part = reinterpret_cast<float*>(part);
  p.stage = reinterpret_cast<unsigned char*>(stage);
  p.stage_slots = stage_slots;
  p.m = m;
  p.n = n;
  p.k = k;
  p.ldp = ldp;
  p.k_splits = k_splits;
  p.chunks = (k + gemm::kChunkK - 1) / gemm::kChunkK;
  p.prefetch = prefetch;
  p.atomic = atomic ? 1 : 0;
  launch(p, variant, out_dtype, host_load, cluster, ctas, reinterpret_cast<cudaStream_t>(stream));
}

// CTAs of the ring grid: the clusters resident at once; the ring's hand-offs between CTAs need every CTA resident.
int gemm_ring_ctas(int cluster) {
  return resident_ctas(ring_kernel<__half>(cluster), cluster, gemm::kRingThreads, gemm::kRingSmem, "ring");
}

// Variant ring (gemm_ring.cuh): `stage` holds stage_bytes of HBM ring, `sync` sync_words zeroed words; ctas must
// not exceed gemm_ring_ctas(cluster) (a CTA that waits for another's stager while that one is not resident would
// hang). Pairs (cluster 2) need an even number of strips in every band.
void gemm_ring_run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t stage, size_t stage_bytes, uintptr_t sync, size_t sync_words,
                   int ctas, int m, int n, int k, int band, int slots, int cluster, int out_dtype, uintptr_t stream) {
  require(m >= 1 && n >= 1 && k >= 1, "gemm_case_study: m, n, k must be >= 1");
  for (const auto& [ptr, name] : {std::pair{a, "a"}, std::pair{b, "b"}, std::pair{c, "c"}, std::pair{stage, "ring"}, std::pair{sync, "flags"}}) {
    require(ptr != 0, std::string("gemm_case_study: ring: null ") + name);
  }
  require(k % 8 == 0 && n % 8 == 0 && a % 16 == 0 && b % 16 == 0,
          "gemm_case_study: ring needs k and n multiples of 8 and 16-byte aligned A and B (TMA and 16-byte host loads); got k = " +
              std::to_string(k) + ", n = " + std::to_string(n) + ", A and B " + std::to_string(a % 16) + " and " + std::to_string(b % 16) +
              " bytes past a 16-byte boundary");
  // the unit's bulk copy needs 16-byte ring addresses, the counts 4-byte words, C's pair stores 2 elements' alignment
  const uintptr_t c_align = out_dtype == kFloat32 ? 8 : 4;
  require(stage % 16 == 0 && sync % 4 == 0 && c % c_align == 0,
          "gemm_case_study: ring needs a 16-byte aligned ring, 4-byte aligned flags and C aligned to " + std::to_string(c_align) +
              " bytes; got them " + std::to_string(stage % 16) + ", " + std::to_string(sync % 4) + " and " + std::to_string(c % c_align) +
              " bytes past");
  GemmParams p{};
  p.a = reinterpret_cast<const __half*>(a);
  p.b = reinterpret_cast<const __half*>(b);
  p.c = reinterpret_cast<void*>(c);
  p.stage = reinterpret_cast<unsigned char*>(stage);
  p.ring_sync = reinterpret_cast<unsigned*>(sync);
  p.m = m;
  p.n = n;
  p.k = k;
  p.ring_band = band;
  p.ring_slots = slots;
  const int64_t strips = (n + gemm::kBN - 1) / gemm::kBN;
  require(band >= 1 && band <= strips, "gemm_case_study: ring band " + std::to_string(band) + " must be in 1.." + std::to_string(strips) + " strips");
  require(cluster == 1 || (cluster == 2 && band % 2 == 0 && strips % 2 == 0),
          "gemm_case_study: ring cluster " + std::to_string(cluster) + " must be 1, or 2 with an even band and an even number of strips; got band " +
              std::to_string(band) + " of " + std::to_string(strips) + " strips");
  require(static_cast<int64_t>(strips) * ((k + gemm::kBK - 1) / gemm::kBK) * gemm::kRingSlices < (int64_t{1} << 30) &&
              static_cast<int64_t>(strips) * ((m + gemm::kRingBM - 1) / gemm::kRingBM) < (int64_t{1} << 31),
          "gemm_case_study: ring: matrix too large (m = " + std::to_string(m) + ", n = " + std::to_string(n) + ", k = " + std::to_string(k) + ")");
  const gemm::RingPlan plan(p);  // its int products stay in range: the check above
  require(slots >= 1 && slots <= plan.bands, "gemm_case_study: ring slots " + std::to_string(slots) + " must be in 1.." + std::to_string(plan.bands) + " bands");
  const size_t need = static_cast<size_t>(slots) * band * plan.ktiles * gemm::kRingUnitBytes;
  require(stage_bytes >= need, "gemm_case_study: ring buffer of " + std::to_string(stage_bytes) + " B, needs " + std::to_string(need));
  require(sync_words >= static_cast<size_t>(plan.unit_slots()) + plan.bands,
          "gemm_case_study: ring flags of " + std::to_string(sync_words) + " words, need " + std::to_string(plan.unit_slots() + plan.bands));
  const int resident = gemm_ring_ctas(cluster);
  require(ctas >= cluster && ctas % cluster == 0 && ctas <= plan.tiles() && ctas <= resident,
          "gemm_case_study: ring grid " + std::to_string(ctas) + " must be a multiple of the cluster size " + std::to_string(cluster) +
              " in 1..min(" + std::to_string(plan.tiles()) + " tiles, " + std::to_string(resident) + " resident CTAs)");
  p.a_map = a_tensor_map(p.a, m, k, gemm::kRingBM / cluster);  // pairs: each CTA fetches half the tile's rows
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_out(out_dtype, [&](auto o) {
    auto kernel = ring_kernel<decltype(o)>(cluster);
    allow_max_smem("gemm_case_study", kernel, gemm::kRingSmem);
    const ClusterLaunch launch(static_cast<unsigned>(ctas), cluster, s, gemm::kRingThreads, gemm::kRingSmem);
    check_cuda(cudaLaunchKernelEx(&launch.cfg, kernel, p), "gemm_case_study: ring kernel launch");
  });
}

// "host" when ptr is page-locked host memory (read across the link), "hbm" for device memory.
std::string gemm_pointer_tier(uintptr_t ptr) {
  cudaPointerAttributes attr{};
  check_cuda(cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr)), "cudaPointerGetAttributes");
  switch (attr.type) {
    case cudaMemoryTypeHost: return "host";
    case cudaMemoryTypeDevice: return "hbm";
    default: throw std::runtime_error("gemm_case_study: B is neither pinned host nor device memory (pageable or managed)");
  }
}

// One cudaMemcpy2DAsync on `stream` (one cudaMemcpyAsync when the rows leave no gaps): `height` rows of
// `width_bytes`, row r from src + r * src_pitch to dst + r * dst_pitch. cudaMemcpyDefault takes the direction
// from UVA: pinned host -> HBM runs on the copy engine (a zero-copy view's device address is the host address),
// HBM -> HBM is a device copy.
void gemm_copy_panel_async(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width_bytes,
                           size_t height, uintptr_t stream) {
  require(dst && src, "gemm_case_study: copy_panel_async: null dst or src");
  require(width_bytes <= dst_pitch && width_bytes <= src_pitch,
          "gemm_case_study: copy_panel_async: width " + std::to_string(width_bytes) + " B exceeds a pitch (dst " +
              std::to_string(dst_pitch) + " B, src " + std::to_string(src_pitch) + " B)");
  if (width_bytes == 0 || height == 0) return;
  if (height == 1 || (width_bytes == dst_pitch && width_bytes == src_pitch)) {
    // A contiguous block (a row panel, or a panel stored contiguously on the host): one 1-D copy, so the
    // rate cannot depend on how the driver treats a 2-D copy without gaps.
    check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), width_bytes * height,
                               cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)),
               "gemm_case_study: cudaMemcpyAsync");
    return;
  }
  check_cuda(cudaMemcpy2DAsync(reinterpret_cast<void*>(dst), dst_pitch, reinterpret_cast<const void*>(src), src_pitch,
                               width_bytes, height, cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)),
             "gemm_case_study: cudaMemcpy2DAsync");
}

// The same panel copy by SM loads (gemm::copy_panel_kernel) with `ctas` CTAs on `stream`: 16-byte loads when
// every address, pitch and width is a multiple of 16 bytes, else 2-byte ones (fp16 elements). src may be a
// pinned host pointer: its device address is taken from CUDA, so the kernel reads it zero-copy.
void gemm_copy_panel_sm_async(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width_bytes,
                              size_t height, int ctas, uintptr_t stream) {
  require(dst && src, "gemm_case_study: copy_panel_sm_async: null dst or src");
  require(width_bytes <= dst_pitch && width_bytes <= src_pitch,
          "gemm_case_study: copy_panel_sm_async: width " + std::to_string(width_bytes) + " B exceeds a pitch (dst " +
              std::to_string(dst_pitch) + " B, src " + std::to_string(src_pitch) + " B)");
  require(ctas >= 1, "gemm_case_study: copy_panel_sm_async: ctas " + std::to_string(ctas) + " must be >= 1");
  if (width_bytes == 0 || height == 0) return;
  cudaPointerAttributes attr{};
  check_cuda(cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(src)), "cudaPointerGetAttributes");
  require(attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeDevice,
          "gemm_case_study: copy_panel_sm_async: src is neither pinned host nor device memory");
  gemm::PanelCopyParams p{};
  p.src = static_cast<const char*>(attr.type == cudaMemoryTypeHost ? attr.devicePointer : reinterpret_cast<void*>(src));
  p.dst = reinterpret_cast<char*>(dst);
  p.src_pitch = static_cast<long long>(src_pitch);
  p.dst_pitch = static_cast<long long>(dst_pitch);
  p.height = static_cast<long long>(height);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const uintptr_t all = reinterpret_cast<uintptr_t>(p.src) | dst | src_pitch | dst_pitch | width_bytes;
  if (all % 16 == 0) {
    p.width = static_cast<long long>(width_bytes / 16);
    gemm::copy_panel_kernel<uint4><<<ctas, gemm::kCopyThreads, 0, s>>>(p);
  } else {
    require(all % 2 == 0, "gemm_case_study: copy_panel_sm_async: addresses, pitches and width must be even (fp16)");
    p.width = static_cast<long long>(width_bytes / 2);
    gemm::copy_panel_kernel<unsigned short><<<ctas, gemm::kCopyThreads, 0, s>>>(p);
  }
  check_cuda(cudaGetLastError(), "gemm_case_study: copy_panel_kernel launch");
}

}  // namespace directkv
