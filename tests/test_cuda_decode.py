"""CUDA decode attention against a float64 dense reference on the GPU (its host-side plans: test_decode_plans.py)."""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.decode_attention import CLUSTER_MAX, decode_attention, prefetch_stream, traffic
from directkv.kernels.cuda.stream_plan import plan_stream
from directkv.kernels.paged import PagedKV
from directkv.kernels.reference.fixtures import random_paged_kv

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
LENS = [1, 7, 63, 65, 1000, 4097]


def make_kv(lens, *, page_size, num_kv_heads, head_dim, dtype, hbm_fraction=0.4, seed=None) -> PagedKV:
    """A random cache on the GPU: host pools pinned + zero-copy views, HBM pools in HBM, pages shuffled."""
    from directkv.kernels.cuda.zero_copy import device_view, pinned_empty

    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    kv = random_paged_kv(lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                         hbm_fraction=hbm_fraction, generator=gen)

    def host(t: torch.Tensor) -> torch.Tensor:
        pinned = pinned_empty(t.shape, t.dtype)
        pinned.copy_(t)
        return device_view(pinned)

    return PagedKV(host(kv.host_k), host(kv.host_v), kv.hbm_k.cuda(), kv.hbm_v.cuda(), kv.block_table.cuda(),
                   kv.seq_lens.cuda())


def dense_reference(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """float64 attention per sequence on upcast inputs, `[batch, num_heads, head_dim]`."""
    group = q.shape[1] // kv.num_kv_heads
    outs = []
    for b in range(q.shape[0]):
        k, v = (t.double().repeat_interleave(group, dim=1) for t in kv.gather(b))  # [n, heads, dim]
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


def run_and_check(kv: PagedKV, num_heads: int, variant: str, **kwargs) -> torch.Tensor:
    q = torch.randn(kv.batch, num_heads, kv.head_dim, device="cuda").to(kv.dtype)
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails
    got, _ = decode_attention(q, kv, variant=variant, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    ref = dense_reference(q, kv, 1.0 / math.sqrt(kv.head_dim))
    assert not torch.isnan(out).any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < TOL[kv.dtype], f"rel err {err:.2e}"
    return out


# ---- GPU: correctness -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["naive", "tiled", "stream"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_decode_matches_reference(variant, dtype, head_dim, gqa):
    for page_size in (16, 64):
        kv = make_kv(LENS, page_size=page_size, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
        run_and_check(kv, 2 * gqa, variant)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["naive", "tiled", "stream"])
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_forced_splits(variant, num_splits):
    kv = make_kv([4097, 1, 300, 2000], page_size=32, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    run_and_check(kv, 4, variant, num_splits=num_splits)  # gqa 2: two heads per CTA in "tiled"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["naive", "tiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_host_only_plan(variant, dtype, gqa):
    # empty HBM pools, as serving's host tier passes them, select the host-only plan (few long splits); 9001 tokens of
    # 16-token pages (563 pages) need two splits to stay within the kernel's 512-entry page table
    kv = make_kv([9001, 1, 4097, 63], page_size=16, num_kv_heads=2, head_dim=128, dtype=dtype, hbm_fraction=0.0)
    assert bool((kv.block_table[0, :563] >= 0).all())  # every page of the long sequence is a host page
    empty = kv.hbm_k[:0]
    host_only = PagedKV(kv.host_k, kv.host_v, empty, empty, kv.block_table, kv.seq_lens)
    run_and_check(host_only, 2 * gqa, variant)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["naive", "tiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])  # 2: two heads per CTA in tiled
@pytest.mark.parametrize("split_major", [False, True])
def test_cluster_merge(variant, dtype, head_dim, gqa, split_major, monkeypatch):
    # every page on the host and 2..8 splits: the splits of a (sequence, head group) run as one thread-block cluster and
    # merge in distributed shared memory. The short sequences leave most of their cluster's splits without tiles, and
    # those CTAs must still reach both cluster barriers (a miss hangs the launch); the global merge is checked beside it
    import directkv.kernels.cuda.decode_attention as dec

    monkeypatch.setattr(dec, "SPLIT_MAJOR", split_major)
    kv = make_kv([4097, 1, 300, 63, 1000], page_size=16, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                 hbm_fraction=0.0)
    empty = kv.hbm_k[:0]
    host_only = PagedKV(kv.host_k, kv.host_v, empty, empty, kv.block_table, kv.seq_lens)
    for cluster in (True, False):
        monkeypatch.setattr(dec, "CLUSTER_MERGE", cluster)
        # None: the host-only plan, 5 splits at head_dim 128 (tile 64), 8 at head_dim 64 (tile 32), 1 for naive at
        # GQA 8; the forced counts up to CLUSTER_MAX reach the cluster path whenever clusters are on, one more the
        # global merge
        for num_splits in (None, 2, 3, 5, CLUSTER_MAX, CLUSTER_MAX + 1):
            run_and_check(host_only, 2 * gqa, variant, num_splits=num_splits, tile_kv=32 if head_dim == 64 else 64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("page_size", [16, 128])
def test_page_table_in_shared_memory_or_per_copy(num_splits, page_size):
    # a CTA keeps its split's page-table entries in shared memory up to kDecodeTableCap (512) pages and looks them up
    # per copy beyond that: 9001 tokens in 16-token pages are 563 pages of 64-token tiles in one split (past the cap),
    # fewer in two or five; 128-token pages hold two tiles, so a split can begin mid-page
    kv = make_kv([9001, 130, 4097], page_size=page_size, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    run_and_check(kv, 8, "tiled", num_splits=num_splits)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("load_mode", ["cp_async_l2", "cp_async_l1", "registers", "cp_async_l2_128", "cp_async_l2_256"])
@pytest.mark.parametrize("split_major", [False, True])
def test_load_modes_and_grid_orders(load_mode, split_major, monkeypatch):
    import directkv.kernels.cuda.decode_attention as dec

    monkeypatch.setattr(dec, "LOAD_MODE", load_mode)
    monkeypatch.setattr(dec, "SPLIT_MAJOR", split_major)
    for head_dim, gqa, dtype in ((128, 4, torch.bfloat16), (64, 8, torch.float16)):
        kv = make_kv(LENS, page_size=16, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
        for variant in ("naive", "tiled"):
            run_and_check(kv, 2 * gqa, variant)
            run_and_check(kv, 2 * gqa, variant, num_splits=3, tile_kv=32)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("hbm_fraction", [0.0, 1.0])
@pytest.mark.parametrize("tile_kv", [32, 64])
def test_single_tier_and_tiles(hbm_fraction, tile_kv):
    kv = make_kv([33, 513, 2049], page_size=16, num_kv_heads=4, head_dim=128, dtype=torch.float16,
                 hbm_fraction=hbm_fraction)
    for variant in ("naive", "tiled", "stream"):
        run_and_check(kv, 16, variant, tile_kv=tile_kv)


@pytest.mark.gpu
@needs_gpu
def test_repeated_calls_reuse_counters_and_stream_ring():
    kv = make_kv([5000, 17, 3000], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    plan = plan_stream(kv, chunk_bytes=64 << 10, num_slots=2)  # many chunks through a 2-slot ring
    assert len(plan.copies) > 4
    outs = [run_and_check(kv, 8, "stream", plan=plan) for _ in range(2)]
    outs += [run_and_check(kv, 8, "tiled", num_splits=9) for _ in range(3)]  # counters must be left zero
    assert all(not torch.isnan(o).any() for o in outs)


@pytest.mark.gpu
@needs_gpu
def test_stream_through_serving_default_decode_ring_of_64_mib_slots():
    # Llama-3.1-8B's page shape; 2,506 host pages (78 MiB of K) through serving's decode ring, 3 slots of 64 MiB
    # (2,048 pages) of K: two balanced chunks of 1,253 pages, each far past a 16 MiB slot's 512
    kv = make_kv([40001, 7, 63], page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, hbm_fraction=0.0)
    plan = plan_stream(kv, chunk_bytes=64 << 20, num_slots=3, ring_bytes=3 * 2 * (64 << 20))
    assert len(plan.copies) == 2 and plan.ring_k.shape[:2] == (3, 2048)
    for _ in range(2):  # fresh queries, the same ring
        run_and_check(kv, 32, "stream", plan=plan)


def _last_page_lowest(kv: PagedKV, seq: int) -> PagedKV:
    """The same cache with the block-table entries of `seq`'s last page and of the lowest host page swapped, so
    that sequence's last page sorts first (stream copies host pages in id order)."""
    table, lens = kv.block_table.cpu(), kv.seq_lens.cpu()
    col = (int(lens[seq]) - 1) // kv.page_size
    used = torch.arange(table.shape[1])[None, :] < -(-lens[:, None] // kv.page_size)  # columns holding tokens
    low = int(table[used & (table >= 0)].min())
    where = (used & (table == low)).nonzero()[0]
    table[where[0], where[1]], table[seq, col] = table[seq, col].clone(), low
    return PagedKV(kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, table.cuda(), kv.seq_lens)


def _last_slots(kv: PagedKV) -> torch.Tensor:
    """Each sequence's last token as a row of its host pool viewed `[-1, num_kv_heads, head_dim]` (all host)."""
    table, lens = kv.block_table.cpu().to(torch.int64), kv.seq_lens.cpu().to(torch.int64)
    pages = table[torch.arange(kv.batch), (lens - 1) // kv.page_size]
    assert (pages >= 0).all()
    return (pages * kv.page_size + (lens - 1) % kv.page_size).cuda()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("chunk_kb,reuse", [(64, False), (16 << 10, False), (64, True)])
def test_prefetched_stream_sees_the_last_tokens_stored_after_it(chunk_kb, reuse):
    """prefetch_stream copies the first chunks ahead; then each sequence's last token is stored into the pools
    (a serving step's new tokens) and given to the call as last_kv, which must see them. The slots held NaN
    when the prefetch copied them, so without last_kv the call reads NaN where a last page was prefetched:
    the check can fail. Many chunks (64 KiB) and one chunk (16 MiB, one pass with no merge); and many chunks in
    a ring taken over from a plan with bigger chunks (slots hold more pages than the chunks use)."""
    kv = _last_page_lowest(make_kv([5000, 17, 3000, 64], page_size=16, num_kv_heads=2, head_dim=128,
                                   dtype=torch.bfloat16, hbm_fraction=0.0), seq=1)
    slots = _last_slots(kv)
    q = torch.randn(kv.batch, 8, 128, device="cuda").to(kv.dtype)
    errs = {}
    for give in (True, False):
        plan = plan_stream(kv, chunk_bytes=chunk_kb << 10, reuse=plan_stream(kv) if reuse else None)
        # sequence 1's last page is the lowest host page, so the first (prefetched) chunk holds it
        last_rows = torch.cat([rows for rows, _ in filter(None, plan.last)]).tolist()
        assert 1 in plan.last[0][0].tolist() and len(last_rows) >= (kv.batch if len(plan.copies) == 1 else 1)
        assert (plan.ring_k.shape[1] > 8) == reuse or chunk_kb > 64  # 64 KiB: 8 pages of 8 KiB per chunk
        new = []
        for pool in (kv.host_k, kv.host_v):
            pool.view(-1, 2, 128)[slots] = float("nan")
        assert prefetch_stream(plan, [(kv.host_k, kv.host_v)]) == min(len(plan.copies), 2) == plan.copied
        for pool in (kv.host_k, kv.host_v):  # queued after the prefetch, as a serving step's store is
            new.append(torch.randn(kv.batch, 2, 128, device="cuda").to(kv.dtype))
            pool.view(-1, 2, 128)[slots] = new[-1]
        out = torch.full_like(q, float("nan"))
        # given as head-major views (not contiguous): the call takes contiguous copies for its C++ scatter
        last = tuple(t.transpose(0, 1).contiguous().transpose(0, 1) for t in new)
        assert not last[0].is_contiguous()
        decode_attention(q, kv, variant="stream", out=out, plan=plan, last_kv=last if give else None)
        assert plan.call == 1 and plan.consumed == plan.copied == len(plan.copies)  # the queue's one call ran
        ref = dense_reference(q, kv, 1.0 / math.sqrt(128))
        errs[give] = float((out.double() - ref).norm() / ref.norm())
    assert errs[True] < TOL[torch.bfloat16], errs
    assert not errs[False] < TOL[torch.bfloat16], errs  # without last_kv a prefetched last token is the stale NaN


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("chunk_kb", [64, 16 << 10])
@pytest.mark.parametrize("hide_readers", [False, True])
def test_queued_calls_copy_ahead_into_slots_their_readers_have_freed(chunk_kb, hide_readers, monkeypatch):
    """A serving step's layers as one copy queue (prefetch_stream over every layer's pools): each copy, of this
    call or of a later one, is queued right after the kernel that last reads its slot and waits for it only.
    Layer after layer, each over its own random pools, queued with no sync in between, every output must match
    the reference (a copy landing in a slot still being read would mix layers' K/V). Many 64 KiB chunks (slots
    reused within each call) and one 16 MiB chunk per call (the next calls' chunks copied while this one's
    is read). Each chunk's kernel is delayed on the GPU (a spin before it) so the readers lag the copies: with the
    waits for the slots' readers skipped (hide_readers), copies land under them and the outputs must be wrong, so
    the check can fail."""
    import directkv.kernels.cuda.decode_attention as dec
    from directkv.kernels.cuda.zero_copy import device_view, pinned_empty

    monkeypatch.setattr(dec, "STREAM_LAG_CYCLES", 1_000_000)  # ~0.5 ms of GPU time before each chunk's kernel
    if hide_readers:
        monkeypatch.setattr(dec, "STREAM_WAIT_FOR_READERS", False)

    base = make_kv([5000, 700, 3000, 64], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                   hbm_fraction=0.0)

    def layer() -> PagedKV:
        pools = []
        for t in (base.host_k, base.host_v):
            pinned = pinned_empty(t.shape, t.dtype)
            pinned.copy_(torch.randn(t.shape).to(t.dtype))
            pools.append(device_view(pinned))
        return PagedKV(*pools, base.hbm_k, base.hbm_v, base.block_table, base.seq_lens)

    layers = [layer() for _ in range(4)]
    plan = plan_stream(base, chunk_bytes=chunk_kb << 10)
    assert (len(plan.copies) > 2) == (chunk_kb == 64) and len(plan.copies) >= 1
    qs = [torch.randn(base.batch, 8, 128, device="cuda").to(base.dtype) for _ in layers]
    outs = [torch.full_like(q, float("nan")) for q in qs]  # poisoned: an unwritten element fails
    assert prefetch_stream(plan, [(kv.host_k, kv.host_v) for kv in layers]) == 2
    host = (base.block_table.cpu(), base.seq_lens.cpu())  # no Traffic read back (a sync) between the calls
    n = len(plan.copies)
    for i, (q, kv, out) in enumerate(zip(qs, layers, outs, strict=True)):
        decode_attention(q, kv, variant="stream", out=out, plan=plan, host_table=host)
        # the slots' next copies are queued as soon as their readers are, into the next calls' chunks too
        assert plan.consumed == (i + 1) * n and plan.copied == min((i + 1) * n + 2, len(layers) * n)
    assert plan.call == len(layers) and plan.copied == plan.consumed == len(layers) * len(plan.copies)
    errs = []
    for q, kv, out in zip(qs, layers, outs, strict=True):
        ref = dense_reference(q, kv, 1.0 / math.sqrt(128))
        errs.append(float((out.double() - ref).norm() / ref.norm()))
    if hide_readers:
        assert any(not e < TOL[torch.bfloat16] for e in errs), errs
    else:
        assert all(e < TOL[torch.bfloat16] for e in errs), errs


@pytest.mark.gpu
@needs_gpu
def test_stream_plan_takes_over_an_earlier_ring_or_grows_it():
    """plan_stream(reuse=...) keeps an earlier plan's ring (and stream, events) when it holds enough pages per
    slot, else allocates one at least a quarter larger; results stay exact either way."""
    big = make_kv([3000, 2000], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, hbm_fraction=0.0)
    small = make_kv([100, 37], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, hbm_fraction=0.0)
    first = plan_stream(big, chunk_bytes=64 << 10, min_chunk_bytes=64 << 10)  # 8 pages of 8 KiB per slot
    run_and_check(big, 8, "stream", plan=first)
    # 313 host pages in 35 chunks: 9 pages each, one more than the ring holds; it grows by a quarter, to 10
    grown = plan_stream(big, min_chunks=35, min_chunk_bytes=8 << 10, reuse=first)
    assert sum(n for _, _, n in grown.copies[0].tolist()) == 9 and grown.ring_k.shape[1] == 10 and first.ring_k is None
    run_and_check(big, 8, "stream", plan=grown)
    ring, side = grown.ring_k, grown.side
    kept = plan_stream(small, chunk_bytes=64 << 10, min_chunk_bytes=64 << 10, reuse=grown)
    assert kept.ring_k is ring and kept.side is side and len(kept.copies) > 1
    run_and_check(small, 8, "stream", plan=kept)
    # the earlier plans' C++ queues held the ring's addresses: using them now must refuse, not copy
    assert grown.ring_k is None and grown.native is None
    for old in (first, grown):
        with pytest.raises(ConfigError, match="ring was released or taken over"):
            run_and_check(big, 8, "stream", plan=old)


@pytest.mark.gpu
@needs_gpu
def test_prefetch_of_other_pools_is_redone():
    """A prefetch of one layer's pools followed by a call over another's: the call copies its own."""
    kv = make_kv([3000, 700], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16, hbm_fraction=0.0)
    other = make_kv([3000, 700], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16, hbm_fraction=0.0)
    plan = plan_stream(kv, chunk_bytes=64 << 10)
    prefetch_stream(plan, [(other.host_k, other.host_v)])
    run_and_check(kv, 8, "stream", plan=plan)
    assert plan.queue == [(kv.host_k.data_ptr(), kv.host_v.data_ptr())]  # a queue of the call alone


@pytest.mark.gpu
@needs_gpu
def test_stream_ring_is_sized_by_the_pages_the_batch_reads():
    """A short sequence in a large arena gets a min_chunk_bytes ring, not one sized by the whole arena."""
    big = make_kv([40, 20000], page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, hbm_fraction=0.0)
    short = PagedKV(big.host_k, big.host_v, big.hbm_k, big.hbm_v, big.block_table[:1].contiguous(),
                    big.seq_lens[:1].contiguous())
    page_bytes = 16 * 8 * 128 * 2
    assert big.host_k.shape[0] * page_bytes > (4 << 20)  # the arena alone would have sized a >= 4 MiB slot
    plan = plan_stream(short, min_chunk_bytes=2 << 20)
    assert plan.ring_k.shape[1] == (2 << 20) // page_bytes
    run_and_check(short, 32, "stream", plan=plan)
    assert plan_stream(big).ring_k.shape[1] == (16 << 20) // page_bytes  # 20000 tokens read: capped at 16 MiB


@pytest.mark.gpu
@needs_gpu
def test_cluster_merge_with_an_empty_sequence():
    # a sequence of 0 tokens: its whole cluster returns before either barrier, and its outputs are zeros
    kv = make_kv([4097, 40, 63], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, hbm_fraction=0.0)
    empty = kv.hbm_k[:0]
    kv = PagedKV(kv.host_k, kv.host_v, empty, empty, kv.block_table,
                 torch.tensor([4097, 0, 63], dtype=torch.int32, device="cuda"))
    q = torch.randn(3, 8, 128, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, variant="tiled", out=out, num_splits=4, cluster_merge=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not torch.isnan(out).any()
    ref = dense_reference(q[[0, 2]], PagedKV(kv.host_k, kv.host_v, empty, empty, kv.block_table[[0, 2]],
                                             kv.seq_lens[[0, 2]]), 1.0 / math.sqrt(128))
    err = float((out[[0, 2]].double() - ref).norm() / ref.norm())
    assert err < TOL[torch.bfloat16], f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
def test_empty_sequence_gives_zeros():
    kv = make_kv([40, 40], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    kv = PagedKV(kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table,
                 torch.tensor([40, 0], dtype=torch.int32, device="cuda"))
    q = torch.randn(2, 4, 128, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, variant="tiled", out=out)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not torch.isnan(out[0]).any()


@pytest.mark.gpu
@needs_gpu
def test_split_plan_shorter_than_the_block_table_is_refused():
    """A direct caller's split plan one tile a split short of the block table is refused before anything launches:
    launched, its sequences' tails would go unread and, on the global-merge path, their last split never arrive (no
    output, an arrival counter left non-zero). The next planned call over the same workspace is exact."""
    import directkv.kernels.cuda.decode_attention as dec

    kv = make_kv([1000, 300], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 128, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.current_stream().cuda_stream
    width = kv.block_table.shape[1]
    hpc, splits, tiles, part_o, part_lse, counters = dec._config(q, 2, 16, width, variant="tiled", tile_kv=64,
                                                                 num_splits=4, stream=stream)
    assert splits == 4 and splits * tiles * 64 >= width * 16 > splits * (tiles - 1) * 64
    short = rf"4 x {tiles - 1} tiles of 64 = {4 * (tiles - 1) * 64} tokens"
    table = rf"the block table's {width} pages x 16 = {width * 16}"
    with pytest.raises(RuntimeError, match=rf"the split plan covers {short}, fewer than {table}"):
        dec._module().run(
            q.data_ptr(), kv.host_k.data_ptr(), kv.host_v.data_ptr(), kv.hbm_k.data_ptr(), kv.hbm_v.data_ptr(),
            kv.block_table.data_ptr(), kv.seq_lens.data_ptr(), out.data_ptr(), 0, 0, part_o, part_lse, counters,
            2, 8, 2, 128, width, 16, splits, tiles - 1, hpc, 64, 1.0 / math.sqrt(128), dec.DTYPE_CODES[q.dtype],
            dec.LOAD_MODES[dec.LOAD_MODE], 0, 0, stream,
        )  # fmt: skip
    assert torch.isnan(out).all()  # nothing ran
    run_and_check(kv, 8, "tiled", num_splits=4)


# ---- GPU: validation and the stream queue ---------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_last_kv_of_the_wrong_dtype_is_one_line():
    kv = make_kv([40, 70], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, hbm_fraction=0.0)
    q = torch.randn(2, 4, 64, device="cuda").to(torch.bfloat16)
    bad = torch.randn(2, 2, 64, device="cuda")  # float32
    with pytest.raises(ConfigError, match=r"last_kv is an option of variant 'stream' with a plan: \(K, V\) of shape "
                                          r"\(2, 2, 64\), torch.bfloat16"):
        decode_attention(q, kv, variant="stream", plan=plan_stream(kv), last_kv=(bad, bad))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["tiled", "stream"])
def test_host_table_spares_the_device_sync_and_changes_no_result(variant):
    """Given CPU copies of the block table and lens (a serving step has them), a call reads those for its
    closed-form Traffic instead of the device tables: no synchronising operation under torch's sync debug mode
    (which raises on one), the same output and Traffic. Without them, a fresh table is read back: the control
    must raise, so the check can fail."""
    kv = make_kv([300, 17, 1000], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    host = (kv.block_table.cpu(), kv.seq_lens.cpu())
    q = torch.randn(kv.batch, 8, 128, device="cuda").to(kv.dtype)
    plan = plan_stream(kv, host_table=host) if variant == "stream" else None
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, t = decode_attention(q, kv, variant=variant, out=out, plan=plan, host_table=host)
        fresh = PagedKV(kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table.clone(), kv.seq_lens.clone())
        with pytest.raises(RuntimeError, match="synchroniz"):
            decode_attention(q, fresh, variant=variant, plan=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = dense_reference(q, kv, 1.0 / math.sqrt(128))
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[kv.dtype]
    fresh = PagedKV(kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table.clone(), kv.seq_lens.clone())
    assert t == traffic(fresh, num_heads=8, variant=variant)


def _queued_plan() -> tuple[PagedKV, object]:
    """A cache with host and HBM pages and its stream plan, two chunks already queued by prefetch_stream."""
    kv = make_kv([3000, 700], page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, hbm_fraction=0.3)
    plan = plan_stream(kv, chunk_bytes=64 << 10)
    assert prefetch_stream(plan, [(kv.host_k, kv.host_v)]) == 2
    return kv, plan


def _check_queue_untouched_then_exact(kv: PagedKV, plan) -> None:
    """After a refused call: the plan's queue is as prefetch_stream left it, and the next call is exact."""
    assert (plan.call, plan.copied, plan.consumed) == (0, 2, 0)
    run_and_check(kv, 8, "stream", plan=plan)
    assert plan.call == 1 and plan.consumed == len(plan.copies)


@pytest.mark.gpu
@needs_gpu
def test_stream_queue_refuses_bad_arguments_before_any_copy():
    """The C++ StreamQueue's checks: its constructor refuses a ring of one slot and an event never created; a
    call whose launch is refused (q not 16-byte aligned) refuses before its first copy, so the plan's queue
    is unchanged and the next call is exact."""
    from directkv.kernels.cuda.decode_attention import _module

    with pytest.raises(RuntimeError, match=">= 2 ring slots"):
        _module().StreamQueue(0, 0, 16, 16, [], [], [1], [1], 0, [], [], [], 1, 16)
    with pytest.raises(RuntimeError, match="uncreated event"):
        _module().StreamQueue(0, 0, 16, 16, [], [], [1, 0], [1, 1], 0, [], [], [], 1, 16)
    kv, plan = _queued_plan()
    shape = (kv.batch, 8, 128)
    q_bad = torch.randn(kv.batch * 8 * 128 + 1, device="cuda").to(kv.dtype)[1:].view(shape)  # 2 bytes off
    assert q_bad.is_contiguous() and q_bad.data_ptr() % 16 != 0
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        decode_attention(q_bad, kv, variant="stream", plan=plan)
    _check_queue_untouched_then_exact(kv, plan)


@pytest.mark.gpu
@needs_gpu
def test_stream_queue_refuses_a_split_plan_shorter_than_the_block_table(monkeypatch):
    """StreamQueue::run_layer makes the direct launch's plan check before its first copy (see
    test_split_plan_shorter_than_the_block_table_is_refused): a plan one tile a split short of its passes' table is
    refused, the plan's queue is unchanged and the next planned call is exact."""
    import directkv.kernels.cuda.decode_attention as dec

    kv, plan = _queued_plan()
    real = dec._config

    def short(*args, **kwargs):
        hpc, splits, tiles, *rest = real(*args, **kwargs)
        assert tiles >= 2  # one tile less is still a plan, only a short one
        return (hpc, splits, tiles - 1, *rest)

    monkeypatch.setattr(dec, "_config", short)
    q = torch.randn(kv.batch, 8, 128, device="cuda").to(kv.dtype)
    with pytest.raises(RuntimeError, match="the split plan covers .* fewer than the block table's"):
        decode_attention(q, kv, variant="stream", plan=plan, num_splits=1)
    monkeypatch.setattr(dec, "_config", real)
    _check_queue_untouched_then_exact(kv, plan)
