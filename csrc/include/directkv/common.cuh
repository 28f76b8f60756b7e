// Device helpers shared by the directkv kernels: dtype codes, 16-byte vector conversions, cp.async,
// warp reductions. No torch headers (see directkv/kernels/cuda/build.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace directkv {

// Dtype codes shared with the Python wrappers (directkv/kernels/cuda/*.py, DTYPE_CODES).
enum DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

inline void require(bool cond, const std::string& msg) {
  if (!cond) throw std::runtime_error(msg);
}

// An attribute (SM count, opt-in shared memory, ...) of the current device: what launch plans size against.
inline int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&value, attr, device), "cudaDeviceGetAttribute");
  return value;
}

// Lets `kernel` use up to the device's opt-in shared memory (above 48 KB a kernel must ask); `smem` is what
// this launch needs, checked against that limit with an error naming `op`.
template <typename K>
void allow_max_smem(const std::string& op, K kernel, size_t smem) {
  const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  require(smem <= static_cast<size_t>(limit),
          op + ": needs " + std::to_string(smem) + " B of shared memory; the device allows " + std::to_string(limit));
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit),
             (op + ": cudaFuncSetAttribute").c_str());
}

inline bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

inline int log2_int(int64_t x) {
  int l = 0;
  while ((int64_t{1} << l) < x) ++l;
  return l;
}

// 8 consecutive half-precision values (one 16-byte vector) widened to fp32.
__device__ __forceinline__ void to_float8(const uint4& v, __nv_bfloat16, float (&f)[8]) {
  // bf16 -> fp32 is a 16-bit left shift; doing it on the raw words avoids eight conversions.
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void to_float8(const uint4& v, __half, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ float from_float(float x, float) { return x; }
__device__ __forceinline__ __half from_float(float x, __half) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 from_float(float x, __nv_bfloat16) { return __float2bfloat16_rn(x); }

// 16-byte asynchronous global->shared copy. The source may be pinned host memory reached through UVA: the
// load crosses the link, nothing is staged. MODE 0: .cg (L2 only); 1: .ca (through L1); 2: .cg with the
// L2::128B prefetch hint; 3: .cg with L2::256B. Which one streams host memory fastest is measured
// (bench_decode.tune_decode), not assumed.
template <int MODE>
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  if constexpr (MODE == 1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  } else if constexpr (MODE == 2) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  } else if constexpr (MODE == 3) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Sum over aligned groups of WIDTH lanes (WIDTH a power of two <= 32); every lane gets its group's sum.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Weight 2^(m_old - m_new) of a softmax state whose running max moves from m_old to m_new; a state that
// has seen no token (m_old = -inf) weighs 0 even when m_new is -inf too (where the plain formula gives NaN).
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
}

}  // namespace directkv
