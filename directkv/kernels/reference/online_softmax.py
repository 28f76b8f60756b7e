"""The online-softmax tile update every attention schedule shares, and the head grouping of a reader.

A *reader* is what one CTA of the CUDA kernels owns: a set of query rows that read the same K/V head. The
GQA-aware grouping puts all query heads of a KV head into one reader, so each K/V byte is read once per
tile; the per-query-head grouping (a GQA-unaware kernel) gives every query head its own reader, so each
K/V head is read gqa_ratio times. Math runs in float32; the state (O, m, l) is what the tiled schedules
keep in HBM between visits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadLayout:
    """Maps query tiles and K/V tiles to readers: `[readers, rows, head_dim]` batches.

    Query head h reads KV head h // gqa_ratio (consecutive query heads share a KV head).
    """

    num_heads: int
    num_kv_heads: int
    per_query_head: bool

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def copies(self) -> int:
        """How many readers read each KV head of a tile: the factor on K/V bytes."""
        return self.gqa_ratio if self.per_query_head else 1

    @property
    def readers(self) -> int:
        return self.num_heads if self.per_query_head else self.num_kv_heads

    def reader_rows(self, rows: int) -> int:
        """Rows of one reader for a tile of `rows` query tokens."""
        return rows if self.per_query_head else rows * self.gqa_ratio

    def group_q(self, q: torch.Tensor) -> torch.Tensor:
        """`[rows, num_heads, head_dim]` -> `[readers, reader_rows, head_dim]`."""
        rows, _, dim = q.shape
        if self.per_query_head:
            return q.permute(1, 0, 2)
        grouped = q.reshape(rows, self.num_kv_heads, self.gqa_ratio, dim).permute(1, 0, 2, 3)
        return grouped.reshape(self.num_kv_heads, rows * self.gqa_ratio, dim)  # row = token * gqa + g

    def ungroup(self, o: torch.Tensor, rows: int) -> torch.Tensor:
        """Inverse of `group_q`: `[readers, reader_rows, head_dim]` -> `[rows, num_heads, head_dim]`."""
        dim = o.shape[-1]
        if self.per_query_head:
            return o.permute(1, 0, 2)
        grouped = o.reshape(self.num_kv_heads, rows, self.gqa_ratio, dim).permute(1, 0, 2, 3)
        return grouped.reshape(rows, self.num_heads, dim)

    def group_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """`[cols, num_kv_heads, head_dim]` -> `[readers, cols, head_dim]` (per-head readers get copies)."""
        if self.per_query_head:
            kv = kv.repeat_interleave(self.gqa_ratio, dim=1)
        return kv.permute(1, 0, 2)

    def group_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """`[rows, cols]` token mask -> `[reader_rows, cols]`."""
        return allowed if self.per_query_head else allowed.repeat_interleave(self.gqa_ratio, dim=0)


@dataclass
class SoftmaxState:
    """Running attention state of some query rows: o `[readers, rows, head_dim]` (unnormalised), running
    max m and running sum l `[readers, rows]`, all float32."""

    o: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741  (the paper's name)

    @classmethod
    def empty(cls, readers: int, rows: int, head_dim: int, device: torch.device) -> SoftmaxState:
        return cls(
            o=torch.zeros(readers, rows, head_dim, dtype=torch.float32, device=device),
            m=torch.full((readers, rows), float("-inf"), dtype=torch.float32, device=device),
            l=torch.zeros(readers, rows, dtype=torch.float32, device=device),
        )

    def update(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        allowed: torch.Tensor | None,
    ) -> SoftmaxState:
        """Fold one K/V tile into the state.

        q `[readers, rows, head_dim]`, k and v `[readers, cols, head_dim]` (float32), allowed
        `[rows, cols]` bool or None (all visible).
        """
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(self.m, s.amax(dim=-1))
        # A row that has seen only masked keys keeps m = -inf; subtract 0 there so exp gives 0, not NaN.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - shift[..., None])
        alpha = torch.exp(self.m - shift)
        return SoftmaxState(
            o=self.o * alpha[..., None] + torch.matmul(p, v),
            m=m_new,
            l=self.l * alpha + p.sum(dim=-1),
        )

    def finalize(self) -> torch.Tensor:
        """Normalised output `[readers, rows, head_dim]` float32."""
        return self.o / self.l[..., None]


def causal_allowed(q_start: int, q_end: int, k_start: int, k_end: int, device: torch.device) -> torch.Tensor:
    """`[q_end - q_start, k_end - k_start]` bool: the query at absolute position i sees key j iff j <= i."""
    q_pos = torch.arange(q_start, q_end, device=device)
    k_pos = torch.arange(k_start, k_end, device=device)
    return k_pos[None, :] <= q_pos[:, None]
