"""The two attention loop orders, over the same tile visit.

* `q_outer` (FlashAttention order): for each Q tile, stream every K/V tile it can see; the softmax state
  stays on chip and O is written once. A host K/V tile crosses the link once per Q tile.
* `kv_outer` (CPU-memory-aware tiling): each K/V tile is read once and held stationary while every Q tile
  that can see it is visited; Q and the partial O, m, l go to and from HBM between visits. A Q tile's
  first visit starts from an empty state (nothing to read); its last visit writes the normalised O
  instead of the partial state (no separate pass).

Sources are visited in order, tiles of `tile_kv` tokens starting at each source's start. Under causal
masking a K/V tile is skipped for a Q tile when every key is after every query (FlashAttention's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from directkv.kernels.reference.common import partial_bytes_per_row
from directkv.kernels.reference.kv_source import KVSource, KVTile
from directkv.kernels.reference.online_softmax import HeadLayout, SoftmaxState, causal_allowed
from directkv.kernels.traffic import TrafficCounter


@dataclass(frozen=True)
class AttnProblem:
    """One sequence's queries and how to tile them.

    q `[q_len, num_heads, head_dim]` sits in HBM in `dtype`; None when only counting. Query row i has
    absolute position q_pos0 + i; keys are addressed by absolute position in the sources.
    """

    q: torch.Tensor | None
    q_len: int
    q_pos0: int
    head_dim: int
    dtype: torch.dtype
    layout: HeadLayout
    causal: bool
    scale: float
    tile_q: int
    tile_kv: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one query row of Q (or O) across all heads."""
        return self.layout.num_heads * self.head_dim * self.dtype.itemsize

    def q_tiles(self) -> list[tuple[int, int]]:
        return [(q0, min(q0 + self.tile_q, self.q_len)) for q0 in range(0, self.q_len, self.tile_q)]

    def sees(self, q1: int, k0: int) -> bool:
        """Whether Q tile rows [.., q1) see any key of a tile starting at absolute position k0."""
        return not self.causal or k0 <= self.q_pos0 + q1 - 1


def kv_tiles(sources: Sequence[KVSource], tile_kv: int) -> list[tuple[KVSource, int, int]]:
    return [
        (src, k0, min(k0 + tile_kv, src.end)) for src in sources for k0 in range(src.start, src.end, tile_kv)
    ]


def _visit(
    p: AttnProblem,
    state: SoftmaxState | None,
    q_grouped: torch.Tensor | None,
    kv: KVTile | None,
    q_rows: tuple[int, int],
    k_cols: tuple[int, int],
    counter: TrafficCounter,
) -> SoftmaxState | None:
    """Fold K/V tile k_cols (absolute positions) into Q tile q_rows (row indices); count its FLOPs."""
    (q0, q1), (k0, k1) = q_rows, k_cols
    # QK^T and PV: 2 * head_dim FLOPs each per (query head, key) pair, masked pairs included.
    counter.compute(4 * p.head_dim * p.layout.num_heads * (q1 - q0) * (k1 - k0))
    if state is None:
        return None
    allowed = None
    if p.causal and k1 - 1 > p.q_pos0 + q0:
        allowed = p.layout.group_mask(causal_allowed(p.q_pos0 + q0, p.q_pos0 + q1, k0, k1, state.o.device))
    return state.update(q_grouped, p.layout.group_kv(kv[0]), p.layout.group_kv(kv[1]), p.scale, allowed)


def _empty_state(p: AttnProblem, rows: int) -> SoftmaxState:
    return SoftmaxState.empty(p.layout.readers, p.layout.reader_rows(rows), p.head_dim, p.q.device)


def _new_out(p: AttnProblem) -> torch.Tensor:
    return torch.empty(p.q_len, p.layout.num_heads, p.head_dim, dtype=p.dtype, device=p.q.device)


def _load_q(p: AttnProblem, q0: int, q1: int, counter: TrafficCounter, compute: bool) -> torch.Tensor | None:
    counter.read((q1 - q0) * p.row_bytes, "hbm")
    return p.layout.group_q(p.q[q0:q1].float()) if compute else None


def _store_o(
    p: AttnProblem,
    out: torch.Tensor | None,
    q0: int,
    q1: int,
    state: SoftmaxState | None,
    counter: TrafficCounter,
) -> None:
    counter.write((q1 - q0) * p.row_bytes, "hbm")
    if out is not None:
        out[q0:q1] = p.layout.ungroup(state.finalize(), q1 - q0).to(out.dtype)


def q_outer(
    p: AttnProblem, sources: Sequence[KVSource], counter: TrafficCounter, compute: bool
) -> torch.Tensor | None:
    """FlashAttention order. Returns O `[q_len, num_heads, head_dim]` in p.dtype, or None when counting."""
    out = _new_out(p) if compute else None
    tiles = kv_tiles(sources, p.tile_kv)
    for q0, q1 in p.q_tiles():
        q_grouped = _load_q(p, q0, q1, counter, compute)
        state = _empty_state(p, q1 - q0) if compute else None
        for src, k0, k1 in tiles:
            if p.sees(q1, k0):
                kv = src.read(k0, k1, counter, p.layout.copies, compute)
                state = _visit(p, state, q_grouped, kv, (q0, q1), (k0, k1), counter)
        _store_o(p, out, q0, q1, state, counter)
    return out


def kv_outer(
    p: AttnProblem, sources: Sequence[KVSource], counter: TrafficCounter, compute: bool
) -> torch.Tensor | None:
    """K/V-stationary order. Returns O `[q_len, num_heads, head_dim]` in p.dtype, or None when counting."""
    out = _new_out(p) if compute else None
    tiles = kv_tiles(sources, p.tile_kv)
    q_tiles = p.q_tiles()
    # The planner knows the schedule: a Q tile's last visit is the last tile in order that it sees.
    last = [next(t for t in reversed(range(len(tiles))) if p.sees(q1, tiles[t][1])) for _, q1 in q_tiles]
    partial: list[SoftmaxState | None] = [None] * len(q_tiles)  # the HBM-resident partial O, m, l
    visited = [False] * len(q_tiles)
    partial_bytes = partial_bytes_per_row(p.layout.num_heads, p.head_dim)
    for t, (src, k0, k1) in enumerate(tiles):
        kv = src.read(k0, k1, counter, p.layout.copies, compute)
        for i, (q0, q1) in enumerate(q_tiles):
            if not p.sees(q1, k0):
                continue
            q_grouped = _load_q(p, q0, q1, counter, compute)
            if visited[i]:
                counter.read((q1 - q0) * partial_bytes, "hbm")
                state = partial[i]
            else:
                state = _empty_state(p, q1 - q0) if compute else None
            state = _visit(p, state, q_grouped, kv, (q0, q1), (k0, k1), counter)
            visited[i] = True
            if t == last[i]:
                _store_o(p, out, q0, q1, state, counter)
                partial[i] = None
            else:
                counter.write((q1 - q0) * partial_bytes, "hbm")
                partial[i] = state
    return out
