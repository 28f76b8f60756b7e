"""executor.hbm_prefill=sdpa: a prompt chunk whose past sits in HBM pages (hbm's cache; swap's, cpu_attn's and
flexgen's staging pool) attended by torch SDPA instead of our tiled kernel.

SDPA's FlashAttention needs each sequence's K/V contiguous, so the chunk's past pages and its new K/V are first
written into one `[past + new, num_kv_heads, head_dim]` buffer in HBM (one copy of each; at the H200's ~4 TB/s a
16K OPT-13B past, 336 MB of K and V, would take ~0.1-0.2 ms: an estimate, not measured), then one causal call
aligned bottom-right (the chunk's first new token sees the whole past), GQA by SDPA's enable_gqa. Why: with K/V
in HBM our tiled kernel takes 1.5-1.7x SDPA's time (16K past, kernel_ablation `tiled:kv_hbm` vs `sdpa_hbm`, H200
2026-12-02), while directkv `stream` attends prompt chunks with FlashAttention passes over its ring; the
baselines should get the best HBM kernel available too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from directkv.errors import ConfigError


def gather_past(pool: torch.Tensor, table: torch.Tensor, past_len: int, page_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The first past_len tokens of a sequence whose block table `table` (`[width]` int32, HBM entries -(page + 1),
    on pool's device) maps them into `pool` `[pages, page_size, num_kv_heads, head_dim]`, as one contiguous
    `[past_len, num_kv_heads, head_dim]` tensor: a view of `out` (`[>= pages * page_size, num_kv_heads,
    head_dim]`) when given, so the caller can put more tokens right after. Indexes on the device: no host read."""
    pages = -(-past_len // page_size)
    idx = -(table[:pages].to(torch.int64) + 1)
    if out is None:
        return pool.index_select(0, idx).flatten(0, 1)[:past_len]
    torch.index_select(pool, 0, idx, out=out[: pages * page_size].view(pages, *pool.shape[1:]))
    return out[:past_len]


def sdpa_chunk(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               table: torch.Tensor, past_len: int, page_size: int, option: str = "executor.hbm_prefill") -> torch.Tensor:
    """Causal attention of a chunk's queries q `[q_len, num_heads, head_dim]` over its past (HBM pages of k_pool /
    v_pool through `table`) and its new K/V `[q_len, num_kv_heads, head_dim]`; returns `[q_len, num_heads,
    head_dim]`."""
    q_len = q.shape[0]
    if past_len:
        # past pages gathered whole (the last may run past past_len); the new tokens then overwrite that tail
        rows = max(-(-past_len // page_size) * page_size, past_len + q_len)
        k, v = (torch.empty((rows, *k_new.shape[1:]), dtype=k_new.dtype, device=k_new.device) for _ in range(2))
        for buf, pool, new in ((k, k_pool, k_new), (v, v_pool, v_new)):
            gather_past(pool, table, past_len, page_size, out=buf)
            buf[past_len : past_len + q_len] = new
        k, v = k[: past_len + q_len], v[: past_len + q_len]
    else:
        k, v = k_new, v_new
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, tokens, head_dim]
    gqa = k.shape[1] != q.shape[1]
    mask = causal_lower_right(q_len, k.shape[0])
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=gqa)[0].transpose(0, 1)
    _check_flash(q4, k4, v4, gqa, option)
    # Flash only: a chunk with no past (q_len == kv_len) leaves torch's causal bias for its general dispatch, which
    # on the H200 (torch 2.11) picked cuDNN attention, whose host built a plan per new shape: on ShareGPT, where the
    # shapes vary, swap's steps were host-bound for 100-340 ms, most likely from those plans (H200, 2026-12-02: 1,632
    # of 1,632 calls in 20 replayed steps went to cuDNN, 2.4 s of host time; results/h200/README.md, twenty-second
    # session)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _check_flash(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, gqa: bool,
                 option: str = "executor.hbm_prefill") -> None:
    """On a GPU the call must be one FlashAttention can run, so that the option measures the kernel it names. The
    call runs with FlashAttention as the only backend (sdpa_chunk), so a chunk it cannot run would fail inside torch
    with a message about backends; this check says instead, in one line, which shapes and which value to use. The
    parameters are the ones torch's CausalBias dispatch checks (is_causal False: the mask carries the causality;
    flash applies it bottom-right)."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    if not can_use_flash_attention(SDPAParams(q4, k4, v4, None, 0.0, False, gqa)):
        raise ConfigError(f"{option}=sdpa: torch's FlashAttention cannot run a chunk of q {tuple(q4.shape)} "
                          f"{q4.dtype} over K {tuple(k4.shape)} on this GPU; valid here: kernel")
