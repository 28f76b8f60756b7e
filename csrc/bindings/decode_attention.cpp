// pybind11 module _dkv_decode_attention: raw device pointers as ints, sizes, a dtype code, a stream handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace directkv {
std::pair<int, int> decode_attention_occupancy(int dtype, int head_dim, int heads_per_cta, int tile);
void decode_attention_run(uintptr_t q, uintptr_t host_k, uintptr_t host_v, uintptr_t hbm_k, uintptr_t hbm_v,
                          uintptr_t block_table, uintptr_t seq_lens, uintptr_t out, uintptr_t out_f32,
                          uintptr_t lse_out, uintptr_t part_o, uintptr_t part_lse, uintptr_t counters, int batch,
                          int num_heads, int num_kv_heads, int head_dim, int max_pages, int page_size,
                          int num_splits, int tiles_per_split, int heads_per_cta, int tile, float sm_scale,
                          int dtype, int load_mode, int split_major, uintptr_t stream);
void copy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream);
void copy_runs_packed(const std::vector<uintptr_t>& dst_bases, const std::vector<uintptr_t>& src_bases,
                      uintptr_t runs, int64_t num_runs, size_t unit_bytes, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_decode_attention, m) {
  m.doc() = "Zero-copy paged decode attention (see csrc/include/directkv/decode_attention.cuh)";
  m.def("occupancy", &directkv::decode_attention_occupancy, py::arg("dtype"), py::arg("head_dim"),
        py::arg("heads_per_cta"), py::arg("tile"), "(number of SMs, resident CTAs per SM) of the kernel");
  m.def("run", &directkv::decode_attention_run, py::arg("q"), py::arg("host_k"), py::arg("host_v"),
        py::arg("hbm_k"), py::arg("hbm_v"), py::arg("block_table"), py::arg("seq_lens"), py::arg("out"),
        py::arg("out_f32"), py::arg("lse_out"), py::arg("part_o"), py::arg("part_lse"), py::arg("counters"),
        py::arg("batch"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("max_pages"), py::arg("page_size"), py::arg("num_splits"), py::arg("tiles_per_split"),
        py::arg("heads_per_cta"), py::arg("tile"), py::arg("sm_scale"), py::arg("dtype"), py::arg("load_mode"),
        py::arg("split_major"), py::arg("stream"));
  m.def("copy_async", &directkv::copy_async, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"),
        "cudaMemcpyAsync with the direction inferred from UVA (pinned host -> HBM runs on the copy engine)");
  m.def("copy_runs_packed", &directkv::copy_runs_packed, py::arg("dst_bases"), py::arg("src_bases"), py::arg("runs"),
        py::arg("num_runs"), py::arg("unit_bytes"), py::arg("stream"),
        "copy_async of every (src unit, dst unit, units) run (num_runs x 3 int64 in host memory) for each (dst, src) "
        "base pair, issued from C++");
}
