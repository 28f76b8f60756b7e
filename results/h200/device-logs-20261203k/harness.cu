// Session 38 device harness: correctness (vs an fp32 reference kernel, poisoned outputs) and flushed timing of
// the GEMM case study's launcher (csrc/ops/gemm_case_study.cu, compiled in). Build: nvcc ... harness.cu ops.cu
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <string>

namespace directkv {
void gemm_case_study_run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t part, int m, int n, int k, int ldp,
                         int k_splits, int variant, bool prefetch, int out_dtype, int host_load, uintptr_t stream);
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

__global__ void fill(__half* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    x[i] = __float2half_rn(((h & 0xffff) / 32768.f) - 1.f);
  }
}
__global__ void ref_gemm(const __half* a, const __half* b, float* c, int m, int n, int k) {
  int col = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y;
  if (col >= n) return;
  float s = 0.f;
  for (int kk = 0; kk < k; ++kk) s += __half2float(a[(size_t)row * k + kk]) * __half2float(b[(size_t)kk * n + col]);
  c[(size_t)row * n + col] = s;
}

static const char* VN[] = {"naive", "tiled", "pipelined", "raster"};
static int sms() { int d, v; cudaGetDevice(&d); cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, d); return v; }
static int plan(int m, int n, int k) {  // directkv/kernels/cuda/gemm_case_study.plan_k_splits
  long strips = (n + 127) / 128, chunks = (k + 511) / 512;
  long cap = std::max<long>(1, (3L << 30) / ((long)m * strips * 128 * 4));
  long want = (4L * sms() + strips - 1) / strips;
  return (int)std::max<long>(1, std::min(chunks, std::min(cap, want)));
}

struct Bufs {
  __half *a = nullptr, *b_dev = nullptr, *b_host = nullptr; float *c = nullptr, *part = nullptr, *ref = nullptr;
};

static Bufs make(int m, int n, int k, int splits, bool want_ref) {
  Bufs u;
  CK(cudaMalloc(&u.a, (size_t)m * k * 2)); CK(cudaMalloc(&u.b_dev, (size_t)k * n * 2));
  CK(cudaHostAlloc(&u.b_host, (size_t)k * n * 2, cudaHostAllocMapped));
  CK(cudaMalloc(&u.c, (size_t)m * n * 4));
  size_t ldp = ((n + 127) / 128) * 128;
  CK(cudaMalloc(&u.part, (size_t)splits * m * ldp * 4));
  fill<<<1024, 256>>>(u.a, (size_t)m * k, 17u); fill<<<1024, 256>>>(u.b_dev, (size_t)k * n, 91u);
  CK(cudaMemcpy(u.b_host, u.b_dev, (size_t)k * n * 2, cudaMemcpyDeviceToHost));
  if (want_ref) {
    CK(cudaMalloc(&u.ref, (size_t)m * n * 4));
    ref_gemm<<<dim3((n + 127) / 128, m), 128>>>(u.a, u.b_dev, u.ref, m, n, k);
  }
  CK(cudaDeviceSynchronize());
  return u;
}
static void release(Bufs& u) { cudaFree(u.a); cudaFree(u.b_dev); cudaFreeHost(u.b_host); cudaFree(u.c); cudaFree(u.part); if (u.ref) cudaFree(u.ref); }

static void run(Bufs& u, int m, int n, int k, int splits, int variant, bool host, int host_load, cudaStream_t s) {
  int ldp = ((n + 127) / 128) * 128;
  directkv::gemm_case_study_run((uintptr_t)u.a, (uintptr_t)(host ? u.b_host : u.b_dev), (uintptr_t)u.c, (uintptr_t)u.part,
                                m, n, k, ldp, splits, variant, true, 2, host_load, (uintptr_t)s);
}

static int check(int m, int n, int k, int splits, int variant, bool host, int host_load) {
  Bufs u = make(m, n, k, splits, true);
  size_t ldp = ((n + 127) / 128) * 128;
  CK(cudaMemset(u.c, 0xFF, (size_t)m * n * 4)); CK(cudaMemset(u.part, 0xFF, (size_t)splits * m * ldp * 4));
  run(u, m, n, k, splits, variant, host, host_load, 0);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("CHECK %s m=%d n=%d k=%d splits=%d host=%d: CUDA ERROR %s\n", VN[variant], m, n, k, splits, host, cudaGetErrorString(e)); exit(1); }
  std::vector<float> c((size_t)m * n), r((size_t)m * n);
  CK(cudaMemcpy(c.data(), u.c, c.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(r.data(), u.ref, r.size() * 4, cudaMemcpyDeviceToHost));
  double maxerr = 0; size_t bad = 0, first_bad = (size_t)-1;
  double tol = 2e-3 * std::sqrt((double)k) + 1e-3;
  for (size_t i = 0; i < c.size(); ++i) {
    double d = std::fabs((double)c[i] - r[i]);
    if (!(d <= tol)) { if (first_bad == (size_t)-1) first_bad = i; ++bad; }
    if (d > maxerr || std::isnan(d)) maxerr = std::isnan(d) ? INFINITY : d;
  }
  printf("CHECK %-9s m=%5d n=%5d k=%5d splits=%2d host=%d load=%d maxerr=%.3g bad=%zu %s", VN[variant], m, n, k, splits, host, host_load, maxerr, bad, bad ? "FAIL" : "ok");
  if (bad) printf(" first_bad=(%zu,%zu) got=%g want=%g", first_bad / n, first_bad % n, c[first_bad], r[first_bad]);
  printf("\n");
  release(u);
  return bad ? 1 : 0;
}

static void timeit(int m, int n, int k, std::vector<int> splits_list, std::vector<int> variants, int reps) {
  int maxs = *std::max_element(splits_list.begin(), splits_list.end());
  Bufs u = make(m, n, k, maxs, false);
  char* flush; size_t fl = 256u << 20; CK(cudaMalloc(&flush, fl));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int host = 1; host >= 0; --host)
    for (int v : variants)
      for (int sp : splits_list) {
        if (v == 0 && sp != splits_list[0]) continue;
        std::vector<float> t;
        for (int r = 0; r <= reps; ++r) {
          CK(cudaMemsetAsync(flush, r & 0xff, fl));
          cudaEventRecord(e0); run(u, m, n, k, sp, v, host, 1, 0); cudaEventRecord(e1);
          CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); if (r) t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        double ms = t[t.size() / 2];
        printf("TIME %-9s m=%5d n=%5d k=%5d splits=%2d B=%s median=%.3f ms min=%.3f  %.0f TFLOPS  B-link %.1f GB/s\n", VN[v], m, n, k, sp,
               host ? "host" : "hbm ", ms, t[0], 2.0 * m * n * k / ms / 1e9, host ? (double)k * n * 2 / ms / 1e6 : 0.0);
        fflush(stdout);
      }
  // the copy-engine floor of B, in this run
  void* bd; CK(cudaMalloc(&bd, (size_t)k * n * 2));
  std::vector<float> t;
  for (int r = 0; r <= reps; ++r) { cudaEventRecord(e0); CK(cudaMemcpyAsync(bd, u.b_host, (size_t)k * n * 2, cudaMemcpyHostToDevice)); cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); if (r) t.push_back(ms); }
  std::sort(t.begin(), t.end());
  printf("TIME memcpyH2D B %.3f ms = %.1f GB/s\n", t[t.size() / 2], (double)k * n * 2 / t[t.size() / 2] / 1e6);
  cudaFree(bd); cudaFree(flush); release(u);
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "all";
  int fails = 0;
  if (mode == "check" || mode == "all") {
    struct C { int m, n, k, s; } cs[] = {{256, 256, 512, 1}, {128, 128, 64, 1}, {999, 1001, 1003, 2}, {777, 520, 1300, 3},
                                         {2048, 2048, 4096, 3}, {2048, 2048, 4096, 8}, {130, 136, 520, 2}, {1000, 1000, 1000, 1}, {64, 8, 8, 1},
                                         {130, 136, 1600, 1}, {64, 256, 2048, 1}, {200, 264, 1544, 1}, {1, 8, 1024, 1}};
    for (auto c : cs)
      for (int v : {1, 2})
        for (int host : {1, 0}) fails += check(c.m, c.n, c.k, c.s, v, host, 1);
    fails += check(999, 1001, 1003, 1, 0, 1, 1);
    fails += check(2048, 2048, 4096, 3, 1, 1, 0);
    fails += check(2048, 2048, 4096, 3, 2, 1, 0);
    printf("CHECKS failed: %d\n", fails);
    if (fails) return 1;
  }
  if (mode == "one") {  // one call for a profiler: one V SPLITS HOST M N K
    int v = atoi(argv[2]), sp = atoi(argv[3]), host = atoi(argv[4]), m = atoi(argv[5]), n = atoi(argv[6]), k = atoi(argv[7]);
    Bufs u = make(m, n, k, sp, false);
    run(u, m, n, k, sp, v, host, 1, 0); CK(cudaDeviceSynchronize());
    printf("one done\n");
    return 0;
  }
  if (mode == "time" || mode == "all") {
    timeit(4096, 4096, 4096, {plan(4096, 4096, 4096), 4}, {1, 2}, 5);
    timeit(10240, 10240, 10240, {plan(10240, 10240, 10240), 10, 20}, {1, 2}, 3);
  }
  return 0;
}
