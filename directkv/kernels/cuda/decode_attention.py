"""CUDA decode attention over a paged two-tier KV cache (csrc/include/directkv/decode_attention.cuh).

Variants
--------
naive  : one query head per CTA, zero-copy: each K/V byte is read once per query head of its GQA group.
tiled  : all query heads of a KV head in one CTA, zero-copy: each K/V byte crosses the link once.
stream : beyond the paper: the copy engine moves host pages into a small HBM ring on a side stream while
         the tiled kernel consumes the previous chunk; partial (O, lse) per chunk merged at the end (one
         chunk and no HBM pages: one pass straight into the output). Consecutive calls over different pools
         with one plan (a serving step's layers, queued by prefetch_stream) take the ring's slots in turn as
         one sequence of chunks, so the copies of later calls are queued as soon as a slot's last reader is.

Both zero-copy variants split each sequence over CTAs (flash-decoding) when there are too few
(sequence, head group) pairs to fill the GPU; the split plan is host-side arithmetic on the SM count,
the kernel's occupancy, the block table's width and whether the HBM pools are empty (no device sync). The last
split to finish merges the partials from HBM; a host-only launch of 2..CLUSTER_MAX splits runs as thread-block
clusters that merge them in distributed shared memory instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import torch

from directkv.errors import ConfigError, check, unknown_name
from directkv.kernels.cuda import build
from directkv.kernels.cuda.stream_plan import StreamPlan, plan_stream
from directkv.kernels.paged import PagedKV, check_queries, per_table
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import decode_traffic

VARIANTS = ("naive", "tiled", "stream")
TILES = (32, 64)
DEFAULT_TILE = 64  # decode_attention's tile_kv, and the tile side_splits' callers launch with
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# A split of fewer tiles than this spends more on its start-up (q, first loads) than it saves in balance.
MIN_TILES_PER_SPLIT = 2
# CTAs per resident slot to aim for: one full wave plus slack, so no slot idles at the tail.
WAVES = 2
# With every page on the host the link, not the SMs, sets the pace, and a few long splits beat many short ones
# (H200, tiled, all K/V pinned, thirty-second session: 4K x 1 took 340-344 us at 1-4 splits against 350 us at the 32
# of the plan above, 8K x 1 667-672 against 690, 16K x 1 1325 at 8 against 1346; from 32K to 128K x 1 the best
# counts, 8-32, were within 1% of the plan above, and 17 splits of 8 heads, 136 CTAs on 132 SMs, fell a point
# behind a plain read at 128K). So host-only launches aim at no more than one CTA per SM (half the tiled kernel's
# two resident slots), and at least this many tiles a split; and at no more than CLUSTER_MAX splits, so their splits
# merge in a cluster (H200, thirty-fifth session, tensor-core math: one sweep put 16K x 1 at 1324-1326 us with 2-8
# splits against 1332 with the 16 planned before, 32K x 1 at 2631-2635 with 4-8 against 2645; a second found them
# level within its ~0.3-1% spread: no slower, and every batch-1 launch up to 64K merges in a cluster).
HOST_WAVES = 0.5
HOST_MIN_TILES_PER_SPLIT = 16
# csrc kDecodeTableCap: page-table entries a CTA keeps in shared memory. A longer split looks its entries up per
# copy, which was 13% slower (16K x 1 in one split), so planned splits stay within it.
TABLE_CAP = 512
# A host-only launch of 2..CLUSTER_MAX splits runs as thread-block clusters, one per (sequence, head group), whose splits
# merge through distributed shared memory rather than HBM partials, a fence and an arrival counter (csrc
# kDecodeClusterMax, the portable cluster size). That merge runs after the call's last K/V byte; see the kernel.
CLUSTER_MERGE = True
CLUSTER_MAX = 8
# csrc DecodeLoad: cp.async .cg / .ca / .cg + L2::128B / .cg + L2::256B, or plain LDG through registers
LOAD_MODES = {"cp_async_l2": 0, "cp_async_l1": 1, "registers": 2, "cp_async_l2_128": 3, "cp_async_l2_256": 4}
# Tuning knobs (module-level so a benchmark can sweep them; bench_decode.tune_decode does). Measured on the
# H200 (PCIe Gen5), tiled, Llama-3.1-8B shapes, 4K and 32K x batch 1: cp.async .ca and plain LDG stream
# pinned host memory at 47.8-50.5 GB/s (93-99% of the SM probe); cp.async .cg, with or without an L2
# prefetch hint, only 20-21 GB/s (~40%). The grid order made no difference (< 1%).
LOAD_MODE = "cp_async_l1"
SPLIT_MAJOR = False  # grid order: False = CTAs of one split's head groups adjacent, True = splits adjacent


def plan_splits(num_groups: int, max_tiles: int, slots: int, num_splits: int | None = None, *,
                host_only: bool = False, cap_tiles: int | None = None) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for `num_groups` (sequence, head group) CTAs of <= max_tiles tiles.

    Splits until about WAVES * slots CTAs exist (slots = SMs x resident CTAs per SM), never below
    MIN_TILES_PER_SPLIT tiles a split; with `host_only` (no HBM pages) until about HOST_WAVES * slots, never below
    HOST_MIN_TILES_PER_SPLIT and never above CLUSTER_MAX splits. A planned split holds at most `cap_tiles` tiles
    (its page-table entries fit the CTA's shared memory); a forced `num_splits` is only clipped to max_tiles.
    Splits are equal in tiles, so the last one may be short; shorter sequences leave their trailing splits empty.
    """
    max_tiles = max(1, max_tiles)
    if num_splits is None:
        if host_only:  # rounded down: a 137th CTA would share an SM, and that SM's splits would finish last
            want, min_tiles = max(1, int(HOST_WAVES * slots) // max(1, num_groups)), HOST_MIN_TILES_PER_SPLIT
            want = min(want, CLUSTER_MAX)  # no more splits than one cluster merges, unless the table cap asks
        else:
            want, min_tiles = math.ceil(WAVES * slots / max(1, num_groups)), MIN_TILES_PER_SPLIT
        num_splits = max(1, min(want, math.ceil(max_tiles / min_tiles)))
        if cap_tiles:
            num_splits = max(num_splits, math.ceil(max_tiles / cap_tiles))
    num_splits = max(1, min(int(num_splits), max_tiles))
    tiles_per_split = math.ceil(max_tiles / num_splits)
    return math.ceil(max_tiles / tiles_per_split), tiles_per_split


def use_cluster_merge(host_only: bool, num_splits: int, enabled: bool | None = None) -> bool:
    """Whether a launch of `num_splits` splits merges them in thread-block clusters (`enabled`, default
    CLUSTER_MERGE, allows it)."""
    return (CLUSTER_MERGE if enabled is None else enabled) and host_only and 2 <= num_splits <= CLUSTER_MAX


def heads_per_cta(variant: str, group: int) -> int:
    """Query heads one CTA serves: 1 for naive, else the largest of 8, 4, 2, 1 dividing the GQA group."""
    if variant == "naive":
        return 1
    return next(h for h in (8, 4, 2, 1) if group % h == 0)


@cache
def _module():
    return build.load("decode_attention")  # once: load() takes a lock on every call


def copy_runs_packed(dst_bases: list[int], src_bases: list[int], runs: torch.Tensor, unit_bytes: int,
                     stream: int) -> None:
    """Queue on `stream` (a CUDA stream handle) every (src unit, dst unit, units) run of `runs` (chunk_runs' int64
    `[runs, 3]` CPU tensor, read by pointer) for each (dst, src) base address pair: the ring's and swap's
    staging copies, issued from C++ (one cudaMemcpyBatchAsync where CUDA 13 has it)."""
    if not (runs.dtype == torch.int64 and runs.device.type == "cpu" and runs.is_contiguous() and runs.dim() == 2
            and runs.shape[1] == 3):  # read by pointer: anything else would be misread
        raise ConfigError(f"copy_runs_packed wants a contiguous int64 [runs, 3] CPU tensor; got {runs.dtype} "
                          f"{tuple(runs.shape)} on {runs.device}, contiguous {runs.is_contiguous()}")
    _module().copy_runs_packed(dst_bases, src_bases, runs.data_ptr(), runs.shape[0], unit_bytes, stream)


@cache
def _occupancy(device: int, dtype_code: int, head_dim: int, hpc: int, tile: int) -> int:
    with torch.cuda.device(device):
        sms, per_sm = _module().occupancy(dtype_code, head_dim, hpc, tile)
    return sms * max(1, per_sm)


@dataclass
class _Workspace:
    """Split-KV partials and arrival counters of one (device, stream); counters are left zero by the kernel."""

    part_o: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    part_lse: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    counters: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def ensure(self, rows: int, head_dim: int, groups: int, device: torch.device) -> _Workspace:
        if self.part_o.numel() < rows * head_dim or self.part_o.device != device:
            self.part_o = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        if self.part_lse.numel() < rows or self.part_lse.device != device:
            self.part_lse = torch.empty(rows, dtype=torch.float32, device=device)
        if self.counters.numel() < groups or self.counters.device != device:
            self.counters = torch.zeros(groups, dtype=torch.int32, device=device)
        return self


_WORKSPACES: dict[tuple[int, int], _Workspace] = {}
_TRAFFIC: dict = {}  # per_table's memo of the closed-form Traffic


def table_cap_tiles(page_size: int, tile_kv: int) -> int:
    """Tiles a split may hold with all its page-table entries in the CTA's TABLE_CAP slots: a page larger than a
    tile lets a split begin mid-page, so one entry is kept spare then."""
    return max(1, (TABLE_CAP - (page_size > tile_kv)) * page_size // tile_kv)


def table_min_splits(width: int, page_size: int, tile_kv: int = DEFAULT_TILE) -> int:
    """Fewest splits that keep every split of block tables `width` pages wide within the kernel's page table (a
    caller that forces `num_splits` raises it to this to stay off the slower per-copy lookups)."""
    return math.ceil(math.ceil(width * page_size / tile_kv) / table_cap_tiles(page_size, tile_kv))


def _config(q: torch.Tensor, num_kv_heads: int, page_size: int, width: int, *, variant: str, tile_kv: int,
            num_splits: int | None, stream: int, host_only: bool = False) -> tuple[int, int, int, int, int, int]:
    """(heads_per_cta, num_splits, tiles_per_split, part_o, part_lse, counters) of a launch over block tables of
    `width` pages: the split plan and the workspace pointers (0 without splits) on `stream`'s workspace;
    `host_only`: the HBM pools are empty, so every page is read through the link."""
    batch, num_heads, head_dim = q.shape
    hpc = heads_per_cta(variant, num_heads // num_kv_heads)
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    slots = _occupancy(device, DTYPE_CODES[q.dtype], head_dim, hpc, tile_kv)
    groups = batch * (num_heads // hpc)
    splits, tiles_per_split = plan_splits(groups, math.ceil(width * page_size / tile_kv), slots, num_splits,
                                          host_only=host_only, cap_tiles=table_cap_tiles(page_size, tile_kv))
    if splits == 1:
        return hpc, splits, tiles_per_split, 0, 0, 0
    ws = _WORKSPACES.setdefault((device, stream), _Workspace())
    ws.ensure(splits * batch * num_heads, head_dim, groups, q.device)
    return hpc, splits, tiles_per_split, ws.part_o.data_ptr(), ws.part_lse.data_ptr(), ws.counters.data_ptr()


def _launch(q, host_k, host_v, hbm_k, hbm_v, block_table, seq_lens, *, variant, tile_kv, sm_scale, num_splits,
            out=None, out_f32=None, lse_out=None, stream: int | None = None, cluster_merge: bool | None = None) -> None:
    """One kernel launch; pools `[pages, page_size, num_kv_heads, head_dim]`, q `[batch, heads, head_dim]`;
    stream: the CUDA stream handle to launch on (default: the current stream's, looked up per call)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = host_k.shape[2], host_k.shape[1]
    stream = torch.cuda.current_stream(q.device).cuda_stream if stream is None else stream
    host_only = hbm_k.shape[0] == 0
    hpc, splits, tiles_per_split, part_o, part_lse, counters = _config(
        q, num_kv_heads, page_size, block_table.shape[1], variant=variant, tile_kv=tile_kv, num_splits=num_splits,
        stream=stream, host_only=host_only)
    cluster = int(use_cluster_merge(host_only, splits, cluster_merge))
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    _module().run(
        q.data_ptr(), host_k.data_ptr(), host_v.data_ptr(), hbm_k.data_ptr(), hbm_v.data_ptr(),
        block_table.data_ptr(), seq_lens.data_ptr(), ptr(out), ptr(out_f32), ptr(lse_out), part_o, part_lse,
        counters, batch, num_heads, num_kv_heads, head_dim, block_table.shape[1], page_size, splits,
        tiles_per_split, hpc, tile_kv, sm_scale, DTYPE_CODES[q.dtype], LOAD_MODES[LOAD_MODE], int(SPLIT_MAJOR),
        cluster, stream,
    )  # fmt: skip


def _check_inputs(q: torch.Tensor, kv: PagedKV, variant: str, tile_kv: int, out: torch.Tensor | None) -> None:
    if variant not in VARIANTS:
        raise unknown_name("decode_attention variant", variant, VARIANTS)
    check(tile_kv in TILES, f"tile_kv {tile_kv!r} is not supported by the CUDA kernel; valid: {TILES}")
    batch, num_heads, head_dim = check_queries(q, kv, rows="batch")
    check(q.dtype in DTYPE_CODES, f"dtype {q.dtype} is not supported; valid: float16, bfloat16")
    check(head_dim in (64, 128), f"head_dim {head_dim} is not supported; valid: 64, 128")
    check(batch == kv.batch, f"q batch {batch} != kv batch {kv.batch}")
    ps = kv.page_size
    check(ps >= 1 and ps & (ps - 1) == 0, f"page_size {ps} is not a power of two")
    for name, t in (("q", q), ("host_k", kv.host_k), ("host_v", kv.host_v), ("hbm_k", kv.hbm_k), ("hbm_v", kv.hbm_v),
                    ("block_table", kv.block_table), ("seq_lens", kv.seq_lens)):
        check(t.device.type == "cuda", f"{name} must be a CUDA tensor (host pools as zero-copy views); got {t.device}")
        check(t.is_contiguous(), f"{name} must be contiguous")
    check(kv.block_table.dtype == torch.int32 and kv.seq_lens.dtype == torch.int32,
          f"block_table and seq_lens must be int32; got {kv.block_table.dtype}, {kv.seq_lens.dtype}")
    if out is not None:
        check(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous(),
              f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")


def traffic(kv: PagedKV, *, num_heads: int, variant: str,
            host_table: tuple[torch.Tensor, torch.Tensor] | None = None) -> Traffic:
    """Closed-form Traffic of one call (memoised per block table and seq_lens contents version). host_table:
    CPU copies of kv's (block table, seq_lens), read instead of kv's, whose reading is a device sync when
    they live on the GPU."""
    key = (variant, num_heads, kv.seq_lens.data_ptr(), kv.seq_lens._version)

    def closed_form() -> Traffic:
        table, lens = host_table if host_table is not None else (kv.block_table.cpu(), kv.seq_lens.cpu())
        lens = lens.to(torch.int64)
        cols = torch.arange(table.shape[1])
        tokens = (lens[:, None] - cols[None, :] * kv.page_size).clamp(0, kv.page_size)  # tokens per column's page
        hbm_tokens = (tokens * (table < 0)).sum(1)
        full = lens > 0  # an empty sequence reads nothing and writes its zero output row
        esize = kv.host_k.element_size()
        t = decode_traffic(lens[full].tolist(), num_heads=num_heads, num_kv_heads=kv.num_kv_heads,
                           head_dim=kv.head_dim, dtype_bytes=esize, variant="naive" if variant == "naive" else "tiled",
                           hbm_tokens=hbm_tokens[full].tolist()) if bool(full.any()) else Traffic()
        t.hbm_write_bytes += int((~full).sum()) * num_heads * kv.head_dim * esize
        if variant == "stream":  # host bytes are written into the HBM ring, then read from it by the kernel
            t = Traffic(t.link_read_bytes, t.link_write_bytes, t.hbm_read_bytes + t.link_read_bytes,
                        t.hbm_write_bytes + t.link_read_bytes, t.flops)
        return t

    return per_table(_TRAFFIC, kv.block_table, key, closed_form)


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    *,
    variant: str,
    tile_kv: int = DEFAULT_TILE,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    plan: StreamPlan | None = None,
    last_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    host_table: tuple[torch.Tensor, torch.Tensor] | None = None,
    cluster_merge: bool | None = None,
) -> tuple[torch.Tensor, Traffic]:
    """Attention of each sequence's one query token over its kv.seq_lens[b] cached tokens.

    Parameters
    ----------
    q : `[batch, num_heads, head_dim]` CUDA tensor, fp16 or bf16, head_dim 64 or 128.
    kv : paged cache; pools `[num_pages, page_size, num_kv_heads, head_dim]` (host pools as zero-copy CUDA
        views of pinned memory, see zero_copy.device_view), block_table `[batch, max_pages]` int32 and
        seq_lens `[batch]` int32 on the GPU. A sequence with seq_len 0 gets zeros.
    variant : "naive", "tiled" or "stream" (module docstring).
    tile_kv : K/V tokens per shared-memory stage, 32 or 64.
    sm_scale : softmax scale, default 1 / sqrt(head_dim).
    out : optional `[batch, num_heads, head_dim]` output buffer (q's dtype).
    num_splits : force the split count per sequence (naive/tiled, and each chunk of stream); None plans it.
    plan : stream only: a `plan_stream(kv)` result reused across calls (made per call when None).
    last_kv : stream with a plan only: (K, V) `[batch, num_kv_heads, head_dim]` of each sequence's last token,
        which the caller stored into the pools after prefetch_stream queued this call (a serving step's new
        tokens): chunks whose copies were queued before this call began may miss them, so the call writes the
        tokens into those chunks too.
    host_table : CPU copies of kv's (block_table, seq_lens), where the caller has them (a serving step): the
        closed-form Traffic (and a stream plan made here) read them instead of reading kv's back from the
        device. (plan_stream still copies its own tables to the device.)
    cluster_merge : naive/tiled: whether a host-only launch of 2..CLUSTER_MAX splits may merge them in thread-block
        clusters; None follows CLUSTER_MERGE (False keeps the merge through HBM, for a side-by-side benchmark).

    Returns
    -------
    (out `[batch, num_heads, head_dim]`, Traffic from the closed form; without host_table the first call per
    block table syncs to read it, later calls reuse it)
    """
    _check_inputs(q, kv, variant, tile_kv, out)
    if last_kv is not None:  # the message is built only when the check fails: this runs per layer in serving
        want = (q.shape[0], *kv.host_k.shape[2:])
        if not (variant == "stream" and plan is not None
                and all(t.shape == want and t.dtype == kv.dtype and t.device == q.device for t in last_kv)):
            raise ConfigError(
                f"last_kv is an option of variant 'stream' with a plan: (K, V) of shape {want}, {kv.dtype}, on "
                f"{q.device}; got variant {variant!r}, plan {'given' if plan is not None else 'None'}, "
                f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in last_kv]}")
        # the C++ loop scatters them as contiguous, 16-byte aligned rows
        last_kv = tuple(t if t.is_contiguous() and t.data_ptr() % 16 == 0
                        else t.clone(memory_format=torch.contiguous_format) for t in last_kv)
    out = torch.empty_like(q) if out is None else out
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    if variant == "stream":
        plan = plan if plan is not None else plan_stream(kv, host_table=host_table)
        _run_stream(q, kv, plan, out, tile_kv, scale, num_splits, last_kv)
    else:
        _launch(q, kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table, kv.seq_lens, variant=variant,
                tile_kv=tile_kv, sm_scale=scale, num_splits=num_splits, out=out, cluster_merge=cluster_merge)
    return out, traffic(kv, num_heads=q.shape[1], variant=variant, host_table=host_table)


# --- stream variant -------------------------------------------------------------------------------


def prefetch_stream(plan: StreamPlan, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Queue the plan's calls over `pools` (host K, host V per call, in the order the calls will come: a
    serving step's layers) and start copying their first chunks into the ring now, on its side stream, after
    everything the current stream has queued (the ring's readers, every store into the pools). Each call
    then finds its chunks copied or queued, and tops the queue up as it frees ring slots: a slot's next copy,
    of this call or of a later one, is queued right after the kernel that last reads the slot, so up to
    num_slots chunks of the next calls are copied without waiting for the host to reach them (during a
    serving step's dense work in between, which swap's copies overlap the same way). A token the caller stores
    into the pools after this must reach its call as last_kv. Returns the number of chunks issued (at most one
    per ring slot)."""
    _check_ring(plan)
    plan.side.wait_stream(torch.cuda.current_stream(plan.ring_k.device))
    _set_queue(plan, [(k.data_ptr(), v.data_ptr()) for k, v in pools])
    plan.copied = _native(plan).fill(0, 0, plan.ring_k.shape[0], STREAM_WAIT_FOR_READERS)
    return plan.copied


# Test hooks of the C++ loop (tests/test_cuda_decode.py): GPU clock cycles each chunk's kernel is delayed by
# (readers lagging their copies), and whether a copy waits for its slot's last reader (False: a mutation the
# tests must catch).
STREAM_LAG_CYCLES = 0
STREAM_WAIT_FOR_READERS = True


def _check_ring(plan: StreamPlan) -> None:
    if plan.ring_k is None:  # its C++ queue held the ring's addresses: copies would land in freed memory
        raise ConfigError("this stream plan's ring was released or taken over by a later plan (plan_stream's "
                          "reuse=); use the later plan or plan again")


def _native(plan: StreamPlan):
    """The plan's C++ StreamQueue, made on first use (once per plan, so per serving step)."""
    if plan.native is None:
        num_slots = plan.ring_k.shape[0]
        row = math.prod(plan.ring_k.shape[3:])  # one token of one layer: num_kv_heads x head_dim
        last = plan.last  # one entry per chunk c < min(num_slots, chunks), as the queue wants
        plan.native = _module().StreamQueue(
            plan.ring_k.data_ptr(), plan.ring_v.data_ptr(), plan.ring_k.stride(0) * plan.ring_k.element_size(),
            plan.page_bytes, [c.data_ptr() for c in plan.copies], [c.shape[0] for c in plan.copies],
            [e.cuda_event for e in plan.filled], [e.cuda_event for e in plan.freed], plan.side.cuda_stream,
            [0 if e is None else e[0].shape[0] for e in last], [0 if e is None else e[0].data_ptr() for e in last],
            [0 if e is None else e[1][s].data_ptr() for e in last for s in range(num_slots)],
            plan.ring_k.numel() // row, row * plan.ring_k.element_size(),
        )  # fmt: skip
    return plan.native


def _set_queue(plan: StreamPlan, queue: list[tuple[int, int]]) -> None:
    """A new copy queue of `queue`'s (host K, host V) pointers, one entry per call, nothing copied yet."""
    plan.queue, plan.call, plan.copied, plan.consumed = queue, 0, 0, 0
    _native(plan).set_queue([k for k, _ in queue], [v for _, v in queue])


def _run_stream(q, kv: PagedKV, plan: StreamPlan, out, tile_kv, scale, num_splits, last_kv=None) -> None:
    """One call's chunks (copies, waits, last tokens, kernels), HBM pass and merge, issued by the plan's C++
    StreamQueue in one call: a Python loop per chunk cost ~4x swap's host time per layer (H200, 2026-12-01)."""
    if plan.passes.shape[1] != q.shape[0]:
        raise ConfigError(f"stream plan is for batch {plan.passes.shape[1]}, q has batch {q.shape[0]}")
    _check_ring(plan)
    main = torch.cuda.current_stream(q.device)
    n = len(plan.copies)
    pools = (kv.host_k.data_ptr(), kv.host_v.data_ptr())
    if not (plan.call < len(plan.queue) and plan.queue[plan.call] == pools):
        # not the call the queue expects (no prefetch, or other pools): a queue of this call alone, whose copies
        # follow everything queued so far (the wait_stream below; copies queued for other pools are never read)
        _set_queue(plan, [pools])
    first = plan.call * n
    num_passes = plan.passes.shape[0]
    if num_passes == 0:  # no sequence has a token
        plan.call += 1
        out.zero_()
        return
    handle = main.cuda_stream  # looked up once: current_stream() costs host time per call
    plan.side.wait_stream(main)  # q, this call's stores and the ring's readers precede the copies queued next
    o_parts = lse_parts = None
    if not (n == 1 and not plan.hbm_pass):  # more than one pass: per-pass partials, merged
        o_parts = torch.empty((num_passes, *q.shape), dtype=torch.float32, device=q.device)
        lse_parts = torch.empty(plan.passes.shape[:2] + q.shape[1:2], dtype=torch.float32, device=q.device)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size, width = kv.host_k.shape[2], kv.page_size, plan.passes.shape[2]
    hpc, splits, tiles_per_split, part_o, part_lse, counters = _config(
        q, num_kv_heads, page_size, width, variant="tiled", tile_kv=tile_kv, num_splits=num_splits, stream=handle)
    last_k, last_v = (t.data_ptr() for t in last_kv) if last_kv is not None else (0, 0)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    # the C++ call checks every launch before its first copy, so a refusal leaves the queue as it was
    plan.copied, plan.consumed = _native(plan).run_layer(
        handle, first, plan.copied, q.data_ptr(), out.data_ptr(), ptr(o_parts), ptr(lse_parts),
        plan.passes.data_ptr(), plan.lens.data_ptr(), num_passes, plan.hbm_pass, kv.hbm_k.data_ptr(),
        kv.hbm_v.data_ptr(), part_o, part_lse, counters, batch, num_heads, num_kv_heads, head_dim, width, page_size,
        splits, tiles_per_split, hpc, tile_kv, DTYPE_CODES[q.dtype], LOAD_MODES[LOAD_MODE], int(SPLIT_MAJOR), scale,
        last_k, last_v, batch, STREAM_LAG_CYCLES, STREAM_WAIT_FOR_READERS,
    )  # fmt: skip
    plan.call += 1
