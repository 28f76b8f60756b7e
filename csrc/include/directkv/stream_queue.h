// Copy queue of the decode `stream` variant (directkv/kernels/cuda/decode_attention.py, StreamPlan), host side.
//
// The copy engine moves a batch's host pages chunk by chunk into a small HBM ring on a side stream while the
// decode kernel reads the previous chunk on the caller's stream. A serving step's layers form one queue of
// calls (one per layer's pools): chunk g of the queue sits in ring slot g % num_slots, and its copy waits for
// the kernel that last read that slot. A StreamQueue holds what one step's plan fixes (ring, copy runs,
// events, the last tokens' ring rows), so a layer's chunks are issued by one call instead of a Python loop
// per chunk (4x swap's host time per layer on the H200 host, 2026-12-01). The counters stay with the Python
// plan: a call gets the chunks copied so far and returns (copied, consumed); consumed on entry is the call's
// first chunk, every earlier call's kernels being queued. Handles and pointers are integers; no CUDA resource
// is owned here.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace directkv {

// The decode kernel's launch configuration for every pass of one layer (the Python split plan's output).
struct StreamLaunch {
  uintptr_t q;          // [batch, num_heads, head_dim]
  uintptr_t out;        // [batch, num_heads, head_dim] in q's dtype: the single pass's or the merge's output
  uintptr_t o_parts;    // [passes, batch, num_heads, head_dim] fp32, or 0 with one pass (no merge)
  uintptr_t lse_parts;  // [passes, batch, num_heads] fp32, or 0
  uintptr_t passes;     // [passes, batch, width] int32 block tables (entries -(ring page + 1), HBM pass: the cache's)
  uintptr_t lens;       // [passes, batch] int32 tokens of each sequence in each pass
  int num_passes;
  bool hbm_pass;        // the last pass reads hbm_k / hbm_v
  uintptr_t hbm_k, hbm_v;
  uintptr_t part_o, part_lse, counters;  // split-KV workspace when num_splits > 1
  int batch, num_heads, num_kv_heads, head_dim, width, page_size;
  int num_splits, tiles_per_split, heads_per_cta, tile, dtype, load_mode, split_major;
  float sm_scale;
};

class StreamQueue {
 public:
  // runs / num_runs: per chunk, a (host page, ring page, pages) int64 [num_runs, 3] array in host memory.
  // filled / freed: cudaEvent_t per ring slot (already created). last_n / last_rows / last_at: per chunk
  // c < num_slots, the sequences whose last token's page it holds (count, [n] int64 device rows) and, per
  // slot s, those tokens' rows in the ring's [ring_rows, row_bytes] view (last_at[c * num_slots + s]).
  StreamQueue(uintptr_t ring_k, uintptr_t ring_v, int64_t slot_bytes, int64_t page_bytes,
              std::vector<uintptr_t> runs, std::vector<int64_t> num_runs, std::vector<uintptr_t> filled,
              std::vector<uintptr_t> freed, uintptr_t side, std::vector<int64_t> last_n,
              std::vector<uintptr_t> last_rows, std::vector<uintptr_t> last_at, int64_t ring_rows,
              int64_t row_bytes);

  // The calls the queue serves, in order: (host K, host V) base pointers per call.
  void set_queue(std::vector<uintptr_t> host_k, std::vector<uintptr_t> host_v);

  // Issue copies of chunks [copied, min(upto, consumed + num_slots, all)), each into its slot after that
  // slot's last reader (wait_readers false skips the wait: a test's mutation). Returns the new `copied`.
  int64_t fill(int64_t copied, int64_t consumed, int64_t upto, bool wait_readers);

  // One call's passes on `main`, the call whose first chunk is queue chunk `first`, with `copied` chunks
  // copied so far: per chunk, its copy (fill), the wait for it, the last tokens written into it when it was
  // copied before the call began (last_k / last_v [last_src_rows, row], or 0), the kernel, the slot's release
  // and the next copies; then the HBM pass and the merge. The decode launches are checked before the first
  // copy. The copies follow what `main` queued before the call only through the caller's
  // side.wait_stream(main). lag_cycles > 0 delays each chunk's kernel on the GPU (tests). Returns (copied,
  // consumed).
  std::pair<int64_t, int64_t> run_layer(uintptr_t main, int64_t first, int64_t copied, const StreamLaunch& launch,
                                        uintptr_t last_k, uintptr_t last_v, int64_t last_src_rows,
                                        int64_t lag_cycles, bool wait_readers);

  int num_slots() const { return static_cast<int>(filled_.size()); }
  int num_chunks() const { return static_cast<int>(runs_.size()); }

 private:
  uintptr_t ring_k_, ring_v_;
  int64_t slot_bytes_, page_bytes_;
  std::vector<uintptr_t> runs_;
  std::vector<int64_t> num_runs_;
  std::vector<uintptr_t> filled_, freed_;
  uintptr_t side_;
  std::vector<int64_t> last_n_;
  std::vector<uintptr_t> last_rows_, last_at_;
  int64_t ring_rows_, row_bytes_;
  std::vector<uintptr_t> queue_k_, queue_v_;
};

}  // namespace directkv
