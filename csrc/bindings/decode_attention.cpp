// pybind11 module _dkv_decode_attention: raw device pointers as ints, sizes, a dtype code, a stream handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "directkv/stream_queue.h"

namespace py = pybind11;

namespace directkv {
std::pair<int, int> decode_attention_occupancy(int dtype, int head_dim, int heads_per_cta, int tile);
void decode_attention_run(uintptr_t q, uintptr_t host_k, uintptr_t host_v, uintptr_t hbm_k, uintptr_t hbm_v,
                          uintptr_t block_table, uintptr_t seq_lens, uintptr_t out, uintptr_t out_f32,
                          uintptr_t lse_out, uintptr_t part_o, uintptr_t part_lse, uintptr_t counters, int batch,
                          int num_heads, int num_kv_heads, int head_dim, int max_pages, int page_size,
                          int num_splits, int tiles_per_split, int heads_per_cta, int tile, float sm_scale,
                          int dtype, int load_mode, int split_major, int cluster_merge, uintptr_t stream);
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
        py::arg("split_major"), py::arg("cluster_merge"), py::arg("stream"));
  m.def("copy_async", &directkv::copy_async, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"),
        "cudaMemcpyAsync with the direction inferred from UVA (pinned host -> HBM runs on the copy engine)");
  m.def("copy_runs_packed", &directkv::copy_runs_packed, py::arg("dst_bases"), py::arg("src_bases"), py::arg("runs"),
        py::arg("num_runs"), py::arg("unit_bytes"), py::arg("stream"),
        "copy_async of every (src unit, dst unit, units) run (num_runs x 3 int64 in host memory) for each (dst, src) "
        "base pair, issued from C++");
  py::class_<directkv::StreamQueue>(m, "StreamQueue",
                                    "The decode stream variant's copy queue over one plan's ring (directkv/stream_queue.h)")
      .def(py::init<uintptr_t, uintptr_t, int64_t, int64_t, std::vector<uintptr_t>, std::vector<int64_t>,
                    std::vector<uintptr_t>, std::vector<uintptr_t>, uintptr_t, std::vector<int64_t>,
                    std::vector<uintptr_t>, std::vector<uintptr_t>, int64_t, int64_t>(),
           py::arg("ring_k"), py::arg("ring_v"), py::arg("slot_bytes"), py::arg("page_bytes"), py::arg("runs"),
           py::arg("num_runs"), py::arg("filled"), py::arg("freed"), py::arg("side"), py::arg("last_n"),
           py::arg("last_rows"), py::arg("last_at"), py::arg("ring_rows"), py::arg("row_bytes"))
      .def("set_queue", &directkv::StreamQueue::set_queue, py::arg("host_k"), py::arg("host_v"))
      .def("fill", &directkv::StreamQueue::fill, py::arg("copied"), py::arg("consumed"), py::arg("upto"),
           py::arg("wait_readers"))
      // positional: a layer's call is on the serving hot path, and keyword matching costs host time per argument
      .def("run_layer",
           [](directkv::StreamQueue& self, uintptr_t main, int64_t first, int64_t copied, uintptr_t q,
              uintptr_t out, uintptr_t o_parts, uintptr_t lse_parts, uintptr_t passes, uintptr_t lens, int num_passes,
              bool hbm_pass, uintptr_t hbm_k, uintptr_t hbm_v, uintptr_t part_o, uintptr_t part_lse,
              uintptr_t counters, int batch, int num_heads, int num_kv_heads, int head_dim, int width,
              int page_size, int num_splits, int tiles_per_split, int heads_per_cta, int tile, int dtype,
              int load_mode, int split_major, float sm_scale, uintptr_t last_k, uintptr_t last_v,
              int64_t last_src_rows, int64_t lag_cycles, bool wait_readers) {
             const directkv::StreamLaunch a{q, out, o_parts, lse_parts, passes, lens, num_passes, hbm_pass, hbm_k,
                                            hbm_v, part_o, part_lse, counters, batch, num_heads, num_kv_heads,
                                            head_dim, width, page_size, num_splits, tiles_per_split,
                                            heads_per_cta, tile, dtype, load_mode, split_major, sm_scale};
             return self.run_layer(main, first, copied, a, last_k, last_v, last_src_rows, lag_cycles, wait_readers);
           },
           "One call's chunks, HBM pass and merge on stream `main`; returns (copied, consumed)");
}
