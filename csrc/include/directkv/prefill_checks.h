// Host-side checks of a PrefillParams before a launch (prefill_attention and proj_attention launchers): each
// failure names the op and the bad value. No torch headers.
#pragma once

#include <cstdint>
#include <string>

#include "directkv/prefill_attention.cuh"

namespace directkv::prefill {

// variant 0: naive, 1: tiled (proj_attention's kernels run the tiled schedule).
inline void check_params(const PrefillParams& p, int variant, int threads, const std::string& op) {
  require(p.q_len >= 1 && p.past_len >= 0, op + ": need q_len >= 1 and past_len >= 0");
  require(p.num_heads >= 1 && p.num_kv_heads >= 1 && p.num_heads % p.num_kv_heads == 0,
          op + ": num_heads " + std::to_string(p.num_heads) + " is not a multiple of num_kv_heads " +
              std::to_string(p.num_kv_heads));
  require(p.num_kv_heads <= 65535, op + ": num_kv_heads must be <= 65535");
  require(p.page_size >= 1, op + ": page_size must be >= 1");
  require(p.past_len == 0 || p.block_table, op + ": no block table for a non-empty past");
  require(!p.new_in_pages || (p.block_table && p.include_new), op + ": new_in_pages needs the new tokens (include_new) "
                                                                     "and a block table that holds their pages");
  for (const void* ptr : {p.q, p.k_new, p.v_new, p.host_k, p.host_v, p.hbm_k, p.hbm_v, static_cast<const void*>(p.out),
                          static_cast<const void*>(p.out_f32)}) {
    require(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, op + ": tensors and KV pools must be 16-byte aligned");
  }
  require(reinterpret_cast<uintptr_t>(p.lse_out) % 4 == 0, op + ": lse_out must be 4-byte aligned");
  require(!p.out_f32 == !p.lse_out, op + ": out_f32 and lse_out come together");
  require(p.q && p.k_new && p.v_new && (p.out || p.out_f32), op + ": null q, k_new, v_new or out");
  // Zero keys would leave the tiled kernel no chunk to give a split: the caller skips such a pass.
  require(num_keys(p) >= 1, op + ": no keys (past_len 0 and include_new 0)");
  if (variant == 0) {
    require(p.half_state == 0, op + ": half_state is an option of the tiled variant (1); got naive (0)");
    // The stream variant runs its passes on the tiled kernel only; naive keeps the one-call form.
    require(p.include_new == 1 && !p.out_f32, op + ": include_new 0 and out_f32 / lse_out need the tiled "
                                              "variant (1); got naive (0)");
  }
  if (variant == 1) {
    require(p.kv_chunk >= kTileKV && p.kv_chunk % kTileKV == 0,
            op + ": kv_chunk " + std::to_string(p.kv_chunk) + " is not a positive multiple of 64");
    require(p.num_chunks == (num_keys(p) + p.kv_chunk - 1) / p.kv_chunk,
            op + ": num_chunks " + std::to_string(p.num_chunks) + " does not match the key count " +
                std::to_string(num_keys(p)) + " and kv_chunk " + std::to_string(p.kv_chunk));
    require(p.num_splits >= 1 && p.num_splits <= p.num_chunks,
            op + ": num_splits " + std::to_string(p.num_splits) + " must be in 1.." + std::to_string(p.num_chunks));
    require(p.part_o && p.part_ml, op + ": the tiled variant needs the part_o / part_ml workspace");
    require(threads == 128 || threads == 256, op + ": threads " + std::to_string(threads) + " must be 128 or 256");
    require(p.num_buffers == 1 || p.num_buffers == 2, op + ": num_buffers " + std::to_string(p.num_buffers) + " must be 1 or 2");
    require(p.half_state == 0 || p.half_state == 1, op + ": half_state " + std::to_string(p.half_state) + " must be 0 or 1");
    require(static_cast<int64_t>(p.num_kv_heads) * p.num_splits < (int64_t{1} << 31), op + ": grid too large");
  }
}

}  // namespace directkv::prefill
