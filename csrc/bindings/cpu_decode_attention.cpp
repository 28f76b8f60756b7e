// pybind11 module _dkv_cpu_decode_attention: raw host pointers as ints, sizes, the dtype flag.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace py = pybind11;

namespace directkv {
void cpu_decode_attention_run(uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, uintptr_t block_table,
                              uintptr_t seq_lens, uintptr_t out, int batch, int num_heads, int num_kv_heads,
                              int head_dim, int page_size, int table_width, int piece_pages, int num_threads,
                              float scale, int dtype);
std::string cpu_decode_attention_item(int dtype, int num_heads, int num_kv_heads, int head_dim);
}  // namespace directkv

PYBIND11_MODULE(_dkv_cpu_decode_attention, m) {
  m.doc() = "Decode attention on the CPU over paged host KV (see csrc/include/directkv/cpu_decode_attention.h)";
  // The GIL is released: cpu_attn runs this on a worker thread while the main thread launches GPU work.
  m.def("run", &directkv::cpu_decode_attention_run, py::call_guard<py::gil_scoped_release>(), py::arg("q"),
        py::arg("k_pool"), py::arg("v_pool"), py::arg("block_table"), py::arg("seq_lens"), py::arg("out"),
        py::arg("batch"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("page_size"),
        py::arg("table_width"), py::arg("piece_pages"), py::arg("num_threads"), py::arg("scale"), py::arg("dtype"));
  m.def("item", &directkv::cpu_decode_attention_item, py::arg("dtype"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), "which item a call runs: avx512bf16, avx512f (the specialised bf16 item) or generic");
}
