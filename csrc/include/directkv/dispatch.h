// Named dispatch switches shared by the launchers (csrc/ops): a runtime value -> a compile-time type or
// constant, with an error naming the op, the bad value and the supported ones. No torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "directkv/common.cuh"

namespace directkv {

template <int V>
using Int = std::integral_constant<int, V>;

template <typename F>
void dispatch_dtype(const char* op, int code, F&& f) {
  switch (code) {
    case kFloat16: return f(__half());
    case kBFloat16: return f(__nv_bfloat16());
    default: throw std::runtime_error(std::string(op) + ": dtype code " + std::to_string(code) + " is not fp16 (0) or bf16 (1)");
  }
}

// An output dtype that may also be fp32 (the merge kernels write fp32 too).
template <typename F>
void dispatch_out_dtype(const char* op, int code, F&& f) {
  switch (code) {
    case kFloat16: return f(__half());
    case kBFloat16: return f(__nv_bfloat16());
    case kFloat32: return f(float());
    default:
      throw std::runtime_error(std::string(op) + ": dtype code " + std::to_string(code) +
                               " is not fp16 (0), bf16 (1) or fp32 (2)");
  }
}

template <typename F>
void dispatch_head_dim(const char* op, int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(Int<64>());
    case 128: return f(Int<128>());
    default: throw std::runtime_error(std::string(op) + ": head_dim " + std::to_string(head_dim) + " is not 64 or 128");
  }
}

template <bool V>
using Bool = std::integral_constant<bool, V>;

template <typename F>
void dispatch_bool(bool value, F&& f) {
  if (value) return f(Bool<true>());
  return f(Bool<false>());
}

// How a kernel's cp.async reads its host-resident operand (past K/V pages, GEMM B); codes shared with the
// Python wrappers' HOST_LOADS. f gets Bool<true> for the L1 (.ca) form.
enum HostLoad : int { kHostLoadCg = 0, kHostLoadCa = 1 };

template <typename F>
void dispatch_host_load(const char* op, int code, F&& f) {
  switch (code) {
    case kHostLoadCg: return f(Bool<false>());
    case kHostLoadCa: return f(Bool<true>());
    default: throw std::runtime_error(std::string(op) + ": host_load code " + std::to_string(code) + " is not cg (0) or ca (1)");
  }
}

}  // namespace directkv
