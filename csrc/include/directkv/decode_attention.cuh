// Zero-copy decode attention over a paged two-tier KV cache (one query token per sequence).
//
// One CTA owns HPC query heads of one KV head (HPC = the whole GQA group for variant "tiled", so each K/V
// byte crosses the link once; HPC = 1 for "naive", which reads K/V once per query head) and one split of
// the sequence (flash-decoding). K/V tiles stream into a STAGES-deep shared-memory ring with 16-byte
// cp.async (or LDG, see DecodeLoad), whatever tier a page is in: a host page is read straight from pinned memory
// through its UVA pointer, nothing is staged. With 64-row tiles the math runs on tensor cores (DecodeMma); with
// 32-row tiles on CUDA cores, each lane 8 dims of a row. Splits write a normalised partial O and its log-sum-exp to
// an HBM workspace; the last split of a (sequence, head group) to finish merges them, so there is no second launch.
// Launched as thread-block clusters (cluster_merge: one cluster per (sequence, head group), <= kDecodeClusterMax
// splits), the splits leave their partials in shared memory and merge them through distributed shared memory instead.
#pragma once

#include <cooperative_groups.h>

#include "directkv/common.cuh"
#include "directkv/prefill_common.cuh"

namespace directkv {

struct DecodeParams {
  const void* q;           // [batch, num_heads, head_dim]
  const void* host_k;      // [num_host_pages, page_size, num_kv_heads, head_dim], pinned, UVA pointer
  const void* host_v;      // same shape
  const void* hbm_k;       // [num_hbm_pages, page_size, num_kv_heads, head_dim]
  const void* hbm_v;       // same shape
  const int* block_table;  // [batch, max_pages]: e >= 0 host page e, e < 0 hbm page -(e + 1)
  const int* seq_lens;     // [batch]
  void* out;               // [batch, num_heads, head_dim] in the input dtype (used when out_f32 is null)
  float* out_f32;          // [batch, num_heads, head_dim] fp32 output instead of `out`, or null
  float* lse_out;          // [batch, num_heads] natural-log log-sum-exp of the scaled scores, or null
  float* part_o;           // [num_splits, batch, num_heads, head_dim] normalised partial outputs
  float* part_lse;         // [num_splits, batch, num_heads] partial log-sum-exp, log2 units
  int* counters;           // [batch, num_heads / heads_per_cta]; zero before a launch, left zero after
  int batch, num_heads, num_kv_heads, max_pages;
  int page_shift;          // log2(page_size)
  int num_splits, tiles_per_split;
  int load_mode;           // DecodeLoad: how K/V tiles move from global (host or HBM) into shared memory
  int split_major;         // grid order: 0 = (group, batch, split), 1 = (split, group, batch)
  int cluster_merge;       // 1: launched with a cluster of all num_splits splits (cluster rank = split), merged in DSMEM
  float scale_log2;        // sm_scale * log2(e): scores come out in log2 units, so exp2f is the exponential
};

// How a tile reaches shared memory. The cp.async flavours keep STAGES - 1 tiles in flight per CTA; the
// register path loads a batch of 16-byte vectors with plain LDG, then stores them (in flight: one batch).
// On the H200 over PCIe, .ca and LDG reach the SM zero-copy ceiling; .cg (any L2 hint) gets ~40% of it.
enum DecodeLoad : int { kCpAsyncL2 = 0, kCpAsyncL1 = 1, kRegisters = 2, kCpAsyncL2Line = 3, kCpAsyncL2Pair = 4 };

// Page-table entries a CTA keeps in shared memory (2 KB): a split of up to 512 pages (8K tokens of 16-token pages)
// reads each entry once, up front; a longer split looks entries up per copy, which ran 13% slower on the H200 (16K x 1
// forced into one split), so the host's split plan keeps splits within the cap (decode_attention.TABLE_CAP).
constexpr int kDecodeTableCap = 512;

// Splits one cluster may hold: 8 is the portable cluster size on sm_90.
constexpr int kDecodeClusterMax = 8;

template <typename T, int HD, int HPC, int TILE, int STAGES>
struct DecodeConfig {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kLanesPerRow = HD / 8;  // each lane holds 8 dims (one 16-byte vector) of a row
  static constexpr int kRowsPerStep = 32 / kLanesPerRow;
  static constexpr int kRowsPerWarp = TILE / kWarps;
  static constexpr int kSteps = kRowsPerWarp / kRowsPerStep;
  // Steps whose scores a lane holds at once before it updates its softmax state (at most 32 registers of them). With
  // 8 heads, q and o already take 128 registers and any batch of steps spilled (ptxas sm_90a, head_dim 128); with one
  // head (naive) batches ran 8% slower over HBM pages on the H200, whose CTAs, four times as many, hide a row's latency
  // (both measured on 64-row tiles before those moved to tensor cores; only 32-row tiles use this math now).
  static constexpr int kSub = HPC == 8 || HPC == 1 ? 1 : kSteps;
  // 64-row tiles run on tensor cores (mma.sync m16n8k16): a warp's 16 rows of a tile are one M block and the heads,
  // padded to 8, the N side, so S^T = K Q^T and O^T += V^T P^T. The lane math above spends ~4 shuffles per row and head
  // on the scores; on the H200 with every page in HBM, 4 heads a CTA ran 33-36% faster this way at batch 16-64, and on
  // host pages the last tile's math, which runs after the call's last K/V byte, is shorter (not traced).
  static constexpr bool kMma = kRowsPerWarp == 16;
  static constexpr int kCopiesPerThread = TILE * kLanesPerRow / kThreads;  // 16-byte copies per tensor
  static constexpr int kRegBatch = kCopiesPerThread < 4 ? kCopiesPerThread : 4;  // register path, per tensor
  static constexpr size_t kRingBytes = size_t(STAGES) * 2 * TILE * HD * sizeof(T);
  static constexpr size_t kMergeBytes = size_t(kWarps) * HPC * (HD + 2) * sizeof(float);
  // cluster_merge: this split's normalised O [HPC][HD] and log-sum-exp [HPC], after the merge scratch
  static constexpr size_t kEndBytes = kMergeBytes + size_t(HPC) * (HD + 1) * sizeof(float);
  static constexpr size_t kSmemBytes = kRingBytes > kEndBytes ? kRingBytes : kEndBytes;

  static_assert(HD == 64 || HD == 128, "head_dim must be 64 or 128");
  static_assert(HPC == 1 || HPC == 2 || HPC == 4 || HPC == 8, "heads per CTA must be 1, 2, 4 or 8");
  static_assert(kSub * HPC <= 32 && kSteps % kSub == 0, "a lane holds at most 32 scores, whole batches of steps");
  static_assert(STAGES >= 2, "the ring needs at least two stages to overlap loads and math");
  static_assert(TILE % (kWarps * kRowsPerStep) == 0, "every warp must get whole steps of a tile");
  static_assert((TILE * kLanesPerRow) % kThreads == 0, "a tile's copies must split evenly over the CTA");

  // Element offset of 16-byte chunk c of ring row r ([STAGES * TILE][HD]). For the tensor-core math the chunk is XOR-ed
  // with r % 8, so the eight rows one ldmatrix phase reads (a row, HD * 2 bytes, apart) fall in eight bank groups.
  static __device__ __forceinline__ int ring(int r, int c) { return r * HD + (kMma ? c ^ (r & 7) : c) * 8; }
};

template <typename T, int HD>
__device__ __forceinline__ void store_final(const DecodeParams& p, int b, int qh, int d, float val, float lse2) {
  const int64_t row = int64_t(b) * p.num_heads + qh;
  if (p.out_f32) {
    p.out_f32[row * HD + d] = val;
  } else {
    static_cast<T*>(p.out)[row * HD + d] = from_float(val, T());
  }
  if (p.lse_out && d == 0) p.lse_out[row] = lse2 * 0.69314718055994531f;
}

// The merge of splits' partials: each adds its normalised O element and log-sum-exp (log2 units), in order; the result
// is their softmax-weighted mean and the log-sum-exp of all. Written once for the cluster merge and the last split's.
struct SplitMerge {
  float mx = -INFINITY, sum = 0.f, acc = 0.f;
  __device__ __forceinline__ void add(float lse, float val) {
    const float m_new = fmaxf(mx, lse);
    const float a = rescale(mx, m_new), wt = exp2f(lse - m_new);
    sum = sum * a + wt;
    acc = acc * a + val * wt;
    mx = m_new;
  }
  __device__ __forceinline__ float out() const { return acc / sum; }
  __device__ __forceinline__ float lse2() const { return mx + log2f(sum); }
};

// The cluster's merge. Every split of the cluster has left its normalised O (part_o) and log-sum-exp (part_lse, log2
// units) in its shared memory, or nothing when it has no tiles (split >= n_active); each CTA, active or not, merges
// its share of the HPC * HD outputs, reading ranks 0 .. n_active - 1 through distributed shared memory. This replaces
// the global path's fence, arrival counter and partials read back from HBM, all of which come after the call's last
// K/V byte (H200, per-CTA trace at 4K x 1: that merge took 2.9-3.3 us of a 6.5 us tail, this one a median 1.7). Every
// CTA of the cluster must call this, even one with nothing to merge: both barriers count all of them.
template <typename T, int HD, int HPC, int THREADS>
__device__ __forceinline__ void cluster_merge(const DecodeParams& p, float* part_o, float* part_lse, int n_active,
                                              int b, int qh0) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // release / acquire: every split's partial is visible to the cluster
  const int ranks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int share = (HPC * HD + ranks - 1) / ranks;
  const int end = min((rank + 1) * share, HPC * HD);
  for (int e = rank * share + static_cast<int>(threadIdx.x); e < end; e += THREADS) {
    const int h = e / HD;
    float lse[kDecodeClusterMax], val[kDecodeClusterMax];
#pragma unroll
    for (int s = 0; s < kDecodeClusterMax; ++s) {  // every load issued before the first is used
      if (s < n_active) {
        lse[s] = *cluster.map_shared_rank(part_lse + h, s);
        val[s] = *cluster.map_shared_rank(part_o + e, s);
      }
    }
    SplitMerge merge;
#pragma unroll
    for (int s = 0; s < kDecodeClusterMax; ++s) {
      if (s < n_active) merge.add(lse[s], val[s]);
    }
    store_final<T, HD>(p, b, qh0 + h, e % HD, merge.out(), merge.lse2());
  }
  cluster.sync();  // no CTA leaves (and frees its shared memory) while another may still read it
}

// The tensor-core math of one warp (DecodeConfig::kMma): its 16 rows of each tile against the CTA's HPC <= 8 heads.
// With g = lane / 4 and t = lane % 4 (prefill_common.cuh), a lane holds the scores of rows g and g + 8 for heads 2t
// and 2t + 1, that pair of heads' online-softmax state, and O^T for dims g and g + 8 of each 16-dim block, for the
// same heads. Heads past HPC are zero queries whose outputs are never stored. P is rounded to T for its mma while l
// sums it in fp32, as FlashAttention does.
template <typename T, int HD, int HPC, int TILE, int STAGES>
struct DecodeMma {
  using C = DecodeConfig<T, HD, HPC, TILE, STAGES>;
  static constexpr int kBlocks = HD / 16;  // 16-dim blocks: k steps of S^T = K Q^T, M blocks of O^T = V^T P^T
  uint32_t qf[kBlocks][2];                 // B fragments of Q^T: head g, dims 16 kb + 2t, 2t + 1 (and + 8)
  float m[2], l[2];                        // heads 2t, 2t + 1: running max (log2 units) and this lane's rows' sum
  float acc[kBlocks][4];                   // O^T: dims 16 kb + g (+ 8) x heads 2t, 2t + 1

  __device__ __forceinline__ void load_q(const T* q_rows, int lane) {  // q_rows: [HPC][HD] of this CTA's heads
    const int g = lane / 4, t = lane % 4;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q_rows + (g < HPC ? g : 0) * HD);
#pragma unroll
    for (int kb = 0; kb < kBlocks; ++kb) {
      qf[kb][0] = g < HPC ? __ldg(row + 8 * kb + t) : 0u;
      qf[kb][1] = g < HPC ? __ldg(row + 8 * kb + 4 + t) : 0u;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) m[j] = -INFINITY, l[j] = 0.f;
#pragma unroll
    for (int kb = 0; kb < kBlocks; ++kb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[kb][i] = 0.f;
    }
  }

  // Rows row0 .. row0 + 15 of a stage (ks / vs: the stage's [TILE][HD] blocks, laid out by C::ring), of which the
  // first `valid` are keys of the sequence (rows past the end hold zeros).
  __device__ __forceinline__ void tile(const T* ks, const T* vs, int row0, int valid, float scale_log2, int lane) {
    const int g = lane / 4;
    float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};  // two chains over the k steps
#pragma unroll
    for (int kb = 0; kb < kBlocks; ++kb) {  // A = K rows: lanes 0-15 address rows 0-15 of chunk 2 kb, 16-31 of 2 kb + 1
      uint32_t a[4];
      tc::ldsm_x4(a, ks + C::ring(row0 + lane % 16, 2 * kb + lane / 16));
      tc::mma16816<T>(kb % 2 ? sb : sa, a, qf[kb][0], qf[kb][1]);
    }
    float sc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[i] = (i < 2 ? g : g + 8) < valid ? (sa[i] + sb[i]) * scale_log2 : -INFINITY;
    float alpha[2], mu[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // the max over the warp's 16 rows: rows g, g + 8 here, then over g
      float mx = fmaxf(sc[j], sc[2 + j]);
#pragma unroll
      for (int off = 4; off < 32; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[j], mx);
      alpha[j] = rescale(m[j], m_new);
      m[j] = m_new;
      mu[j] = m_new == -INFINITY ? 0.f : m_new;  // no key yet: every probability is exp2(-inf) = 0
    }
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = exp2f(sc[i] - mu[i % 2]);
#pragma unroll
    for (int j = 0; j < 2; ++j) l[j] = l[j] * alpha[j] + pr[j] + pr[2 + j];
#pragma unroll
    for (int kb = 0; kb < kBlocks; ++kb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[kb][i] *= alpha[i % 2];
    }
    // P^T as B: each 8 x 8 half of P (rows x heads, as the C fragment holds it) transposed in registers
    const uint32_t b0 = tc::movmatrix_trans(tc::pack2<T>(pr[0], pr[1]));
    const uint32_t b1 = tc::movmatrix_trans(tc::pack2<T>(pr[2], pr[3]));
#pragma unroll
    for (int kb = 0; kb < kBlocks; ++kb) {  // A = V^T: transposed 8 x 8 blocks (rows 0-7 / 8-15) x (dims +0 / +8)
      uint32_t a[4];
      tc::ldsm_x4_trans(a, vs + C::ring(row0 + lane % 8 + lane / 16 * 8, 2 * kb + lane / 8 % 2));
      tc::mma16816<T>(acc[kb], a, b0, b1);
    }
  }

  // This warp's state into the CTA's merge scratch: red_o [warps][HPC][HD], red_m / red_l [warps][HPC].
  __device__ __forceinline__ void store(float* red_o, float* red_m, float* red_l, int warp, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off < 32; off *= 2) l[j] += __shfl_xor_sync(0xffffffffu, l[j], off);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = 2 * t + j;
      if (h >= HPC) continue;
      float* o = red_o + (warp * HPC + h) * HD;
#pragma unroll
      for (int kb = 0; kb < kBlocks; ++kb) o[16 * kb + g] = acc[kb][j], o[16 * kb + g + 8] = acc[kb][2 + j];
      if (g == 0) red_m[warp * HPC + h] = m[j], red_l[warp * HPC + h] = l[j];
    }
  }
};

// grid = (num_heads / HPC, batch, num_splits), or (num_splits, num_heads / HPC, batch) when split_major;
// block = 128 threads; with cluster_merge, clusters of (1, 1, num_splits) or (num_splits, 1, 1).
template <typename T, int HD, int HPC, int TILE, int STAGES>
__global__ void __launch_bounds__(128) decode_attention_kernel(const DecodeParams p) {
  using C = DecodeConfig<T, HD, HPC, TILE, STAGES>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;
  __shared__ int table[kDecodeTableCap];  // this split's page-table entries, when they fit
  T* ks = reinterpret_cast<T*>(smem);  // [STAGES][TILE][HD]
  T* vs = ks + STAGES * TILE * HD;     // [STAGES][TILE][HD]

  const int group = p.split_major ? blockIdx.y : blockIdx.x;
  const int b = p.split_major ? blockIdx.z : blockIdx.y;
  const int split = p.split_major ? blockIdx.x : blockIdx.z;
  const int qh0 = group * HPC;
  const int kvh = qh0 / (p.num_heads / p.num_kv_heads);
  const int len = p.seq_lens[b];
  const int num_tiles = (len + TILE - 1) / TILE;
  // the launcher refuses a plan shorter than the block table; a sequence longer than its table (a caller's error) must
  // still not wait for splits that do not exist (the arrival counter would stay non-zero) or read past the cluster
  const int n_active = min(p.num_splits, (num_tiles + p.tiles_per_split - 1) / p.tiles_per_split);
  const int t_begin = split * p.tiles_per_split;
  const int n = min(p.tiles_per_split, num_tiles - t_begin);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  if (len <= 0) {  // no keys: define the output as zeros rather than leave it unwritten (a cluster returns here whole)
    if (split == 0) {
      for (int e = tid; e < HPC * HD; e += C::kThreads) store_final<T, HD>(p, b, qh0 + e / HD, e % HD, 0.f, -INFINITY);
    }
    return;
  }
  float* end_o = reinterpret_cast<float*>(smem + C::kMergeBytes);  // cluster_merge: [HPC][HD], then lse [HPC]
  float* end_lse = end_o + HPC * HD;
  if (n <= 0) {  // this split lies past the end of a shorter sequence of the batch
    if (p.cluster_merge) cluster_merge<T, HD, HPC, C::kThreads>(p, end_o, end_lse, n_active, b, qh0);
    return;
  }

  const int64_t token_stride = int64_t(p.num_kv_heads) * HD;
  const int64_t page_stride = token_stride << p.page_shift;
  const int page_mask = (1 << p.page_shift) - 1;
  const int* bt = p.block_table + int64_t(b) * p.max_pages;
  const T* host_k = static_cast<const T*>(p.host_k) + kvh * HD;
  const T* host_v = static_cast<const T*>(p.host_v) + kvh * HD;
  const T* hbm_k = static_cast<const T*>(p.hbm_k) + kvh * HD;
  const T* hbm_v = static_cast<const T*>(p.hbm_v) + kvh * HD;

  // Every load from HBM (q, the split's page-table entries) is issued before the first K/V copy: on the H200 HBM loads
  // issued after an SM's host-memory requests appeared to wait behind them (ncu, 4K x 1: 31% of warp-stall samples
  // on q's load, ~40% on the page-table entry looked up between two copies). Measured: no gain at 4K x 1's old plan
  // of 32 two-tile splits, 2% with one split, which the host-only plan's few long splits now use.
  const int first_page = (t_begin * TILE) >> p.page_shift;
  const int n_pages = ((min((t_begin + n) * TILE, len) - 1) >> p.page_shift) - first_page + 1;
  const bool in_smem = n_pages <= kDecodeTableCap;  // else each copy reads its entry from global memory
  if (in_smem) {
    for (int i = tid; i < n_pages; i += C::kThreads) table[i] = __ldg(bt + first_page + i);
  }
  // Lane layout of the CUDA-core math (32-row tiles): kRowsPerStep rows per warp step, kLanesPerRow lanes per row,
  // 8 dims per lane.
  const int row_in_step = lane / C::kLanesPerRow;
  const int chunk = lane % C::kLanesPerRow;
  const T* q_rows = static_cast<const T*>(p.q) + (int64_t(b) * p.num_heads + qh0) * HD;
  uint4 q_raw[HPC];  // converted after the first copies are issued
  DecodeMma<T, HD, HPC, TILE, STAGES> mma;
  if constexpr (C::kMma) {
    mma.load_q(q_rows, lane);
  } else {
#pragma unroll
    for (int h = 0; h < HPC; ++h) q_raw[h] = *reinterpret_cast<const uint4*>(q_rows + h * HD + chunk * 8);
  }
  __syncthreads();  // the table is filled

  // Copy i of this thread: row idx / kLanesPerRow, 16-byte chunk idx % kLanesPerRow of K and of V.
  // Returns false past the end of the sequence: the lane math never reads such a row; the tensor-core math multiplies
  // its V by a zero probability, so it is zeroed (stale shared memory may hold NaN, and 0 * NaN is NaN), K too, so no
  // stale row reaches an mma.
  auto locate = [&](int tile, int stage, int i, const T*& k_src, const T*& v_src, int& s) {
    const int idx = tid + i * C::kThreads;
    const int r = idx / C::kLanesPerRow, c = idx % C::kLanesPerRow;
    const int pos = tile * TILE + r;
    s = C::ring(stage * TILE + r, c);
    if (pos >= len) return false;
    const int e = in_smem ? table[(pos >> p.page_shift) - first_page] : __ldg(bt + (pos >> p.page_shift));
    const int64_t off = (e >= 0 ? int64_t(e) : int64_t(-e - 1)) * page_stride + (pos & page_mask) * token_stride + c * 8;
    k_src = (e >= 0 ? host_k : hbm_k) + off;
    v_src = (e >= 0 ? host_v : hbm_v) + off;
    return true;
  };
  auto issue = [&](int tile, int stage) {
    const T *k_src, *v_src;
    int s;
    if (p.load_mode == kRegisters) {
#pragma unroll
      for (int i0 = 0; i0 < C::kCopiesPerThread; i0 += C::kRegBatch) {
        uint4 kr[C::kRegBatch], vr[C::kRegBatch];
        int so[C::kRegBatch];  // ring offset, -1 past the end
#pragma unroll
        for (int j = 0; j < C::kRegBatch; ++j) {
          const bool valid = locate(tile, stage, i0 + j, k_src, v_src, s);
          so[j] = valid || C::kMma ? s : -1;
          kr[j] = vr[j] = make_uint4(0, 0, 0, 0);
          if (valid) {
            kr[j] = *reinterpret_cast<const uint4*>(k_src);
            vr[j] = *reinterpret_cast<const uint4*>(v_src);
          }
        }
#pragma unroll
        for (int j = 0; j < C::kRegBatch; ++j) {
          if (so[j] >= 0) {
            *reinterpret_cast<uint4*>(ks + so[j]) = kr[j];
            *reinterpret_cast<uint4*>(vs + so[j]) = vr[j];
          }
        }
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < C::kCopiesPerThread; ++i) {
      if (locate(tile, stage, i, k_src, v_src, s)) {
        switch (p.load_mode) {
          case kCpAsyncL1: cp_async16<1>(ks + s, k_src), cp_async16<1>(vs + s, v_src); break;
          case kCpAsyncL2Line: cp_async16<2>(ks + s, k_src), cp_async16<2>(vs + s, v_src); break;
          case kCpAsyncL2Pair: cp_async16<3>(ks + s, k_src), cp_async16<3>(vs + s, v_src); break;
          default: cp_async16<0>(ks + s, k_src), cp_async16<0>(vs + s, v_src);
        }
      } else if constexpr (C::kMma) {
        *reinterpret_cast<uint4*>(ks + s) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(vs + s) = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // The first tiles' copies: the link starts once q and the table have been requested.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n) issue(t_begin + s, s);
    cp_async_commit();
  }

  float q[HPC][8];  // the lane math's scaled q (DecodeMma keeps its own fragments)
  if constexpr (!C::kMma) {
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      to_float8(q_raw[h], T(), q[h]);
#pragma unroll
      for (int i = 0; i < 8; ++i) q[h][i] *= p.scale_log2;
    }
  }
  // The lane math's online-softmax state of the rows this lane's row group has seen (replicated over its kLanesPerRow
  // lanes).
  float m[HPC], l[HPC], o[HPC][8];
#pragma unroll
  for (int h = 0; h < HPC; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[h][i] = 0.f;
  }

  for (int it = 0; it < n; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` landed for every thread; the stage refilled below was consumed last round
    if (it + STAGES - 1 < n) issue(t_begin + it + STAGES - 1, (it + STAGES - 1) % STAGES);
    cp_async_commit();
    const int stage = it % STAGES;
    const int tile_pos = (t_begin + it) * TILE;
    if constexpr (C::kMma) {
      const int row0 = warp * C::kRowsPerWarp;
      mma.tile(ks + stage * TILE * HD, vs + stage * TILE * HD, row0, len - tile_pos - row0, p.scale_log2, lane);
    } else {
      // kSub steps at a time: their scores first (independent, so their shuffles overlap), then one rescale of the
      // running state for all of them, then their P V; a row-by-row online softmax chains every row's update to the
      // last one's max and spends two exponentials per row, and the last tile's math runs after the call's last byte.
#pragma unroll
      for (int s0 = 0; s0 < C::kSteps; s0 += C::kSub) {
        float sc[C::kSub][HPC];
#pragma unroll
        for (int j = 0; j < C::kSub; ++j) {
          const int r = warp * C::kRowsPerWarp + (s0 + j) * C::kRowsPerStep + row_in_step;
          const bool valid = tile_pos + r < len;
          float kf[8];
          const uint4 kr = valid ? *reinterpret_cast<const uint4*>(ks + C::ring(stage * TILE + r, chunk))
                                 : make_uint4(0, 0, 0, 0);
          to_float8(kr, T(), kf);
#pragma unroll
          for (int h = 0; h < HPC; ++h) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) dot = fmaf(q[h][i], kf[i], dot);
            dot = group_sum<C::kLanesPerRow>(dot);  // every lane shuffles, valid row or not
            sc[j][h] = valid ? dot : -INFINITY;
          }
        }
#pragma unroll
        for (int h = 0; h < HPC; ++h) {
          float m_new = m[h];
#pragma unroll
          for (int j = 0; j < C::kSub; ++j) m_new = fmaxf(m_new, sc[j][h]);
          const float alpha = rescale(m[h], m_new);  // 0 while this row group has seen no key (m_new may be -inf)
          l[h] *= alpha;
#pragma unroll
          for (int i = 0; i < 8; ++i) o[h][i] *= alpha;
          m[h] = m_new;
        }
#pragma unroll
        for (int j = 0; j < C::kSub; ++j) {
          const int r = warp * C::kRowsPerWarp + (s0 + j) * C::kRowsPerStep + row_in_step;
          if (tile_pos + r >= len) continue;  // a row past the end: its stale V may hold anything, even NaN
          float vf[8];
          to_float8(*reinterpret_cast<const uint4*>(vs + C::ring(stage * TILE + r, chunk)), T(), vf);
#pragma unroll
          for (int h = 0; h < HPC; ++h) {
            const float pr = exp2f(sc[j][h] - m[h]);
            l[h] += pr;
#pragma unroll
            for (int i = 0; i < 8; ++i) o[h][i] = fmaf(pr, vf[i], o[h][i]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is idle: reuse it as merge scratch

  // Merge the row groups of each warp, then the warps through shared memory.
  float* red_o = reinterpret_cast<float*>(smem);  // [kWarps][HPC][HD]
  float* red_m = red_o + C::kWarps * HPC * HD;     // [kWarps][HPC]
  float* red_l = red_m + C::kWarps * HPC;          // [kWarps][HPC]
  if constexpr (C::kMma) {
    mma.store(red_o, red_m, red_l, warp, lane);
  } else {
#pragma unroll
    for (int off = C::kLanesPerRow; off < 32; off *= 2) {
#pragma unroll
      for (int h = 0; h < HPC; ++h) {
        const float mo = __shfl_xor_sync(0xffffffffu, m[h], off);
        const float lo = __shfl_xor_sync(0xffffffffu, l[h], off);
        const float m_new = fmaxf(m[h], mo);
        const float a = rescale(m[h], m_new), bw = rescale(mo, m_new);
        l[h] = l[h] * a + lo * bw;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[h][i] = o[h][i] * a + __shfl_xor_sync(0xffffffffu, o[h][i], off) * bw;
        m[h] = m_new;
      }
    }
    if (lane < C::kLanesPerRow) {
#pragma unroll
      for (int h = 0; h < HPC; ++h) {
#pragma unroll
        for (int i = 0; i < 8; ++i) red_o[(warp * HPC + h) * HD + chunk * 8 + i] = o[h][i];
        if (lane == 0) {
          red_m[warp * HPC + h] = m[h];
          red_l[warp * HPC + h] = l[h];
        }
      }
    }
  }
  __syncthreads();

  const bool single = n_active == 1 && !p.cluster_merge;
  // This CTA's outputs, all computed before any is stored: the compiler cannot tell the stores from the shared-memory
  // reads, and would otherwise finish one output before it reads the next (the loop runs after the last K/V byte)
  constexpr int kPer = (HPC * HD + C::kThreads - 1) / C::kThreads;
  float vals[kPer], lse2s[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = min(tid + j * C::kThreads, HPC * HD - 1), h = e / HD, d = e % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) mx = fmaxf(mx, red_m[w * HPC + h]);
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) {
      const float wt = rescale(red_m[w * HPC + h], mx);
      sum += red_l[w * HPC + h] * wt;
      acc += red_o[(w * HPC + h) * HD + d] * wt;
    }
    vals[j] = acc / sum;
    lse2s[j] = mx + log2f(sum);
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = tid + j * C::kThreads, h = e / HD, d = e % HD;
    if (e >= HPC * HD) break;
    if (single) {
      store_final<T, HD>(p, b, qh0 + h, d, vals[j], lse2s[j]);
    } else if (p.cluster_merge) {
      end_o[e] = vals[j];
      if (d == 0) end_lse[h] = lse2s[j];
    } else {
      const int64_t row = (int64_t(split) * p.batch + b) * p.num_heads + qh0 + h;
      p.part_o[row * HD + d] = vals[j];
      if (d == 0) p.part_lse[row] = lse2s[j];
    }
  }
  if (single) return;
  if (p.cluster_merge) {
    cluster_merge<T, HD, HPC, C::kThreads>(p, end_o, end_lse, n_active, b, qh0);
    return;
  }

  // Last split to arrive merges (threadfence-reduction pattern: publish, count, then read with .cg).
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* counter = p.counters + int64_t(b) * (p.num_heads / HPC) + group;
    is_last = atomicAdd(counter, 1) == n_active - 1;
    if (is_last) *counter = 0;  // every split has counted: leave it zero for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int e = tid; e < HPC * HD; e += C::kThreads) {
    const int h = e / HD, d = e % HD;
    SplitMerge merge;
    for (int s = 0; s < n_active; ++s) {
      const int64_t row = (int64_t(s) * p.batch + b) * p.num_heads + qh0 + h;
      merge.add(__ldcg(p.part_lse + row), __ldcg(p.part_o + row * HD + d));
    }
    store_final<T, HD>(p, b, qh0 + h, d, merge.out(), merge.lse2());
  }
}

}  // namespace directkv
