// pybind11 module _dkv_probe: the streaming-read bandwidth probe.
#include <pybind11/pybind11.h>

#include <cstdint>

namespace py = pybind11;

namespace directkv {
int num_sms();
void stream_read(uintptr_t src, int64_t nbytes, uintptr_t sink, int blocks, int threads, uintptr_t stream);
}  // namespace directkv

PYBIND11_MODULE(_dkv_probe, m) {
  m.doc() = "Bandwidth probes (see csrc/include/directkv/probe.cuh)";
  m.def("num_sms", &directkv::num_sms, "multiprocessors of the current device");
  m.def("stream_read", &directkv::stream_read, py::arg("src"), py::arg("nbytes"), py::arg("sink"), py::arg("blocks"),
        py::arg("threads"), py::arg("stream"),
        "grid-stride 16-byte reads of nbytes at src, one float partial sum per thread into sink");
}
