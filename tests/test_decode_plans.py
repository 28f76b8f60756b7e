"""The CUDA decode op's host-side parts, checked on the CPU: split plans, the page-table and cluster caps, the stream
schedule and ring plan, the closed-form traffic and argument validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.decode_attention import (
    CLUSTER_MAX,
    HOST_MIN_TILES_PER_SPLIT,
    TABLE_CAP,
    decode_attention,
    heads_per_cta,
    plan_splits,
    table_cap_tiles,
    table_min_splits,
    traffic,
    use_cluster_merge,
)
from directkv.kernels.cuda.stream_plan import host_pages, plan_stream, stream_schedule
from directkv.kernels.paged import PagedKV
from directkv.kernels.reference import decode_attention as reference_decode
from directkv.kernels.reference.fixtures import random_paged_kv


@pytest.mark.parametrize("groups", [1, 8, 32, 512, 4096])
@pytest.mark.parametrize("max_tiles", [1, 3, 64, 2048])
def test_plan_splits_covers_every_tile(groups, max_tiles):
    splits, per = plan_splits(groups, max_tiles, slots=264)
    assert splits * per >= max_tiles and (splits - 1) * per < max_tiles  # no empty trailing split
    assert per >= min(2, max_tiles) or splits == 1
    # small batches are split to fill the GPU, down to two tiles a split
    assert groups * splits >= min(264, groups * math.ceil(max_tiles / 2))
    assert plan_splits(groups, max_tiles, 264, num_splits=1) == (1, max_tiles)


@pytest.mark.parametrize("groups", [8, 16, 128, 512])
@pytest.mark.parametrize("max_tiles", [1, 64, 128, 2048, 8192])
def test_plan_splits_host_only(groups, max_tiles):
    # all pages on the host: about half the resident slots (one CTA per SM for tiled), >= 16 tiles a split, at most
    # CLUSTER_MAX splits, but never more tiles in a split than its page-table entries in shared memory allow
    splits, per = plan_splits(groups, max_tiles, slots=264, host_only=True, cap_tiles=128)
    assert splits * per >= max_tiles and (splits - 1) * per < max_tiles
    assert per <= 128
    assert per >= min(HOST_MIN_TILES_PER_SPLIT, max_tiles) or per == 128 or splits == 1
    assert groups * splits <= 132 or per == 128 or splits == 1  # at most one CTA per SM, unless the cap asks more
    assert splits <= CLUSTER_MAX or per == 128
    assert plan_splits(8, 64, 264, host_only=True, cap_tiles=128) == (4, 16)  # 4K x 1, Llama: 32 CTAs
    assert plan_splits(8, 2048, 264, host_only=True, cap_tiles=128) == (16, 128)  # 128K x 1: 128 CTAs, not 136
    assert plan_splits(8, 512, 264, host_only=True, cap_tiles=128) == (8, 64)  # 32K x 1: one cluster of 8 splits
    assert plan_splits(8, 256, 264, host_only=True, cap_tiles=128) == (8, 32)  # 16K x 1
    assert plan_splits(8, 1024, 264, host_only=True, cap_tiles=128) == (8, 128)  # 64K x 1: as many as the cap asks


def test_planned_split_fits_the_kernels_page_table_cap():
    header = (Path(__file__).parents[1] / "csrc/include/directkv/decode_attention.cuh").read_text()
    assert f"constexpr int kDecodeTableCap = {TABLE_CAP};" in header
    assert table_cap_tiles(16, 64) == 128 and table_cap_tiles(128, 64) == 1022 and table_cap_tiles(64, 64) == 512
    # a long sequence in a large batch asks for one split, but gets enough to keep each in the cap
    assert plan_splits(512, 2048, 264, cap_tiles=128) == (16, 128)
    # callers that force a split count (the pipelined path's side CTAs) raise it to this
    assert [table_min_splits(w, 16) for w in (1, 512, 513, 563, 8192)] == [1, 1, 2, 2, 16]
    assert table_min_splits(511, 128) == 1 and table_min_splits(512, 128) == 2


def test_cluster_merge_is_chosen_for_host_only_launches_of_2_to_8_splits():
    header = (Path(__file__).parents[1] / "csrc/include/directkv/decode_attention.cuh").read_text()
    assert f"constexpr int kDecodeClusterMax = {CLUSTER_MAX};" in header
    assert [use_cluster_merge(True, s) for s in (1, 2, 8, 9, 16)] == [False, True, True, False, False]
    assert not use_cluster_merge(False, 4)  # pages in HBM: the global merge, as measured before
    assert not use_cluster_merge(True, 4, enabled=False) and use_cluster_merge(True, 4, enabled=True)
    assert plan_splits(8, 64, 264, host_only=True, cap_tiles=128)[0] == 4  # 4K x 1, Llama: clusters of 4


def test_heads_per_cta():
    assert [heads_per_cta("tiled", g) for g in (1, 2, 4, 8, 16, 6, 3)] == [1, 2, 4, 8, 8, 2, 1]
    assert heads_per_cta("naive", 8) == 1


@pytest.mark.parametrize("chunk_pages", [1, 3, 64])
def test_stream_schedule_covers_every_token_once(chunk_pages):
    lens = [1, 15, 16, 17, 200, 64]
    kv = random_paged_kv(lens, page_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float16, hbm_fraction=0.3,
                         generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    tables, plens, copies, hbm_pass = stream_schedule(kv.block_table, kv.seq_lens, 16, chunk_pages)
    # read by raw pointer on the GPU: int32 tables and lens, int64 [runs, 3] row-major copies
    assert tables.dtype == plens.dtype == torch.int32 and tables.is_contiguous() and plens.is_contiguous()
    assert all(c.dtype == torch.int64 and c.is_contiguous() and c.shape[1:] == (3,) for c in copies)
    used_hbm = any(int(kv.block_table[b, j]) < 0 for b, n in enumerate(lens) for j in range(math.ceil(n / 16)))
    assert hbm_pass == used_hbm and tables.shape[0] == len(copies) + used_hbm
    got: list[list[tuple[int, int]]] = [[] for _ in lens]
    for c in range(tables.shape[0]):
        ring = {}
        if c < len(copies):
            assert sum(n for _, _, n in copies[c].tolist()) <= chunk_pages
            for src, dst, n in copies[c].tolist():
                ring.update({dst + i: src + i for i in range(n)})
        for b in range(len(lens)):
            n = int(plens[c, b])
            for j in range(math.ceil(n / 16)):
                e = int(tables[c, b, j])
                entry = ring[-(e + 1)] if c < len(copies) else e
                assert (entry >= 0) == (c < len(copies))
                got[b].append((entry, min(16, n - 16 * j)))
    for b, n in enumerate(lens):
        want = [(int(kv.block_table[b, j]), min(16, n - 16 * j)) for j in range(math.ceil(n / 16))]
        assert sorted(got[b]) == sorted(want)


def test_traffic_matches_reference_counting():
    kv = random_paged_kv([1, 63, 65, 1000], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                         hbm_fraction=0.5, generator=torch.Generator().manual_seed(3))
    meta = PagedKV(*(t.to("meta") for t in (kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v)), kv.block_table, kv.seq_lens)
    q = torch.empty(4, 8, 64, dtype=torch.bfloat16, device="meta")
    for variant in ("naive", "tiled"):
        _, counted = reference_decode(q, meta, variant=variant, compute=False)
        assert traffic(kv, num_heads=8, variant=variant) == counted
    stream, tiled = traffic(kv, num_heads=8, variant="stream"), traffic(kv, num_heads=8, variant="tiled")
    assert stream.link_read_bytes == tiled.link_read_bytes
    assert stream.hbm_write_bytes == tiled.hbm_write_bytes + tiled.link_read_bytes


def test_bad_arguments_raise_config_error():
    kv = random_paged_kv([10], page_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float16)
    q = torch.randn(1, 2, 64).to(torch.float16)
    with pytest.raises(ConfigError, match="variant"):
        decode_attention(q, kv, variant="fast")
    with pytest.raises(ConfigError, match="tile_kv"):
        decode_attention(q, kv, variant="tiled", tile_kv=48)
    with pytest.raises(ConfigError, match="CUDA"):
        decode_attention(q, kv, variant="tiled")  # CPU tensors


@pytest.mark.parametrize("chunk_pages", [1, 3, 64])
@pytest.mark.parametrize("seed,hbm_fraction", [(0, 0.3), (1, 0.3), (2, 0.0), (3, 1.0)])
def test_last_token_slots_point_at_the_ring_copy_of_each_last_token(chunk_pages, seed, hbm_fraction):
    """The rows a call writes last_kv to: for every sequence whose last token's page is read from host memory,
    the chunk that copies that page and the token's row within the chunk's ring slot."""
    from directkv.kernels.cuda.stream_plan import _last_token_slots

    lens = [1, 15, 16, 17, 200, 64, 0]
    kv = random_paged_kv(lens, page_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                         hbm_fraction=hbm_fraction, generator=torch.Generator().manual_seed(seed))
    hp = host_pages(kv.block_table, kv.seq_lens, 16)
    _, _, copies, _ = stream_schedule(kv.block_table, kv.seq_lens, 16, chunk_pages, hp=hp)
    rows, at, chunks = _last_token_slots(hp, kv.seq_lens, 16, chunk_pages)
    # per chunk: ring slot page -> host page
    in_slot = [{dst + i: src + i for src, dst, n in runs.tolist() for i in range(n)} for runs in copies]
    want = [b for b, n in enumerate(lens) if n and int(kv.block_table[b, (n - 1) // 16]) >= 0]
    assert rows.tolist() == want
    for b, r, c in zip(rows.tolist(), at.tolist(), chunks.tolist(), strict=True):
        assert in_slot[c][r // 16] == int(kv.block_table[b, (lens[b] - 1) // 16]) and r % 16 == (lens[b] - 1) % 16


@pytest.mark.parametrize("seed,hbm_fraction", [(0, 0.0), (1, 0.3), (2, 1.0), (3, 0.0)])
def test_plan_stream_on_the_cpu_with_a_stand_in_ring(monkeypatch, seed, hbm_fraction):
    """plan_stream's host side without a GPU (its ring and copy stream stood in by CPU tensors): the passes and
    lens it hands the kernels are stream_schedule's, as contiguous int32 views per pass, and each last-token
    entry names the sequence and, per ring slot, the flat ring row its page's copy lands on."""
    from directkv.kernels.cuda import stream_plan

    monkeypatch.setattr(stream_plan, "new_ring", lambda shape, dtype, device, slots, side=None: (
        torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), None, [None] * slots, [None] * slots))
    lens = [1, 15, 16, 17, 200, 64, 0, 333]
    kv = random_paged_kv(lens, page_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                         hbm_fraction=hbm_fraction, generator=torch.Generator().manual_seed(seed))
    plan = plan_stream(kv, chunk_bytes=12 * 16 * 64 * 2, min_chunk_bytes=1)  # <= 12 pages per chunk: a few chunks
    read = len(host_pages(kv.block_table, kv.seq_lens, 16).pages)
    chunk = stream_plan.balanced_chunk_pages(max(read, 1), 12)
    tables, plens, copies, hbm_pass = stream_schedule(kv.block_table, kv.seq_lens, 16, chunk)
    sizes = [int(c[:, 2].sum()) for c in copies]
    assert sum(sizes) == read and all(n <= 12 for n in sizes)
    assert max(sizes, default=0) - min(sizes, default=0) <= max(len(sizes) - 1, 0)  # equal chunks, no short tail
    assert torch.equal(plan.passes, tables) and torch.equal(plan.lens, plens) and plan.hbm_pass == hbm_pass
    assert plan.passes.dtype == plan.lens.dtype == torch.int32  # torch.equal does not compare dtypes
    assert all(c.dtype == torch.int64 and c.is_contiguous() and c.shape[1:] == (3,) for c in plan.copies)
    assert [c.tolist() for c in plan.copies] == [c.tolist() for c in copies]
    slot_rows = plan.ring_k.shape[1] * 16
    seen = set()
    for c, entry in enumerate(plan.last):
        if entry is None:
            continue
        rows, at = entry
        pages = {dst + i: src + i for src, dst, n in copies[c].tolist() for i in range(n)}  # ring page -> host page
        for s, rows_in_slot in enumerate(at):
            assert rows_in_slot.dtype == torch.int64  # scatter_rows' index type
            for b, r in zip(rows.tolist(), rows_in_slot.tolist(), strict=True):
                r -= s * slot_rows
                assert pages[r // 16] == int(kv.block_table[b, (lens[b] - 1) // 16]) and r % 16 == (lens[b] - 1) % 16
        seen |= set(rows.tolist())
    in_first = {src + i for c in copies[: len(plan.last)] for src, _, n in c.tolist() for i in range(n)}
    want = {b for b, n in enumerate(lens) if n and int(kv.block_table[b, (n - 1) // 16]) in in_first}
    assert seen == want and len(plan.last) == min(2, len(copies)) and (len(seen) >= 2 or hbm_fraction == 1.0)


@pytest.mark.parametrize("read,most,want", [(1025, 512, [342, 342, 341]), (1024, 512, [512, 512]), (1, 512, [1]),
                                            (513, 512, [257, 256]), (7, 2, [2, 2, 2, 1])])
def test_balanced_chunks_are_equal_and_no_more(read, most, want):
    """Chunks of one size (the last short by fewer pages than there are chunks), none over `most`, as few as
    chunks of `most` would be: a one-page last chunk (1025 pages as 512 + 512 + 1) left the copy engine idle
    while the kernel before it freed a ring slot."""
    from directkv.kernels.cuda.stream_plan import balanced_chunk_pages, chunk_runs

    pages = balanced_chunk_pages(read, most)
    assert [int(c[:, 2].sum()) for c in chunk_runs(torch.arange(read), pages)] == want
    for r in range(1, 700):
        for m in (1, 2, 3, 7, 64, 512):
            n = balanced_chunk_pages(r, m)
            assert 1 <= n <= m and -(-r // n) == -(-r // m) and r - (-(-r // n) - 1) * n > n - -(-r // n)


def test_stream_schedule_of_no_tokens_has_no_pass():
    """Every sequence empty: no copies and no pass (the call then writes zeros), not a stack of nothing."""
    tables, lens, copies, hbm_pass = stream_schedule(torch.tensor([[3, 4], [5, 0]], dtype=torch.int32),
                                                     torch.zeros(2, dtype=torch.int32), 16, 8)
    assert tables.shape == (0, 2, 1) and lens.shape == (0, 2) and copies == [] and not hbm_pass
