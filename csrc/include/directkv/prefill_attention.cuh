// Zero-copy prefill (chunked-prefill) attention of one sequence over a paged two-tier KV cache.
//
// Queries: q_len new tokens, query i at absolute position past_len + i. Keys: the past_len cached tokens
// (block-table pages: e >= 0 host page e read through UVA across the link, e < 0 HBM page -(e + 1)) followed
// by the q_len new tokens (k_new / v_new in HBM). Causal: query i sees every past token and new tokens <= i.
//
// The query rows of one KV head are packed GQA-style, row r = qi * G + hl (G = num_heads / num_kv_heads), so
// every K/V tile in shared memory serves all G query heads that read it. A warp owns 16 rows (one mma M block);
// S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32 accumulators and an online softmax in registers.
//
// naive : FlashAttention order. A CTA owns 64 rows (4 warps) and streams every K/V tile it can see through a
//         two-stage cp.async ring: the past K/V cross the link once per CTA, i.e. once per 64 / G tokens.
// tiled : CPU-memory-aware order. A CTA owns a contiguous run of K/V chunks (kv_chunk keys each) of one KV
//         head; a chunk is loaded into shared memory once and stays there while the warps sweep ALL query rows
//         over it. Between chunks a row's softmax state (unnormalised O, running max m, running sum l) lives
//         in an HBM buffer of the CTA's own (split) so no two CTAs write the same bytes; prefill_merge_kernel
//         combines the splits. Past K/V cross the link exactly once. With two chunk buffers the next chunk
//         is copied into the idle buffer while the warps compute on the current one, so the link transfer
//         hides behind the tensor-core work (at the price of chunks half as long: twice the partial traffic).
//
// include_new = 0 drops the new tokens from the keys: a pass of the stream variant (prefill_attention.py)
// attends the queries to one chunk of the past only and writes fp32 O and its LSE (out_f32 / lse_out), so
// the passes can be merged afterwards; the new tokens get a pass of their own.
//
// half_state (tiled): the partial O that goes to HBM between chunks is stored normalised (O / l, a convex
// combination of V rows, so within T's range) in T instead of fp32, halving the bytes of the partial-state
// round trips, which serialise with the math (results/h200/README.md); l stays fp32 beside the max.
//
// kL1 (both variants) copies the past K/V pages with cp.async.ca (through L1) instead of .cg (L2 only). No CTA
// writes a past page slot (proj_attention's fused kernel writes only the new tokens' slots, which it never
// loads: load_end = past_len), so a non-coherent L1 cannot serve stale bytes; k_new / v_new, new tokens read
// from their pages and the partial O / m / l the tiled kernel writes and re-reads stay on the L2-only path.
#pragma once

#include "directkv/prefill_common.cuh"

namespace directkv::prefill {

constexpr int kTileKV = 64;       // keys per mma sweep (one shared-memory tile)
constexpr int kWarpRows = 16;     // query rows per warp
constexpr int kNaiveWarps = 4;    // naive CTA: 64 rows
constexpr int kTiledMaxThreads = 256;

template <int D>
constexpr int kStride = D + 8;  // shared-memory row stride: +16 B shifts rows across banks for ldmatrix

struct PrefillParams {
  const void* q;            // [q_len, num_heads, head_dim]
  const void* k_new;        // [q_len, num_kv_heads, head_dim]
  const void* v_new;        // [q_len, num_kv_heads, head_dim]
  const void* host_k;       // [num_host_pages, page_size, num_kv_heads, head_dim] pinned host (UVA)
  const void* host_v;
  const void* hbm_k;        // [num_hbm_pages, page_size, num_kv_heads, head_dim]
  const void* hbm_v;
  const int* block_table;   // [>= ceil(past_len / page_size)] entries of the sequence (new_in_pages: of all keys)
  void* out;                // [q_len, num_heads, head_dim]; unused when out_f32 is set
  float* out_f32;           // tiled, optional: [q_len, num_heads, head_dim] normalised O kept in fp32 ...
  float* lse_out;           // ... and [q_len, num_heads] its natural-log LSE, so passes can be merged later
  float* part_o;            // tiled: [num_splits, q_len, num_heads, head_dim] unnormalised partial O (fp32), or
                            // with half_state O / l in T: half the bytes per round trip through HBM
  float* part_ml;           // tiled: [num_splits, q_len, num_heads, 2] (max in log2 units, sum)
  int q_len, past_len, num_heads, num_kv_heads, page_size;
  int causal;
  int include_new;          // 1: keys are past + the q_len new tokens; 0: the past only (tiled only)
  int new_in_pages;         // 1: the new tokens' K/V are in their cache pages (block-table entries from past_len
                            // on; proj_attention's kernels) instead of k_new / v_new
  int kv_chunk;             // tiled: keys per stationary chunk, a multiple of kTileKV
  int num_chunks;           // tiled: ceil(num_keys / kv_chunk)
  int num_splits;           // tiled: CTAs per KV head (<= num_chunks)
  int num_buffers;          // tiled: 1 (load, then compute) or 2 (load chunk c + 1 while computing chunk c)
  int half_state;           // tiled: 1 keeps part_o normalised (O / l) in T, 0 unnormalised in fp32
  float scale_log2;         // sm_scale * log2(e): scores are kept in log2 units so exp2f does the softmax
};

__host__ __device__ __forceinline__ int num_keys(const PrefillParams& p) {
  return p.past_len + (p.include_new ? p.q_len : 0);
}

// Keys [0, causal_limit) are visible to query qi. Without the new tokens every query sees the whole past.
__device__ __forceinline__ int causal_limit(const PrefillParams& p, int qi, int keys) {
  return p.causal ? min(p.past_len + qi + 1, keys) : keys;
}

// The two rows (g and g + 8) a thread holds of a warp's 16-row block, and the block's key visibility.
struct Rows {
  int qi[2], head[2];
  bool valid[2];
  int lim[2];             // keys [0, lim) are visible to the row
  int lim_min, lim_max;   // over the block's rows (warp uniform)
};

__device__ __forceinline__ Rows rows_of(const PrefillParams& p, int kvh, int r0, int lane) {
  const int group = p.num_heads / p.num_kv_heads, rows = p.q_len * group, keys = num_keys(p);
  Rows w;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + (lane >> 2) + 8 * i;
    w.valid[i] = r < rows;
    const int rr = w.valid[i] ? r : r0;  // padding rows alias the first row: computed, never stored
    w.qi[i] = rr / group;
    w.head[i] = kvh * group + rr % group;
    w.lim[i] = causal_limit(p, w.qi[i], keys);
  }
  const int q_first = r0 / group, q_last = (min(r0 + kWarpRows, rows) - 1) / group;
  w.lim_min = causal_limit(p, q_first, keys);
  w.lim_max = causal_limit(p, q_last, keys);
  return w;
}

template <int D>
struct State {
  float o[D / 8][4];  // unnormalised O in C-fragment layout
  float m[2];         // running max of rows g, g + 8 (-inf before any visible key)
  float l[2];         // this thread's share of the running sum; the quad's four shares add up to it

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
};

template <typename T, int D>
__device__ __forceinline__ void load_q(uint32_t (&qf)[D / 16][4], const PrefillParams& p, const Rows& w, int lane) {
  const T* q = static_cast<const T*>(p.q);
  const T* r0 = q + (static_cast<size_t>(w.qi[0]) * p.num_heads + w.head[0]) * D + 2 * (lane & 3);
  const T* r1 = q + (static_cast<size_t>(w.qi[1]) * p.num_heads + w.head[1]) * D + 2 * (lane & 3);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qf[kk][0] = tc::ld_u32(r0 + kk * 16);
    qf[kk][1] = tc::ld_u32(r1 + kk * 16);
    qf[kk][2] = tc::ld_u32(r0 + kk * 16 + 8);
    qf[kk][3] = tc::ld_u32(r1 + kk * 16 + 8);
  }
}

// One 64-key tile (ks, vs: [kTileKV][D + 8] in shared memory, first key key0) folded into the state.
template <typename T, int D>
__device__ __forceinline__ void attend_tile(State<D>& s, const uint32_t (&qf)[D / 16][4], const T* ks, const T* vs,
                                            int key0, const Rows& w, float scale_log2, int lane) {
  constexpr int S = kStride<D>;
  float sc[8][4];
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {  // 16 keys: two n-blocks from one ldmatrix.x4
      uint32_t b[4];
      tc::ldsm_x4(b, ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * S + kk * 16 + ((lane >> 3) & 1) * 8);
      tc::mma16816<T>(sc[2 * np], qf[kk], b[0], b[1]);
      tc::mma16816<T>(sc[2 * np + 1], qf[kk], b[2], b[3]);
    }
  }
  const bool mask = key0 + kTileKV > w.lim_min;  // warp uniform: only diagonal / last tiles pay for it
  float mx[2] = {s.m[0], s.m[1]};
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = sc[nb][e] * scale_log2;
      if (mask && key0 + nb * 8 + 2 * (lane & 3) + (e & 1) >= w.lim[e >> 1]) v = -INFINITY;
      sc[nb][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  }
  float ref[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    ref[i] = mx[i] == -INFINITY ? 0.f : mx[i];  // a row that has seen nothing keeps p = 0, not NaN
    const float alpha = rescale(s.m[i], ref[i]);
    s.m[i] = mx[i];
    s.l[i] *= alpha;
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      s.o[nb][2 * i] *= alpha;
      s.o[nb][2 * i + 1] *= alpha;
    }
  }
  uint32_t pa[4][4];  // P as the A operand of P V: k-step j covers keys 16j..16j+15 = n-blocks 2j, 2j+1
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
    const float p0 = exp2f(sc[nb][0] - ref[0]), p1 = exp2f(sc[nb][1] - ref[0]);
    const float p2 = exp2f(sc[nb][2] - ref[1]), p3 = exp2f(sc[nb][3] - ref[1]);
    s.l[0] += p0 + p1;
    s.l[1] += p2 + p3;
    pa[nb >> 1][(nb & 1) * 2] = tc::pack2<T>(p0, p1);
    pa[nb >> 1][(nb & 1) * 2 + 1] = tc::pack2<T>(p2, p3);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {  // 16 output columns: two n-blocks from one transposed ldmatrix.x4
      uint32_t b[4];
      tc::ldsm_x4_trans(b, vs + (j * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * S + dp * 16 + ((lane >> 4) << 3));
      tc::mma16816<T>(s.o[2 * dp], pa[j], b[0], b[1]);
      tc::mma16816<T>(s.o[2 * dp + 1], pa[j], b[2], b[3]);
    }
  }
}

// Normalised O of the warp's valid rows into out [q_len, num_heads, head_dim].
template <typename T, int D>
__device__ __forceinline__ void store_out(const State<D>& s, const PrefillParams& p, const Rows& w, int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float inv = 1.f / group_sum<4>(s.l[i]);  // every row sees at least its own token: l > 0
    if (!w.valid[i]) continue;
    T* o = static_cast<T*>(p.out) + (static_cast<size_t>(w.qi[i]) * p.num_heads + w.head[i]) * D + 2 * (lane & 3);
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      *reinterpret_cast<uint32_t*>(o + nb * 8) = tc::pack2<T>(s.o[nb][2 * i] * inv, s.o[nb][2 * i + 1] * inv);
    }
  }
}

__device__ __forceinline__ size_t part_row(const PrefillParams& p, int split, int qi, int head) {
  return (static_cast<size_t>(split) * p.q_len + qi) * p.num_heads + head;
}

template <typename T, int D>
__device__ __forceinline__ void load_partial(State<D>& s, const PrefillParams& p, int split, const Rows& w, int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const size_t row = part_row(p, split, w.qi[i], w.head[i]);
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml) + row);
    s.m[i] = ml.x;
    s.l[i] = (lane & 3) == 0 ? ml.y : 0.f;  // the quad's shares must add up to the stored sum
    if (p.half_state) {  // stored O / l: scale back by l
      const uint32_t* o = reinterpret_cast<const uint32_t*>(reinterpret_cast<const T*>(p.part_o) + row * D + 2 * (lane & 3));
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) {
        const float2 v = tc::unpack2<T>(__ldcg(o + nb * 4));
        s.o[nb][2 * i] = v.x * ml.y;
        s.o[nb][2 * i + 1] = v.y * ml.y;
      }
      continue;
    }
    const float* o = p.part_o + row * D + 2 * (lane & 3);
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(o + nb * 8));
      s.o[nb][2 * i] = v.x;
      s.o[nb][2 * i + 1] = v.y;
    }
  }
}

template <typename T, int D>
__device__ __forceinline__ void store_partial(const State<D>& s, const PrefillParams& p, int split, const Rows& w,
                                              int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float l = group_sum<4>(s.l[i]);
    if (!w.valid[i]) continue;
    const size_t row = part_row(p, split, w.qi[i], w.head[i]);
    if (p.half_state) {  // O / l; a row that has seen nothing (l = 0) stores zeros
      const float inv = l > 0.f ? 1.f / l : 0.f;
      uint32_t* o = reinterpret_cast<uint32_t*>(reinterpret_cast<T*>(p.part_o) + row * D + 2 * (lane & 3));
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) __stcg(o + nb * 4, tc::pack2<T>(s.o[nb][2 * i] * inv, s.o[nb][2 * i + 1] * inv));
    } else {
      float* o = p.part_o + row * D + 2 * (lane & 3);
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) {
        __stcg(reinterpret_cast<float2*>(o + nb * 8), make_float2(s.o[nb][2 * i], s.o[nb][2 * i + 1]));
      }
    }
    if ((lane & 3) == 0) __stcg(reinterpret_cast<float2*>(p.part_ml) + row, make_float2(s.m[i], l));
  }
}

// K and V rows of key j (j < num_keys(p)) of KV head kvh.
template <typename T, int D>
__device__ __forceinline__ void kv_rows(const PrefillParams& p, int j, int kvh, const T*& k, const T*& v) {
  size_t idx;
  if (j < p.past_len || p.new_in_pages) {
    const int page = j / p.page_size, e = __ldg(p.block_table + page);
    const bool host = e >= 0;
    idx = ((static_cast<size_t>(host ? e : -(e + 1)) * p.page_size + (j - page * p.page_size)) * p.num_kv_heads + kvh) * D;
    k = static_cast<const T*>(host ? p.host_k : p.hbm_k) + idx;
    v = static_cast<const T*>(host ? p.host_v : p.hbm_v) + idx;
  } else {
    idx = (static_cast<size_t>(j - p.past_len) * p.num_kv_heads + kvh) * D;
    k = static_cast<const T*>(p.k_new) + idx;
    v = static_cast<const T*>(p.v_new) + idx;
  }
}

// Issues cp.async copies of keys [key0, key0 + rows) into ks / vs ([rows][D + 8]); keys past the end are zeros.
// Keys in [load_end, num_keys) are left alone: a fill (proj_attention's projection) writes those rows.
// kL1: past keys (the paged, host-resident part) through L1, see the header.
template <typename T, int D, bool kL1>
__device__ __forceinline__ void load_kv(T* ks, T* vs, const PrefillParams& p, int kvh, int key0, int rows, int tid,
                                        int nthreads, int load_end) {
  constexpr int kPieces = D / 8;  // 16-byte pieces per row; consecutive threads take consecutive pieces
  const int keys = num_keys(p);
  for (int u = tid; u < rows * kPieces; u += nthreads) {
    const int r = u / kPieces, c = (u % kPieces) * 8, j = key0 + r;
    if (j >= load_end && j < keys) continue;
    const bool valid = j < keys;
    const T* k = static_cast<const T*>(p.q);  // any mapped address: a zero-fill copy reads nothing
    const T* v = k;
    if (valid) {
      kv_rows<T, D>(p, j, kvh, k, v);
      k += c;
      v += c;
    }
    if (kL1 && j < p.past_len) {
      tc::cp_async16_zfill<true>(ks + r * kStride<D> + c, k, valid);
      tc::cp_async16_zfill<true>(vs + r * kStride<D> + c, v, valid);
    } else {
      tc::cp_async16_zfill<false>(ks + r * kStride<D> + c, k, valid);
      tc::cp_async16_zfill<false>(vs + r * kStride<D> + c, v, valid);
    }
  }
}

// grid (ceil(q_len * G / 64), num_kv_heads), 128 threads, dynamic smem 2 stages x (K, V) x [64][D + 8].
template <typename T, int D, bool kL1>
__global__ void __launch_bounds__(kNaiveWarps * 32) prefill_naive_kernel(const PrefillParams p) {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  constexpr int kTile = kTileKV * kStride<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int kvh = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads, rows = p.q_len * group;
  const int cta_r0 = blockIdx.x * kNaiveWarps * kWarpRows, r0 = cta_r0 + warp * kWarpRows;
  const bool active = r0 < rows;
  const Rows w = rows_of(p, kvh, active ? r0 : cta_r0, lane);
  const int last_q = (min(cta_r0 + kNaiveWarps * kWarpRows, rows) - 1) / group;
  const int cta_keys = causal_limit(p, last_q, num_keys(p));
  const int tiles = (cta_keys + kTileKV - 1) / kTileKV;

  uint32_t qf[D / 16][4];
  load_q<T, D>(qf, p, w, lane);
  State<D> s;
  s.reset();
  load_kv<T, D, kL1>(smem, smem + kTile, p, kvh, 0, kTileKV, threadIdx.x, blockDim.x, num_keys(p));
  cp_async_commit();
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) {
      T* next = smem + ((t + 1) & 1) * 2 * kTile;
      load_kv<T, D, kL1>(next, next + kTile, p, kvh, (t + 1) * kTileKV, kTileKV, threadIdx.x, blockDim.x,
                          num_keys(p));
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* cur = smem + (t & 1) * 2 * kTile;
    if (active && t * kTileKV < w.lim_max) attend_tile<T, D>(s, qf, cur, cur + kTile, t * kTileKV, w, p.scale_log2, lane);
    __syncthreads();  // the stage is overwritten by the next iteration's prefetch
  }
  if (active) store_out<T, D>(s, p, w, lane);
}

// The tiled schedule: no fill, every key is loaded from the pages / k_new (proj_attention.cuh passes a fill
// that projects the new tokens' rows instead).
struct NoFill {
  __device__ __forceinline__ int load_end(const PrefillParams& p) const { return num_keys(p); }
  template <typename T>
  __device__ __forceinline__ void operator()(T*, T*, int, int, int) const {}
};

// The body of the tiled kernel, shared with proj_attention's fused kernel. smem: num_buffers x (K, V) x
// [kv_chunk][D + 8]. fill(ks, vs, kvh, key0, rows), called by every thread right after a chunk's copies are
// issued, writes the rows of keys [fill.load_end(p), num_keys) that load_kv leaves alone; it may sync the CTA.
template <typename T, int D, bool kL1, class Fill>
__device__ __forceinline__ void tiled_sweep(const PrefillParams& p, T* const smem, const Fill& fill) {
  constexpr int S = kStride<D>;
  const int buffer_elems = 2 * p.kv_chunk * S;  // K then V
  const int kvh = blockIdx.x / p.num_splits, split = blockIdx.x % p.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  const int group = p.num_heads / p.num_kv_heads, rows = p.q_len * group, keys = num_keys(p);
  const int c_begin = static_cast<int>(static_cast<int64_t>(split) * p.num_chunks / p.num_splits);
  const int c_end = static_cast<int>(static_cast<int64_t>(split + 1) * p.num_chunks / p.num_splits);
  const int blocks = (rows + kWarpRows - 1) / kWarpRows;
  const bool double_buffer = p.num_buffers == 2;
  const int load_end = fill.load_end(p);
  auto tiles_of = [&](int c) { return (min(p.kv_chunk, keys - c * p.kv_chunk) + kTileKV - 1) / kTileKV; };
  auto load_chunk = [&](int c, T* buf) {
    load_kv<T, D, kL1>(buf, buf + p.kv_chunk * S, p, kvh, c * p.kv_chunk, tiles_of(c) * kTileKV, threadIdx.x, blockDim.x,
                       load_end);
    cp_async_commit();
    fill(buf, buf + p.kv_chunk * S, kvh, c * p.kv_chunk, tiles_of(c) * kTileKV);
  };
  for (int c = c_begin; c < c_end; ++c) {
    T* const buf = smem + (double_buffer ? (c - c_begin) & 1 : 0) * buffer_elems;
    if (!double_buffer || c == c_begin) {
      __syncthreads();  // single buffer: every warp is done with the previous chunk
      load_chunk(c, buf);
    }
    tc::cp_async_wait_all();  // chunk c has landed (the only copy in flight)
    __syncthreads();          // ... for every thread; and every warp is done with chunk c - 1
    if (double_buffer && c + 1 < c_end) load_chunk(c + 1, smem + ((c + 1 - c_begin) & 1) * buffer_elems);
    const T* ks = buf;
    const T* vs = buf + p.kv_chunk * S;
    const int key0 = c * p.kv_chunk, tiles = tiles_of(c);
    const bool first = c == c_begin;
    for (int b = warp; b < blocks; b += nwarps) {  // the stationary chunk meets every query row
      const Rows w = rows_of(p, kvh, b * kWarpRows, lane);
      const int visible = min(tiles, (w.lim_max - key0 + kTileKV - 1) / kTileKV);  // <= 0: all masked
      State<D> s;
      if (visible <= 0) {
        if (first) {  // the split's state must exist for the merge even when it saw nothing
          s.reset();
          store_partial<T, D>(s, p, split, w, lane);
        }
        continue;
      }
      uint32_t qf[D / 16][4];
      load_q<T, D>(qf, p, w, lane);
      if (first) {
        s.reset();
      } else {
        load_partial<T, D>(s, p, split, w, lane);
      }
      for (int t = 0; t < visible; ++t) {
        attend_tile<T, D>(s, qf, ks + t * kTileKV * S, vs + t * kTileKV * S, key0 + t * kTileKV, w, p.scale_log2, lane);
      }
      store_partial<T, D>(s, p, split, w, lane);
    }
  }
}

// grid (num_kv_heads * num_splits), 128 or 256 threads, dynamic smem num_buffers x (K, V) x [kv_chunk][D + 8].
template <typename T, int D, bool kL1>
__global__ void __launch_bounds__(kTiledMaxThreads, 1) prefill_tiled_kernel(const PrefillParams p) {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  tiled_sweep<T, D, kL1>(p, reinterpret_cast<T*>(smem_raw), NoFill{});
}

// One warp per (query, head) row: out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s over the splits.
// With out_f32 the row stays fp32 and its LSE goes beside it: a later merge of passes rounds only once.
template <typename T, int D>
__global__ void prefill_merge_kernel(const PrefillParams p) {
  constexpr int E = D / 32;  // elements per lane
  static_assert(E == 2 || E == 4, "head_dim must be 64 or 128");
  const int rows = p.q_len * p.num_heads;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float2* ml = reinterpret_cast<const float2*>(p.part_ml);
  float m_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m_max = fmaxf(m_max, __ldcg(ml + static_cast<size_t>(s) * rows + row).x);
  float acc[E] = {};
  float l_sum = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const size_t r = static_cast<size_t>(s) * rows + row;
    const float2 st = __ldcg(ml + r);
    const float wgt = rescale(st.x, m_max);  // a split that saw none of this row's keys weighs 0
    l_sum += wgt * st.y;
    if (p.half_state) {  // stored O / l: weigh by l too
      const uint32_t* o = reinterpret_cast<const uint32_t*>(reinterpret_cast<const T*>(p.part_o) + r * D + lane * E);
#pragma unroll
      for (int e = 0; e < E / 2; ++e) {
        const float2 v = tc::unpack2<T>(__ldcg(o + e));
        acc[2 * e] += wgt * st.y * v.x;
        acc[2 * e + 1] += wgt * st.y * v.y;
      }
      continue;
    }
    const float* o = p.part_o + r * D + lane * E;
    if constexpr (E == 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(o));
      acc[0] += wgt * v.x, acc[1] += wgt * v.y, acc[2] += wgt * v.z, acc[3] += wgt * v.w;
    } else {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(o));
      acc[0] += wgt * v.x, acc[1] += wgt * v.y;
    }
  }
  // A row that saw no key (l_sum = 0) gets O = 0 and LSE = -inf: weight 0 in a merge of passes, not NaN.
  const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
  if (p.out_f32) {
    float* o = p.out_f32 + static_cast<size_t>(row) * D + lane * E;
    if constexpr (E == 4) {
      *reinterpret_cast<float4*>(o) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
    } else {
      *reinterpret_cast<float2*>(o) = make_float2(acc[0] * inv, acc[1] * inv);
    }
    // m is in log2 units of the scaled scores: ln(sum e^s) = ln 2 * (m + log2 l).
    if (lane == 0) p.lse_out[row] = l_sum > 0.f ? (m_max + log2f(l_sum)) * 0.6931471805599453f : -INFINITY;
    return;
  }
  uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + static_cast<size_t>(row) * D + lane * E);
#pragma unroll
  for (int e = 0; e < E / 2; ++e) out[e] = tc::pack2<T>(acc[2 * e] * inv, acc[2 * e + 1] * inv);
}

}  // namespace directkv::prefill
