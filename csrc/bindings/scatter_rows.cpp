// pybind11 module _dkv_scatter_rows: raw device pointers as ints, sizes, a stream handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace directkv {
void scatter_rows_run(const std::vector<uintptr_t>& dst, const std::vector<uintptr_t>& src, uintptr_t dst_rows,
                      uintptr_t src_rows, int64_t n, int64_t dst_rows_total, int64_t src_rows_total,
                      int64_t row_bytes, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_scatter_rows, m) {
  m.doc() = "Row scatter of one or two tensor pairs in one launch (see csrc/include/directkv/scatter_rows.cuh)";
  m.def("run", &directkv::scatter_rows_run, py::arg("dst"), py::arg("src"), py::arg("dst_rows"), py::arg("src_rows"),
        py::arg("n"), py::arg("dst_rows_total"), py::arg("src_rows_total"), py::arg("row_bytes"), py::arg("stream"));
}
