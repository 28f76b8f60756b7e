"""The paged KV view every attention op takes, whichever backend runs it.

One layer's KV lives in two page pools, one per tier. A block-table entry `e >= 0` names host page
`e`; `e < 0` names HBM page `-(e + 1)`. The CUDA backend passes both pool base pointers to the kernel;
in a CUDA run the host pools are zero-copy CUDA views of pinned memory, so no page is staged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from directkv.errors import check

T = TypeVar("T")


@dataclass(frozen=True)
class PagedKV:
    host_k: torch.Tensor  # [num_host_pages, page_size, num_kv_heads, head_dim]
    host_v: torch.Tensor  # [num_host_pages, page_size, num_kv_heads, head_dim]
    hbm_k: torch.Tensor  # [num_hbm_pages, page_size, num_kv_heads, head_dim] (num_hbm_pages may be 0)
    hbm_v: torch.Tensor  # [num_hbm_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [batch, max_pages_per_seq] int32, see module docstring
    seq_lens: torch.Tensor  # [batch] int32, tokens held per sequence

    def __post_init__(self) -> None:
        if self.host_k.shape != self.host_v.shape or self.hbm_k.shape != self.hbm_v.shape:
            raise ValueError("K and V pools of a tier must have the same shape")
        if self.host_k.shape[1:] != self.hbm_k.shape[1:]:
            raise ValueError(f"host pages {tuple(self.host_k.shape[1:])} != hbm pages {tuple(self.hbm_k.shape[1:])}")
        if self.block_table.dim() != 2 or self.seq_lens.shape != (self.block_table.shape[0],):
            raise ValueError(
                f"block_table must be [batch, max_pages] and seq_lens [batch]; got "
                f"{tuple(self.block_table.shape)} and {tuple(self.seq_lens.shape)}"
            )

    @property
    def page_size(self) -> int:
        return int(self.host_k.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.host_k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.host_k.shape[3])

    @property
    def batch(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.host_k.dtype

    def page(self, entry: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(k_page, v_page, tier) for one block-table entry; pages are [page_size, num_kv_heads, head_dim]."""
        if entry >= 0:
            return self.host_k[entry], self.host_v[entry], "host"
        return self.hbm_k[-(entry + 1)], self.hbm_v[-(entry + 1)], "hbm"

    def gather(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V of one sequence, [seq_len, num_kv_heads, head_dim]; for references and tests."""
        n = int(self.seq_lens[seq])
        pages = (n + self.page_size - 1) // self.page_size
        ks, vs = zip(*(self.page(int(e))[:2] for e in self.block_table[seq, :pages].tolist()), strict=True) if pages else ((), ())
        if not pages:
            empty = self.host_k.new_empty((0, self.num_kv_heads, self.head_dim))
            return empty, empty.clone()
        return torch.cat(ks)[:n], torch.cat(vs)[:n]


def slot_runs(pages: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray, page_size: int
              ) -> list[tuple[int, int]]:
    """(first flat slot, slots) of each contiguous stretch of valid slots in a page pool.

    `pages[j]` holds `tokens[j]` valid slots (its first ones; 0 < tokens[j] <= page_size, or the page is not
    read). Attention with no mask inside the set does not care about key order, so pages are taken in id order:
    consecutive ids join one run while the earlier page is full; a partly filled page ends its run, so every
    run's valid slots are contiguous. Array work (numpy): a serving step plans its prompt chunk's runs before
    its first copy (plan_prefill_stream), and a Python loop over a 32K past's 2,000 pages took 0.66 ms of it
    (0.07 ms now; plan_prefill_stream 1.6 -> 0.8 ms; 2-core CI host, 2026-12-02).
    """
    p, t = np.asarray(pages, dtype=np.int64).ravel(), np.asarray(tokens, dtype=np.int64).ravel()
    check(p.shape == t.shape, f"one token count per page; got {p.size} pages and {t.size} counts")
    most = int(t.max()) if t.size else 0  # once: the message below is built on every call
    check(most <= page_size, f"a page holds at most page_size = {page_size} tokens; got a count of {most}")
    order = np.lexsort((t, p))
    p, t = p[order], t[order]
    p, t = p[t > 0], t[t > 0]
    if not p.size:
        return []
    starts = np.ones(p.size, dtype=bool)
    starts[1:] = (p[1:] != p[:-1] + 1) | (t[:-1] != page_size)
    first = np.flatnonzero(starts)
    return list(zip((p[first] * page_size).tolist(), np.add.reduceat(t, first).tolist(), strict=True))


def sequence_runs(pages: Sequence[int] | np.ndarray, n: int, page_size: int) -> list[tuple[int, int]]:
    """slot_runs of a sequence whose first n tokens sit in `pages` (logical order: only the last may be partial)."""
    return slot_runs(pages, np.minimum(page_size, n - np.arange(len(pages), dtype=np.int64) * page_size), page_size)


def check_queries(q: torch.Tensor, kv: PagedKV, *, rows: str) -> tuple[int, int, int]:
    """The checks every attention op makes of its queries `[rows, num_heads, head_dim]` against the cache:
    3-D, the cache's head_dim and dtype, whole GQA groups. Returns (rows, num_heads, head_dim); each backend
    adds its own (what its kernels support, devices, the batch or one-sequence rule)."""
    check(q.dim() == 3, f"q must be [{rows}, num_heads, head_dim]; got shape {tuple(q.shape)}")
    n, num_heads, head_dim = (int(s) for s in q.shape)
    check(head_dim == kv.head_dim, f"q head_dim {head_dim} != kv head_dim {kv.head_dim}")
    check(num_heads % kv.num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {kv.num_kv_heads}")
    check(q.dtype == kv.dtype, f"q dtype {q.dtype} != KV dtype {kv.dtype}")
    return n, num_heads, head_dim


def per_table(memo: dict, table: torch.Tensor, key: tuple, make: Callable[[], T]) -> T:
    """make(), memoised in `memo` per block table (the tensor object and its in-place version) and `key`: the
    wrappers read a table on the CPU once per version, not once per call. The weakref keeps a new table at a
    recycled address from hitting an old entry; the memo is dropped past 256 entries."""
    full = (id(table), table._version, *key)
    ref, value = memo.get(full, (None, None))
    if ref is None or ref() is not table:
        if len(memo) > 256:
            memo.clear()
        value = make()
        memo[full] = (weakref.ref(table), value)
    return value
