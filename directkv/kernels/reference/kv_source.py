"""Where a schedule's K/V tiles come from, and what reading (or writing) one costs.

A source covers absolute token positions [start, end) of one sequence. `read(k0, k1, ...)` returns the
tile's K and V as float32 `[k1 - k0, num_kv_heads, head_dim]` and counts its bytes on the tier they live
in: a tile of the paged cache is read page segment by page segment, so a tile spanning host and hbm
pages is charged to each tier for exactly the tokens it holds there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from directkv.kernels.paged import PagedKV
from directkv.kernels.traffic import TrafficCounter

KVTile = tuple[torch.Tensor, torch.Tensor]


class KVSource(Protocol):
    start: int
    end: int

    def read(
        self, k0: int, k1: int, counter: TrafficCounter, copies: int, compute: bool
    ) -> KVTile | None: ...


def tier_of(entry: int) -> str:
    return "host" if entry >= 0 else "hbm"


class PagedKVRange:
    """Tokens [start, end) of one sequence of a PagedKV, addressed through its block-table entries.

    `entries` are the sequence's validated block-table entries (see `common.page_entries`); `device` is
    where tiles are returned for the math (the pools may sit elsewhere, e.g. pinned host memory).
    """

    def __init__(self, kv: PagedKV, entries: list[int], start: int, end: int, device: torch.device | None):
        self.kv, self.entries, self.start, self.end, self.device = kv, entries, start, end, device
        self.page_size = kv.page_size
        self.token_bytes = 2 * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize  # K and V

    def segments(self, k0: int, k1: int) -> Iterator[tuple[int, int, int]]:
        """(entry, first slot, end slot) of each page that tokens [k0, k1) touch, in order."""
        size = self.page_size
        for page in range(k0 // size, (k1 - 1) // size + 1):
            base = page * size
            yield self.entries[page], max(k0, base) - base, min(k1, base + size) - base

    def read(self, k0: int, k1: int, counter: TrafficCounter, copies: int, compute: bool) -> KVTile | None:
        ks, vs = [], []
        for entry, a, b in self.segments(k0, k1):
            counter.read(copies * (b - a) * self.token_bytes, tier_of(entry))
            if compute:
                k_page, v_page, _ = self.kv.page(entry)
                ks.append(k_page[a:b])
                vs.append(v_page[a:b])
        if not compute:
            return None
        return (
            torch.cat(ks).to(device=self.device, dtype=torch.float32),
            torch.cat(vs).to(device=self.device, dtype=torch.float32),
        )

    def write(self, k0: int, k1: int, tile: KVTile | None, counter: TrafficCounter, compute: bool) -> None:
        """Store tokens [k0, k1): tile = (k, v) `[k1 - k0, num_kv_heads, head_dim]`, None when counting only."""
        done = 0
        for entry, a, b in self.segments(k0, k1):
            counter.write((b - a) * self.token_bytes, tier_of(entry))
            if compute:
                k_page, v_page, _ = self.kv.page(entry)
                k_page[a:b].copy_(tile[0][done : done + b - a])
                v_page[a:b].copy_(tile[1][done : done + b - a])
            done += b - a


class DenseKVRange:
    """K/V already contiguous in HBM (e.g. just projected): k, v `[end - start, num_kv_heads, head_dim]`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, start: int):
        self.k, self.v, self.start, self.end = k, v, start, start + int(k.shape[0])
        self.token_bytes = 2 * int(k.shape[1]) * int(k.shape[2]) * k.dtype.itemsize

    def read(self, k0: int, k1: int, counter: TrafficCounter, copies: int, compute: bool) -> KVTile | None:
        counter.read(copies * (k1 - k0) * self.token_bytes, "hbm")
        if not compute:
            return None
        rows = slice(k0 - self.start, k1 - self.start)
        return self.k[rows].float(), self.v[rows].float()
