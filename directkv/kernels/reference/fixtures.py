"""Random paged caches for tests of any backend: pages of both tiers, ids shuffled so no order helps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from directkv.kernels.paged import PagedKV
from directkv.kernels.reference.common import ceil_div


def random_paged_kv(
    reserve_tokens: Sequence[int],
    *,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    hbm_fraction: float = 0.5,
    seq_lens: Sequence[int] | None = None,
    spare_pages: int = 2,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> PagedKV:
    """A PagedKV with pages reserved for reserve_tokens[b] tokens of each sequence b.

    Each page is an HBM page with probability hbm_fraction, else a host page; page ids are a random
    permutation of each pool (plus `spare_pages` unused pages per pool), and the pools hold torch.randn
    values (no data on device "meta"). The block table and seq_lens (default: reserve_tokens) stay on
    the CPU, as the reference backend needs their values.
    """
    pages = [ceil_div(int(n), page_size) for n in reserve_tokens]
    total = sum(pages)
    is_hbm = torch.rand(total, generator=generator) < hbm_fraction
    num_hbm = int(is_hbm.sum())
    num_host = total - num_hbm
    host_ids = torch.randperm(num_host + spare_pages, generator=generator)[:num_host]
    hbm_ids = torch.randperm(num_hbm + spare_pages, generator=generator)[:num_hbm]
    entries = torch.empty(total, dtype=torch.int32)
    entries[~is_hbm] = host_ids.to(torch.int32)
    entries[is_hbm] = -(hbm_ids.to(torch.int32) + 1)
    table = torch.zeros(len(pages), max(pages, default=0) + 1, dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = entries[start : start + count]
        start += count

    def pool(count: int) -> torch.Tensor:
        shape = (count, page_size, num_kv_heads, head_dim)
        if torch.device(device).type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    lens = reserve_tokens if seq_lens is None else seq_lens
    return PagedKV(
        host_k=pool(num_host + spare_pages),
        host_v=pool(num_host + spare_pages),
        hbm_k=pool(num_hbm + spare_pages),
        hbm_v=pool(num_hbm + spare_pages),
        block_table=table,
        seq_lens=torch.tensor(list(lens), dtype=torch.int32),
    )


def hbm_token_count(kv: PagedKV, seq: int, start: int, end: int) -> int:
    """How many of sequence seq's token positions [start, end) sit in HBM pages."""
    size = kv.page_size
    count = 0
    for page in range(start // size, ceil_div(end, size)):
        if int(kv.block_table[seq, page]) < 0:
            count += min(end, (page + 1) * size) - max(start, page * size)
    return count
