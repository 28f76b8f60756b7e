"""Checks and bookkeeping shared by the reference ops: variant and tile validation, paged block-table
validation, and the per-call traffic record."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from directkv.errors import ConfigError, check, unknown_name
from directkv.kernels.paged import PagedKV
from directkv.kernels.traffic import Traffic, TrafficCounter

T = TypeVar("T")

# Partial softmax state kept in HBM between visits, per query row and head: O (head_dim float32) plus the
# running max m and running sum l (one float32 each).
STAT_BYTES = 4


def check_variant(op: str, variant: str, valid: Sequence[str]) -> None:
    if variant not in valid:
        raise unknown_name(f"{op} variant", variant, valid)


def check_tiles(**tiles: int) -> None:
    for name, size in tiles.items():
        check(isinstance(size, int) and size >= 1, f"{name} must be a positive int; got {size!r}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def partial_bytes_per_row(num_heads: int, head_dim: int) -> int:
    """HBM bytes of one query row's partial O, m and l across all heads (all float32)."""
    return num_heads * (head_dim + 2) * STAT_BYTES


def counted(counter: TrafficCounter | None, body: Callable[[TrafficCounter], T]) -> tuple[T, Traffic]:
    """Run `body(counter)` and return its result with the traffic it added.

    A caller-supplied counter accumulates across calls; the returned Traffic is this call's share only.
    """
    counter = counter if counter is not None else TrafficCounter()
    before = counter.traffic.as_dict()
    result = body(counter)
    after = counter.traffic.as_dict()
    return result, Traffic(**{key: after[key] - before[key] for key in after})


def page_entries(kv: PagedKV, tokens: Sequence[int]) -> list[list[int]]:
    """Validated block-table entries covering `tokens[b]` tokens of each sequence b.

    Returns one list per sequence of the entries (e >= 0 host page e, e < 0 hbm page -(e + 1)) of its
    first ceil(tokens[b] / page_size) pages. The block table and seq_lens must hold values (cpu or cuda);
    only the page pools may be on device "meta".
    """
    table, lens = kv.block_table, kv.seq_lens
    check(
        table.device.type != "meta" and lens.device.type != "meta",
        "PagedKV.block_table and seq_lens must hold values (cpu or cuda), not meta; only the pools may be meta",
    )
    check(
        not table.is_floating_point() and not table.is_complex(),
        f"PagedKV.block_table must be an integer tensor; got {table.dtype}",
    )
    page_size = kv.page_size
    pages = torch.tensor([ceil_div(int(n), page_size) for n in tokens], dtype=torch.int64)
    table = table.cpu().to(torch.int64)
    too_long = (pages > table.shape[1]).nonzero()
    if len(too_long):
        b = int(too_long[0])
        raise ConfigError(
            f"sequence {b} needs {int(pages[b])} pages for {tokens[b]} tokens of page_size {page_size}; "
            f"the block table has {table.shape[1]} columns"
        )
    used = torch.arange(table.shape[1])[None, :] < pages[:, None]
    num_host, num_hbm = int(kv.host_k.shape[0]), int(kv.hbm_k.shape[0])
    bad = (used & ((table >= num_host) | (table < -num_hbm))).nonzero()
    if len(bad):
        b, col = (int(i) for i in bad[0])
        raise ConfigError(
            f"block_table[{b}, {col}] = {int(table[b, col])} names no page; valid entries are "
            f"0..{num_host - 1} (host) and -1..-{num_hbm} (hbm)"
        )
    return [table[b, : int(pages[b])].tolist() for b in range(len(tokens))]
