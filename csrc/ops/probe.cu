// Launcher of the streaming-read probe.
#include "directkv/probe.cuh"

namespace directkv {

int num_sms() { return device_attribute(cudaDevAttrMultiProcessorCount); }

void stream_read(uintptr_t src, int64_t nbytes, uintptr_t sink, int blocks, int threads, uintptr_t stream) {
  require(src % 16 == 0, "probe: source must be 16-byte aligned");
  require(nbytes >= 16 && nbytes % 16 == 0, "probe: nbytes " + std::to_string(nbytes) + " must be a positive multiple of 16");
  require(blocks >= 1 && threads >= 32 && threads <= 1024 && threads % 32 == 0,
          "probe: blocks must be >= 1 and threads a multiple of 32 in 32..1024");
  StreamReadParams p{reinterpret_cast<const float4*>(src), nbytes / 16, reinterpret_cast<float*>(sink)};
  stream_read_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "probe: stream_read launch");
}

}  // namespace directkv
