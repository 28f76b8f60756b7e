"""executor.hbm_prefill=sdpa: a prompt chunk whose past sits in HBM pages (hbm's cache; swap's, cpu_attn's and
flexgen's staging pool) attended by torch SDPA instead of our tiled kernel.

SDPA's FlashAttention needs each sequence's K/V contiguous, so the chunk's past pages are gathered into one
`[past + new, num_kv_heads, head_dim]` copy in HBM first (an HBM-to-HBM copy of the past, ~0.1 ms for 328 MB on
the H200), then one causal call, aligned bottom-right (the chunk's first new token sees the whole past), GQA by
SDPA's enable_gqa. Why: with K/V in HBM our tiled kernel takes 1.5-1.7x SDPA's time (16K past, kernel_ablation
`tiled:kv_hbm` vs `sdpa_hbm`, H200 2026-12-02), while directkv `stream` attends prompt chunks with FlashAttention
passes over its ring; the baselines should get the best HBM kernel available too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from directkv.errors import ConfigError, unknown_name

HBM_PREFILLS = ("kernel", "sdpa")


def gather_past(pool: torch.Tensor, table: torch.Tensor, past_len: int, page_size: int) -> torch.Tensor:
    """The first past_len tokens of a sequence whose block table `table` (`[width]` int32, HBM entries -(page + 1),
    on pool's device) maps them into `pool` `[pages, page_size, num_kv_heads, head_dim]`, as one contiguous
    `[past_len, num_kv_heads, head_dim]` copy. Indexes on the device: no host read of the table."""
    pages = -(-past_len // page_size)
    idx = -(table[:pages].to(torch.int64) + 1)
    return pool.index_select(0, idx).flatten(0, 1)[:past_len]


def sdpa_chunk(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               table: torch.Tensor, past_len: int, page_size: int) -> torch.Tensor:
    """Causal attention of a chunk's queries q `[q_len, num_heads, head_dim]` over its past (HBM pages of k_pool /
    v_pool through `table`) and its new K/V `[q_len, num_kv_heads, head_dim]`; returns `[q_len, num_heads,
    head_dim]`."""
    if past_len:
        k = torch.cat([gather_past(k_pool, table, past_len, page_size), k_new])
        v = torch.cat([gather_past(v_pool, table, past_len, page_size), v_new])
    else:
        k, v = k_new, v_new
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, tokens, head_dim]
    if q.is_cuda:
        _check_flash(q4, k4, v4)
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal_lower_right(q.shape[0], k.shape[0]),
                                       enable_gqa=k.shape[1] != q.shape[1])
    return o[0].transpose(0, 1)


def _check_flash(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> None:
    """On a GPU the call must reach FlashAttention: the fallback torch takes otherwise materialises the causal
    mask and the scores (tens of GB at a 16K past), which would read as an OOM of the system, not of the option."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    params = SDPAParams(q4, k4, v4, None, 0.0, True, k4.shape[1] != q4.shape[1])
    if not can_use_flash_attention(params):
        raise ConfigError(f"executor.hbm_prefill=sdpa: torch's FlashAttention cannot run a chunk of q {tuple(q4.shape)} "
                          f"{q4.dtype} over K {tuple(k4.shape)} on this GPU; valid here: kernel")


def check_hbm_prefill(name: object) -> str:
    """`name` if it is one of HBM_PREFILLS, else the one-line ConfigError naming the valid ones."""
    if name not in HBM_PREFILLS:
        raise unknown_name("executor.hbm_prefill", name, HBM_PREFILLS)
    return str(name)
