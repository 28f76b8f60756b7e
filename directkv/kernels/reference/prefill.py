"""Prefill attention of one sequence: new queries over the cached past tokens plus the new tokens."""

from __future__ import annotations

import math

import torch

from directkv.errors import check
from directkv.kernels.paged import PagedKV
from directkv.kernels.reference.common import check_tiles, check_variant, counted, page_entries
from directkv.kernels.reference.kv_source import DenseKVRange, PagedKVRange
from directkv.kernels.reference.online_softmax import HeadLayout
from directkv.kernels.reference.schedules import AttnProblem, kv_outer, q_outer
from directkv.kernels.traffic import Traffic, TrafficCounter

PREFILL_VARIANTS = ("naive", "tiled")


def check_prefill_cache(kv: PagedKV, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Validate a one-sequence cache against the queries' shape; returns past_len = kv.seq_lens[0]."""
    check(kv.batch == 1, f"prefill takes one sequence; kv.batch is {kv.batch}")
    check(head_dim == kv.head_dim, f"q head_dim {head_dim} != kv head_dim {kv.head_dim}")
    check(
        num_heads % kv.num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {kv.num_kv_heads}",
    )
    check(dtype == kv.dtype, f"q dtype {dtype} != KV dtype {kv.dtype}")
    past_len = int(kv.seq_lens[0])
    check(past_len >= 0, f"kv.seq_lens[0] (past_len) must be >= 0; got {past_len}")
    return past_len


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv: PagedKV,
    *,
    variant: str,
    causal: bool = True,
    tile_q: int = 64,
    tile_kv: int = 64,
    sm_scale: float | None = None,
    compute: bool = True,
    counter: TrafficCounter | None = None,
) -> tuple[torch.Tensor | None, Traffic]:
    """Attention of q_len new tokens over past_len cached tokens and themselves.

    Parameters
    ----------
    q : `[q_len, num_heads, head_dim]` in HBM; query i is at absolute position past_len + i.
    k_new, v_new : `[q_len, num_kv_heads, head_dim]` in HBM (just projected), same dtype as q.
    kv : one-sequence paged cache holding the past_len = kv.seq_lens[0] past tokens (0 allowed).
    variant : "naive" (Q tile outer; past K/V cross the link once per Q tile) or "tiled" (K/V tile outer;
        each past K/V tile read once, partial O, m, l kept in HBM between Q tiles).
    causal : new query i sees new tokens j <= i; all past tokens are always visible.
    tile_q, tile_kv : tile sizes in tokens (lengths need not be multiples).
    sm_scale : softmax scale, default 1 / sqrt(head_dim).
    compute : False counts traffic only (tensors and pools may be on device "meta").
    counter : accumulates the traffic when given.

    Returns
    -------
    (out `[q_len, num_heads, head_dim]` in q.dtype or None, this call's Traffic)
    """
    check_variant("prefill_attention", variant, PREFILL_VARIANTS)
    check_tiles(tile_q=tile_q, tile_kv=tile_kv)
    check(q.dim() == 3, f"q must be [q_len, num_heads, head_dim]; got shape {tuple(q.shape)}")
    q_len, num_heads, head_dim = (int(s) for s in q.shape)
    check(q_len >= 1, "prefill needs q_len >= 1")
    past_len = check_prefill_cache(kv, num_heads, head_dim, q.dtype)
    want = (q_len, kv.num_kv_heads, head_dim)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check(
            tuple(t.shape) == want,
            f"{name} must be [q_len, num_kv_heads, head_dim] = {want}; got {tuple(t.shape)}",
        )
        check(t.dtype == q.dtype, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    entries = page_entries(kv, [past_len])[0]
    problem = AttnProblem(
        q=q if compute else None, q_len=q_len, q_pos0=past_len, head_dim=head_dim, dtype=q.dtype,
        layout=HeadLayout(num_heads, kv.num_kv_heads, per_query_head=False), causal=causal,
        scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim), tile_q=tile_q, tile_kv=tile_kv,
    )  # fmt: skip
    sources = [
        PagedKVRange(kv, entries, 0, past_len, q.device if compute else None),
        DenseKVRange(k_new, v_new, past_len),
    ]
    schedule = q_outer if variant == "naive" else kv_outer
    return counted(counter, lambda c: schedule(problem, sources, c, compute))
