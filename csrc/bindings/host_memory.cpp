// pybind11 module _dkv_host_memory: exact-size page-locked host allocations (see csrc/ops/host_memory.cu).
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

namespace py = pybind11;

namespace directkv {
uintptr_t host_alloc(size_t nbytes);
void host_free(uintptr_t ptr);
}  // namespace directkv

PYBIND11_MODULE(_dkv_host_memory, m) {
  m.doc() = "cudaHostAlloc / cudaFreeHost of exact sizes";
  m.def("host_alloc", &directkv::host_alloc, py::arg("nbytes"),
        "page-locked, device-mapped host memory of nbytes; returns its address (host and device)");
  m.def("host_free", &directkv::host_free, py::arg("ptr"), "free memory from host_alloc");
}
