// pybind11 module _dkv_prefill_attention: raw device pointers as ints, sizes, a dtype code, a stream handle.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>

namespace py = pybind11;

namespace directkv {
std::pair<int, int> prefill_device_limits();
void prefill_attention_run(uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t host_k, uintptr_t host_v,
                           uintptr_t hbm_k, uintptr_t hbm_v, uintptr_t block_table, uintptr_t out, uintptr_t out_f32,
                           uintptr_t lse_out, uintptr_t part_o, uintptr_t part_ml, int q_len, int past_len,
                           int num_heads, int num_kv_heads, int head_dim, int page_size, bool causal, bool include_new,
                           int variant, int kv_chunk, int num_splits, int threads, int num_buffers, bool half_state,
                           float sm_scale, int dtype, int host_load, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_prefill_attention, m) {
  m.doc() = "Zero-copy paged prefill attention (see csrc/include/directkv/prefill_attention.cuh)";
  m.def("device_limits", &directkv::prefill_device_limits, "(number of SMs, opt-in shared memory bytes per block)");
  m.def("run", &directkv::prefill_attention_run, py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("host_k"),
        py::arg("host_v"), py::arg("hbm_k"), py::arg("hbm_v"), py::arg("block_table"), py::arg("out"),
        py::arg("out_f32"), py::arg("lse_out"), py::arg("part_o"), py::arg("part_ml"), py::arg("q_len"),
        py::arg("past_len"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("page_size"),
        py::arg("causal"), py::arg("include_new"), py::arg("variant"), py::arg("kv_chunk"), py::arg("num_splits"),
        py::arg("threads"), py::arg("num_buffers"), py::arg("half_state"), py::arg("sm_scale"), py::arg("dtype"), py::arg("host_load"),
        py::arg("stream"));
}
