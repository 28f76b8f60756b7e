// pybind11 module _dkv_gemm_case_study: raw device pointers as ints, sizes, a dtype code, a stream handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace py = pybind11;

namespace directkv {
void gemm_case_study_run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t part, uintptr_t stage, int stage_slots, int ctas,
                         int m, int n, int k, int ldp, int k_splits, int variant, int prefetch, bool atomic, int cluster,
                         int out_dtype, int host_load, uintptr_t stream);
std::string gemm_pointer_tier(uintptr_t ptr);
int gemm_persistent_ctas(int cluster);
int gemm_ring_ctas(int cluster);
void gemm_ring_run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t stage, size_t stage_bytes, uintptr_t sync, size_t sync_words,
                   int ctas, int m, int n, int k, int band, int slots, int cluster, int out_dtype, uintptr_t stream);
void gemm_copy_panel_async(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width_bytes,
                           size_t height, uintptr_t stream);
void gemm_copy_panel_sm_async(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width_bytes,
                              size_t height, int ctas, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_gemm_case_study, m) {
  m.doc() = "GEMM case study with B in pinned host memory (see csrc/include/directkv/gemm_case_study.cuh, gemm_stationary.cuh, gemm_ring.cuh)";
  m.def("run", &directkv::gemm_case_study_run, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("part"), py::arg("stage"), py::arg("stage_slots"), py::arg("ctas"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("ldp"), py::arg("k_splits"), py::arg("variant"), py::arg("prefetch"), py::arg("atomic"),
        py::arg("cluster"), py::arg("out_dtype"), py::arg("host_load"), py::arg("stream"));
  m.def("persistent_ctas", &directkv::gemm_persistent_ctas, py::arg("cluster"),
        "CTAs of the persistent pipelined grid: the clusters resident at once, times the cluster size");
  m.def("ring_run", &directkv::gemm_ring_run, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("stage"), py::arg("stage_bytes"),
        py::arg("sync"), py::arg("sync_words"), py::arg("ctas"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("band"),
        py::arg("slots"), py::arg("cluster"), py::arg("out_dtype"), py::arg("stream"),
        "variant ring: B through an HBM ring of bands (stage_bytes), flags and counts in sync (zeroed)");
  m.def("ring_ctas", &directkv::gemm_ring_ctas, py::arg("cluster"), "CTAs of the ring grid: the clusters resident at once, times the cluster size");
  m.def("pointer_tier", &directkv::gemm_pointer_tier, py::arg("ptr"),
        "'host' for page-locked host memory, 'hbm' for device memory");
  m.def("copy_panel_async", &directkv::gemm_copy_panel_async, py::arg("dst"), py::arg("dst_pitch"), py::arg("src"),
        py::arg("src_pitch"), py::arg("width_bytes"), py::arg("height"), py::arg("stream"),
        "cudaMemcpy2DAsync (cudaMemcpyDefault: direction from UVA) of height rows of width_bytes on stream");
  m.def("copy_panel_sm_async", &directkv::gemm_copy_panel_sm_async, py::arg("dst"), py::arg("dst_pitch"),
        py::arg("src"), py::arg("src_pitch"), py::arg("width_bytes"), py::arg("height"), py::arg("ctas"),
        py::arg("stream"), "the same 2-D copy by SM loads (zero-copy reads of pinned src) with ctas CTAs on stream");
}
