"""Decode attention over a paged KV cache: one new query token per sequence, all its cached tokens visible."""

from __future__ import annotations

import math

import torch

from directkv.errors import check
from directkv.kernels.paged import PagedKV, check_queries
from directkv.kernels.reference.common import check_tiles, check_variant, counted, page_entries
from directkv.kernels.reference.kv_source import PagedKVRange
from directkv.kernels.reference.online_softmax import HeadLayout
from directkv.kernels.reference.schedules import AttnProblem, q_outer
from directkv.kernels.traffic import Traffic, TrafficCounter

DECODE_VARIANTS = ("naive", "tiled")


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    *,
    variant: str,
    tile_kv: int = 64,
    sm_scale: float | None = None,
    compute: bool = True,
    counter: TrafficCounter | None = None,
) -> tuple[torch.Tensor | None, Traffic]:
    """Attention of each sequence's one query over its kv.seq_lens[b] cached tokens.

    Parameters
    ----------
    q : `[batch, num_heads, head_dim]`, in HBM, same dtype as the KV pools.
    kv : paged cache; sequence b's tokens are positions 0..seq_lens[b]-1 (seq_lens[b] >= 1), the query's
        own K/V included.
    variant : "naive" (one query head per reader, GQA-unaware: each K/V head is read gqa_ratio times) or
        "tiled" (all query heads of a KV head read each K/V byte once).
    tile_kv : tokens per K/V tile; tiles may span pages of different tiers.
    sm_scale : softmax scale, default 1 / sqrt(head_dim).
    compute : False runs the same loops counting traffic only (q and the pools may be on device "meta").
    counter : accumulates the traffic when given.

    Returns
    -------
    (out `[batch, num_heads, head_dim]` in q.dtype or None, this call's Traffic)
    """
    check_variant("decode_attention", variant, DECODE_VARIANTS)
    check_tiles(tile_kv=tile_kv)
    batch, num_heads, head_dim = check_queries(q, kv, rows="batch")
    check(batch == kv.batch, f"q batch {batch} != kv batch {kv.batch}")
    seq_lens = [int(n) for n in kv.seq_lens.tolist()]
    check(
        all(n >= 1 for n in seq_lens), f"decode needs seq_lens >= 1 (the query's own token); got {seq_lens}"
    )
    entries = page_entries(kv, seq_lens)
    layout = HeadLayout(num_heads, kv.num_kv_heads, per_query_head=variant == "naive")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    device = q.device if compute else None

    def run(counter: TrafficCounter) -> torch.Tensor | None:
        outs = []
        for b, n in enumerate(seq_lens):
            problem = AttnProblem(
                q=q[b : b + 1] if compute else None, q_len=1, q_pos0=n - 1, head_dim=head_dim, dtype=q.dtype,
                layout=layout, causal=True, scale=scale, tile_q=1, tile_kv=tile_kv,
            )  # fmt: skip
            source = PagedKVRange(kv, entries[b], 0, n, device)
            outs.append(q_outer(problem, [source], counter, compute))
        if not compute:
            return None
        return torch.cat(outs) if outs else torch.empty_like(q)

    return counted(counter, run)
