"""K/V projection (+ RoPE) and attention of one sequence, as two kernels or one fused kernel.

* "separate": a projection kernel writes Q to HBM and the new K/V to their cache pages; the tiled
  attention then reads past and new K/V back from the pages (the new K/V cross the link twice).
* "fused": Q is projected to HBM first (the Q tiles must be HBM-resident for the stationary-K/V loop);
  each new K/V tile is projected inside the attention loop from x, written to its pages once and used
  directly, never read back.

Both run the K/V-stationary (`kv_outer`) attention with the same tiles and round Q, K and V to the cache
dtype before use, so their outputs agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from directkv.errors import check
from directkv.kernels.paged import PagedKV
from directkv.kernels.reference.common import check_tiles, check_variant, counted, page_entries
from directkv.kernels.reference.kv_source import KVTile, PagedKVRange
from directkv.kernels.reference.online_softmax import HeadLayout
from directkv.kernels.reference.prefill import check_prefill_cache
from directkv.kernels.reference.rope import apply_rope
from directkv.kernels.reference.schedules import AttnProblem, kv_outer
from directkv.kernels.traffic import Traffic, TrafficCounter

PROJ_VARIANTS = ("fused", "separate")


class _Projector:
    """Row tiles of x `[q_len, hidden]` times weights `[hidden, heads * head_dim]`, all in HBM.

    One call reads the x rows once and each weight once (a row tile of a GEMM that keeps its x rows on
    chip); outputs are `[rows, heads, head_dim]` rounded to the cache dtype, None when counting.
    """

    def __init__(
        self, x: torch.Tensor, head_dim: int, past_len: int, rope_theta: float | None, compute: bool
    ):
        self.x, self.head_dim, self.past_len = x, head_dim, past_len
        self.rope_theta, self.compute = rope_theta, compute
        self.hidden = int(x.shape[1])

    def project(
        self, r0: int, r1: int, weights: Sequence[tuple[torch.Tensor, bool]], counter: TrafficCounter
    ) -> list[torch.Tensor | None]:
        """weights: (w, apply_rope) pairs; rows r0..r1-1 are new tokens at positions past_len + r."""
        counter.read((r1 - r0) * self.hidden * self.x.dtype.itemsize, "hbm")
        outs: list[torch.Tensor | None] = []
        for w, rotate in weights:
            counter.read(w.numel() * w.dtype.itemsize, "hbm")
            counter.compute(2 * (r1 - r0) * self.hidden * int(w.shape[1]))
            if not self.compute:
                outs.append(None)
                continue
            y = (self.x[r0:r1].float() @ w.float()).reshape(r1 - r0, -1, self.head_dim)
            if rotate and self.rope_theta is not None:
                y = apply_rope(y, self.past_len + r0, self.rope_theta)
            outs.append(y.to(self.x.dtype))
        return outs


class _ProjectedKVRange:
    """The fused kernel's new K/V: each tile projected from x when the loop reaches it, stored to its pages
    once (storer warps) and handed to the attention without a read back."""

    def __init__(self, projector: _Projector, wk: torch.Tensor, wv: torch.Tensor, pages: PagedKVRange):
        self.projector, self.wk, self.wv, self.pages = projector, wk, wv, pages
        self.start, self.end = pages.start, pages.end

    def read(self, k0: int, k1: int, counter: TrafficCounter, copies: int, compute: bool) -> KVTile | None:
        past = self.projector.past_len
        k, v = self.projector.project(k0 - past, k1 - past, [(self.wk, True), (self.wv, False)], counter)
        self.pages.write(k0, k1, (k, v) if compute else None, counter, compute)
        return (k.float(), v.float()) if compute else None


def proj_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    kv: PagedKV,
    *,
    variant: str,
    rope_theta: float | None = None,
    causal: bool = True,
    tile_q: int = 64,
    tile_kv: int = 64,
    sm_scale: float | None = None,
    compute: bool = True,
    counter: TrafficCounter | None = None,
) -> tuple[torch.Tensor | None, Traffic]:
    """Project x to Q, K, V, store the new K/V in the cache in place, and attend.

    Parameters
    ----------
    x : `[q_len, hidden]` in HBM (q_len = 1 is decode).
    wq : `[hidden, num_heads * head_dim]`; wk, wv : `[hidden, num_kv_heads * head_dim]`, in HBM, same dtype
        as x and the cache.
    kv : one-sequence cache holding past_len = kv.seq_lens[0] tokens whose block table already reserves
        pages for past_len + q_len tokens; positions past_len.. are overwritten with the new K (after
        RoPE) and V. seq_lens is not changed (the KV manager owns lengths).
    variant : "separate" or "fused" (see module docstring).
    rope_theta : Llama RoPE base applied to q and k at positions past_len + i; None for no RoPE.
    causal, tile_q, tile_kv, sm_scale, compute, counter : as in `prefill_attention` (tiled schedule).

    Returns
    -------
    (out `[q_len, num_heads, head_dim]` in x.dtype or None, this call's Traffic)
    """
    check_variant("proj_attention", variant, PROJ_VARIANTS)
    check_tiles(tile_q=tile_q, tile_kv=tile_kv)
    check(x.dim() == 2 and x.shape[0] >= 1, f"x must be [q_len >= 1, hidden]; got shape {tuple(x.shape)}")
    q_len, hidden = (int(s) for s in x.shape)
    head_dim, num_kv_heads = kv.head_dim, kv.num_kv_heads
    check(
        wq.dim() == 2 and wq.shape[0] == hidden and wq.shape[1] % head_dim == 0,
        f"wq must be [hidden={hidden}, num_heads * head_dim={head_dim}k]; got shape {tuple(wq.shape)}",
    )
    for name, w in (("wk", wk), ("wv", wv)):
        want = (hidden, num_kv_heads * head_dim)
        check(
            tuple(w.shape) == want,
            f"{name} must be [hidden, num_kv_heads * head_dim] = {want}; got {tuple(w.shape)}",
        )
    for name, t in (("wq", wq), ("wk", wk), ("wv", wv)):
        check(t.dtype == x.dtype, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
    check(
        rope_theta is None or (rope_theta > 0 and head_dim % 2 == 0),
        f"rope_theta must be None or > 0 with an even head_dim; got {rope_theta} with head_dim {head_dim}",
    )
    num_heads = int(wq.shape[1]) // head_dim
    past_len = check_prefill_cache(kv, num_heads, head_dim, x.dtype)
    entries = page_entries(kv, [past_len + q_len])[0]
    device = x.device if compute else None
    projector = _Projector(x, head_dim, past_len, rope_theta, compute)
    past = PagedKVRange(kv, entries, 0, past_len, device)
    new = PagedKVRange(kv, entries, past_len, past_len + q_len, device)
    q_buf = torch.empty(q_len, num_heads, head_dim, dtype=x.dtype, device=x.device) if compute else None
    row_bytes = num_heads * head_dim * x.dtype.itemsize
    problem = AttnProblem(
        q=q_buf, q_len=q_len, q_pos0=past_len, head_dim=head_dim, dtype=x.dtype,
        layout=HeadLayout(num_heads, num_kv_heads, per_query_head=False), causal=causal,
        scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim), tile_q=tile_q, tile_kv=tile_kv,
    )  # fmt: skip

    def run(counter: TrafficCounter) -> torch.Tensor | None:
        weights = [(wq, True)] if variant == "fused" else [(wq, True), (wk, True), (wv, False)]
        for r0 in range(0, q_len, tile_q):
            r1 = min(r0 + tile_q, q_len)
            outs = projector.project(r0, r1, weights, counter)
            counter.write((r1 - r0) * row_bytes, "hbm")  # Q tile to HBM
            if compute:
                q_buf[r0:r1] = outs[0]
            if variant == "separate":
                new.write(
                    past_len + r0, past_len + r1, (outs[1], outs[2]) if compute else None, counter, compute
                )
        new_source = new if variant == "separate" else _ProjectedKVRange(projector, wk, wv, new)
        return kv_outer(problem, [past, new_source], counter, compute)

    return counted(counter, run)
