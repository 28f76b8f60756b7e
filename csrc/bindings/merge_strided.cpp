// pybind11 module _dkv_merge_strided: per-part lists of raw device pointers (ints), strides and dtype codes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace directkv {
void merge_strided_run(const std::vector<uintptr_t>& o, const std::vector<uintptr_t>& lse,
                       const std::vector<int64_t>& o_strides, const std::vector<int64_t>& lse_strides,
                       const std::vector<int>& dtypes, uintptr_t out, int64_t a, int64_t b, int64_t c, int head_dim,
                       int dtype, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_merge_strided, m) {
  m.doc() = "Merge of attention passes in any layout by their LSE (see csrc/include/directkv/merge_strided.cuh)";
  m.def("run", &directkv::merge_strided_run, py::arg("o"), py::arg("lse"), py::arg("o_strides"),
        py::arg("lse_strides"), py::arg("dtypes"), py::arg("out"), py::arg("a"), py::arg("b"), py::arg("c"),
        py::arg("head_dim"), py::arg("dtype"), py::arg("stream"));
}
