// pybind11 module _dkv_merge_stacked: raw device pointers as ints, sizes, a dtype code, a stream handle.
#include <pybind11/pybind11.h>

#include <cstdint>

namespace py = pybind11;

namespace directkv {
void merge_stacked_run(uintptr_t o, uintptr_t lse, uintptr_t out, int64_t rows, int64_t out_row_stride,
                       int num_parts, int head_dim, int dtype, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_merge_stacked, m) {
  m.doc() = "Merge of stacked attention passes by their LSE (see csrc/include/directkv/merge_stacked.cuh)";
  m.def("run", &directkv::merge_stacked_run, py::arg("o"), py::arg("lse"), py::arg("out"), py::arg("rows"),
        py::arg("out_row_stride"), py::arg("num_parts"), py::arg("head_dim"), py::arg("dtype"), py::arg("stream"));
}
