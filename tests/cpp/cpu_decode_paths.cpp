// Checks csrc/include/directkv/cpu_decode_attention.h against a float64 reference for bf16 caches, built by
// tests/test_cpu_decode_paths.py with different -m flags so that each item the header can compile (AVX512-BF16,
// AVX-512 without BF16, generic) runs on one machine. Prints, per case: its name, whether the header has a
// specialised item for it, the item the call reports it ran, and the relative error.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "directkv/cpu_decode_attention.h"

using namespace directkv;

struct Case {
  int num_heads, num_kv_heads, head_dim, page_size;
  std::vector<int> lens;
  float scale;  // 0: 1 / sqrt(head_dim)
};

int main() {
  // every specialised (GQA, head_dim) pair, odd lengths, pages of 7, 16 and 32 tokens, then two without one
  const Case cases[] = {
      {4, 4, 64, 16, {1, 100}, 0},             // GQA 1
      {8, 8, 128, 7, {90, 17}, 0},             // GQA 1, pages of 7 tokens
      {8, 4, 64, 7, {33, 250}, 0},             // GQA 2
      {4, 2, 128, 32, {70, 301}, 0},           // GQA 2, pages of 32 tokens
      {32, 8, 128, 16, {300, 65, 129, 7}, 0},  // Llama-3.1-8B heads (GQA 4)
      {8, 2, 64, 16, {500, 3}, 3.f},           // GQA 4, large scores: weights far below the running max
      {8, 1, 128, 32, {1000, 45}, 0},          // GQA 8
      {16, 2, 64, 16, {211}, 0},               // GQA 8, head_dim 64
      {16, 1, 128, 16, {77}, 0},               // GQA 16: the generic item
      {8, 2, 48, 16, {100, 7}, 0},             // head_dim 48: the generic item
  };
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto to_bf16 = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return uint16_t(u >> 16); };
  auto to_f = [](uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; };
  for (const Case& c : cases) {
    const int B = int(c.lens.size()), Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, ps = c.page_size;
    std::vector<int> pages(B);
    int total = 0, width = 0;
    for (int b = 0; b < B; ++b) pages[b] = (c.lens[b] + ps - 1) / ps, total += pages[b], width = std::max(width, pages[b]);
    const size_t page_el = size_t(ps) * Hkv * D;
    std::vector<uint16_t> k(page_el * (total + 2)), v(k.size()), q(static_cast<size_t>(B) * Hq * D);
    for (auto& x : k) x = to_bf16(normal(rng));
    for (auto& x : v) x = to_bf16(normal(rng));
    for (auto& x : q) x = to_bf16(normal(rng));
    std::vector<int32_t> perm(total + 2), table(static_cast<size_t>(B) * width, 0), lens(c.lens.begin(), c.lens.end());
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int b = 0, at = 0; b < B; ++b)
      for (int j = 0; j < pages[b]; ++j) table[size_t(b) * width + j] = perm[at++];
    const int piece = 3;  // several pieces per sequence: the merge runs too
    std::vector<int32_t> start(B + 1, 0);
    for (int b = 0; b < B; ++b) start[b + 1] = start[b] + (pages[b] + piece - 1) / piece;
    std::vector<float> out(static_cast<size_t>(B) * Hq * D, NAN), part(static_cast<size_t>(start[B]) * Hq * (D + 2));
    const float scale = c.scale > 0 ? c.scale : 1.f / std::sqrt(float(D));
    CpuDecodeParams p{q.data(), k.data(), v.data(), table.data(), lens.data(), start.data(), out.data(),
                      part.data(), B, Hq, Hkv, D, ps, width, piece, 2, scale, CPU_BF16};
    const char* ran = cpu_decode_attention(p);
    const int group = Hq / Hkv;
    const bool specialised = (group == 1 || group == 2 || group == 4 || group == 8) && (D == 64 || D == 128);
    double num = 0, den = 0;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hq; ++h) {
        const int g = h / (Hq / Hkv), n = c.lens[b];
        std::vector<double> sc(n), o(D, 0.0);
        double m = -INFINITY, l = 0;
        for (int t = 0; t < n; ++t) {
          const size_t row = (size_t(table[size_t(b) * width + t / ps]) * ps + t % ps) * Hkv * D + size_t(g) * D;
          double d = 0;
          for (int i = 0; i < D; ++i) d += double(to_f(q[(size_t(b) * Hq + h) * D + i])) * to_f(k[row + i]);
          sc[t] = d * scale, m = std::max(m, sc[t]);
        }
        for (int t = 0; t < n; ++t) {
          const size_t row = (size_t(table[size_t(b) * width + t / ps]) * ps + t % ps) * Hkv * D + size_t(g) * D;
          const double w = std::exp(sc[t] - m);
          l += w;
          for (int i = 0; i < D; ++i) o[i] += w * to_f(v[row + i]);
        }
        for (int i = 0; i < D; ++i) {
          const double ref = o[i] / l, got = out[(size_t(b) * Hq + h) * D + i];
          num += (got - ref) * (got - ref), den += ref * ref;
          if (std::isnan(got)) num = INFINITY;
        }
      }
    std::printf("%dx%d-d%d-p%d-s%g %s %s %.3e\n", Hq, Hkv, D, ps, c.scale, specialised ? "specialised" : "generic",
                ran, std::sqrt(num / den));
  }
  return 0;
}
