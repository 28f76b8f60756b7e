// pybind11 module _dkv_proj_attention: raw device pointers as ints, sizes, a dtype code, a stream handle.
#include <pybind11/pybind11.h>

#include <cstdint>

namespace py = pybind11;

namespace directkv {
void proj_attention_run(uintptr_t q, uintptr_t x, uintptr_t wk, uintptr_t wv, uintptr_t rope_cos, uintptr_t rope_sin,
                        uintptr_t host_k, uintptr_t host_v, uintptr_t hbm_k, uintptr_t hbm_v, uintptr_t block_table,
                        uintptr_t out, uintptr_t part_o, uintptr_t part_ml, int q_len, int past_len, int hidden,
                        int num_heads, int num_kv_heads, int head_dim, int page_size, bool causal, int variant,
                        int kv_chunk, int num_splits, int threads, float sm_scale, int dtype, int host_load,
                        uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_proj_attention, m) {
  m.doc() = "K/V projection + zero-copy paged attention, separate or fused (see csrc/include/directkv/proj_attention.cuh)";
  m.def("run", &directkv::proj_attention_run, py::arg("q"), py::arg("x"), py::arg("wk"), py::arg("wv"),
        py::arg("rope_cos"), py::arg("rope_sin"), py::arg("host_k"), py::arg("host_v"), py::arg("hbm_k"),
        py::arg("hbm_v"), py::arg("block_table"), py::arg("out"), py::arg("part_o"), py::arg("part_ml"),
        py::arg("q_len"), py::arg("past_len"), py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("page_size"), py::arg("causal"), py::arg("variant"), py::arg("kv_chunk"),
        py::arg("num_splits"), py::arg("threads"), py::arg("sm_scale"), py::arg("dtype"), py::arg("host_load"),
        py::arg("stream"));
}
