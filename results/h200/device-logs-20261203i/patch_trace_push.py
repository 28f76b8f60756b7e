"""Patch a tree copy (the push-merge kernel, thirty-sixth session)'s decode kernel with per-CTA globaltimer stamps (diagnostic only, never committed)."""
import sys
root = sys.argv[1]
p = f'{root}/csrc/include/directkv/decode_attention.cuh'
s = open(p).read()
def rep(old, new):
    global s
    assert s.count(old) == 1, old
    s = s.replace(old, new)
rep("constexpr int kDecodeTableCap = 512;", """constexpr int kDecodeTableCap = 512;
constexpr int kTraceCtas = 32768, kTraceW = 10;
__device__ unsigned long long g_dkv_trace[kTraceCtas * kTraceW];
__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned smid_() { unsigned r; asm volatile("mov.u32 %0, %%smid;" : "=r"(r)); return r; }""")
rep("  const int group = p.split_major ? blockIdx.y : blockIdx.x;", """  const unsigned long long tr0 = gtime();
  unsigned long long tr1 = 0, tr2 = 0, tra = 0, trb = 0, tr3 = 0, c2 = 0, c3 = 0;
  const unsigned cta_lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  auto emit = [&](int last) {
    if (threadIdx.x == 0 && cta_lin < kTraceCtas) {
      unsigned long long* t = g_dkv_trace + cta_lin * kTraceW;
      t[0] = tr0; t[1] = tr1; t[2] = tr2; t[3] = tra; t[4] = trb; t[5] = tr3; t[6] = gtime();
      t[7] = (static_cast<unsigned long long>(smid_()) << 32) | (static_cast<unsigned long long>(last) << 24) | static_cast<unsigned>(blockIdx.z) << 12 | static_cast<unsigned>(blockIdx.x);
      t[8] = c2; t[9] = c3;
    }
  };
  const int group = p.split_major ? blockIdx.y : blockIdx.x;""")
rep("""    cp_async_commit();
    const int stage = it % STAGES;""", """    cp_async_commit();
    if (it == 0) tr1 = gtime();
    if (it == n - 1) { tr2 = gtime(); c2 = clock64(); }
    const int stage = it % STAGES;""")
rep("""  mma.reduce_l();
""", """  mma.reduce_l();
  tra = gtime();
""")
rep("""    cluster_merge<T, HD, HPC, TILE, STAGES>(p, push_o, push_ml, n_active, b, qh0);
    return;
  }

  cp_async_wait<0>();""", """    trb = tr3 = gtime(); c3 = clock64();
    cluster_merge<T, HD, HPC, TILE, STAGES>(p, push_o, push_ml, n_active, b, qh0);
    emit(3);
    return;
  }

  cp_async_wait<0>();""")
rep("  constexpr int kPer = (HPC * HD", "  trb = gtime();\n  constexpr int kPer = (HPC * HD")
rep("""  if (single) return;
""", """  tr3 = gtime(); c3 = clock64();
  if (single) { emit(2); return; }
""")
rep("""  if (!is_last) return;
  __threadfence();""", """  if (!is_last) { emit(0); return; }
  __threadfence();""")
end = "\n}\n\n}  // namespace directkv"
assert s.rstrip().endswith(end.strip()) or s.count(end) == 1
i = s.rfind(end)
s = s[:i] + "\n  __syncthreads();\n  emit(1);" + s[i:]
open(p, 'w').write(s)
p = f'{root}/csrc/ops/decode_attention.cu'
s = open(p).read().rstrip()
tail = "}  // namespace directkv"
assert s.endswith(tail)
s = "#include <vector>\n" + s[:-len(tail)] + """
std::vector<unsigned long long> decode_trace_dump(int n) {
  std::vector<unsigned long long> v(size_t(n) * kTraceW);
  check_cuda(cudaMemcpyFromSymbol(v.data(), g_dkv_trace, v.size() * 8), "trace dump");
  return v;
}
void decode_trace_clear() {
  void* ptr = nullptr;
  check_cuda(cudaGetSymbolAddress(&ptr, g_dkv_trace), "trace addr");
  check_cuda(cudaMemset(ptr, 0, sizeof(unsigned long long) * kTraceCtas * kTraceW), "trace clear");
}
}  // namespace directkv
"""
open(p, 'w').write(s)
p = f'{root}/csrc/bindings/decode_attention.cpp'
s = open(p).read()
s = s.replace("void copy_async(uintptr_t dst", "std::vector<unsigned long long> decode_trace_dump(int n);\nvoid decode_trace_clear();\nvoid copy_async(uintptr_t dst", 1)
s = s.replace('  m.def("copy_async"', '  m.def("trace_dump", &directkv::decode_trace_dump);\n  m.def("trace_clear", &directkv::decode_trace_clear);\n  m.def("copy_async"', 1)
open(p, 'w').write(s)
print("patched", root)
