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
the kernel's occupancy and the block table's width (no device sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

import torch

from directkv.errors import ConfigError, check, unknown_name
from directkv.kernels.cuda import build
from directkv.kernels.paged import PagedKV, check_queries, per_table
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import STREAM_RING_BYTES, decode_traffic

VARIANTS = ("naive", "tiled", "stream")
TILES = (32, 64)
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# A split of fewer tiles than this spends more on its start-up (q, first loads) than it saves in balance.
MIN_TILES_PER_SPLIT = 2
# CTAs per resident slot to aim for: one full wave plus slack, so no slot idles at the tail.
WAVES = 2
# csrc DecodeLoad: cp.async .cg / .ca / .cg + L2::128B / .cg + L2::256B, or plain LDG through registers
LOAD_MODES = {"cp_async_l2": 0, "cp_async_l1": 1, "registers": 2, "cp_async_l2_128": 3, "cp_async_l2_256": 4}
# Tuning knobs (module-level so a benchmark can sweep them; bench_decode.tune_decode does). Measured on the
# H200 (PCIe Gen5), tiled, Llama-3.1-8B shapes, 4K and 32K x batch 1: cp.async .ca and plain LDG stream
# pinned host memory at 47.8-50.5 GB/s (93-99% of the SM probe); cp.async .cg, with or without an L2
# prefetch hint, only 20-21 GB/s (~40%). The grid order made no difference (< 1%).
LOAD_MODE = "cp_async_l1"
SPLIT_MAJOR = False  # grid order: False = CTAs of one split's head groups adjacent, True = splits adjacent


def plan_splits(num_groups: int, max_tiles: int, slots: int, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for `num_groups` (sequence, head group) CTAs of <= max_tiles tiles.

    Splits until about WAVES * slots CTAs exist (slots = SMs x resident CTAs per SM), never below
    MIN_TILES_PER_SPLIT tiles a split; a forced `num_splits` is clipped to max_tiles. Splits are equal in
    tiles, so the last one may be short; shorter sequences leave their trailing splits empty.
    """
    max_tiles = max(1, max_tiles)
    if num_splits is None:
        want = math.ceil(WAVES * slots / max(1, num_groups))
        num_splits = max(1, min(want, math.ceil(max_tiles / MIN_TILES_PER_SPLIT)))
    num_splits = max(1, min(int(num_splits), max_tiles))
    tiles_per_split = math.ceil(max_tiles / num_splits)
    return math.ceil(max_tiles / tiles_per_split), tiles_per_split


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


def _config(q: torch.Tensor, num_kv_heads: int, page_size: int, width: int, *, variant: str, tile_kv: int,
            num_splits: int | None, stream: int) -> tuple[int, int, int, int, int, int]:
    """(heads_per_cta, num_splits, tiles_per_split, part_o, part_lse, counters) of a launch over block tables of
    `width` pages: the split plan and the workspace pointers (0 without splits) on `stream`'s workspace."""
    batch, num_heads, head_dim = q.shape
    hpc = heads_per_cta(variant, num_heads // num_kv_heads)
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    slots = _occupancy(device, DTYPE_CODES[q.dtype], head_dim, hpc, tile_kv)
    groups = batch * (num_heads // hpc)
    splits, tiles_per_split = plan_splits(groups, math.ceil(width * page_size / tile_kv), slots, num_splits)
    if splits == 1:
        return hpc, splits, tiles_per_split, 0, 0, 0
    ws = _WORKSPACES.setdefault((device, stream), _Workspace())
    ws.ensure(splits * batch * num_heads, head_dim, groups, q.device)
    return hpc, splits, tiles_per_split, ws.part_o.data_ptr(), ws.part_lse.data_ptr(), ws.counters.data_ptr()


def _launch(q, host_k, host_v, hbm_k, hbm_v, block_table, seq_lens, *, variant, tile_kv, sm_scale, num_splits,
            out=None, out_f32=None, lse_out=None, stream: int | None = None) -> None:
    """One kernel launch; pools `[pages, page_size, num_kv_heads, head_dim]`, q `[batch, heads, head_dim]`;
    stream: the CUDA stream handle to launch on (default: the current stream's, looked up per call)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = host_k.shape[2], host_k.shape[1]
    stream = torch.cuda.current_stream(q.device).cuda_stream if stream is None else stream
    hpc, splits, tiles_per_split, part_o, part_lse, counters = _config(
        q, num_kv_heads, page_size, block_table.shape[1], variant=variant, tile_kv=tile_kv, num_splits=num_splits,
        stream=stream)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    _module().run(
        q.data_ptr(), host_k.data_ptr(), host_v.data_ptr(), hbm_k.data_ptr(), hbm_v.data_ptr(),
        block_table.data_ptr(), seq_lens.data_ptr(), ptr(out), ptr(out_f32), ptr(lse_out), part_o, part_lse,
        counters, batch, num_heads, num_kv_heads, head_dim, block_table.shape[1], page_size, splits,
        tiles_per_split, hpc, tile_kv, sm_scale, DTYPE_CODES[q.dtype], LOAD_MODES[LOAD_MODE], int(SPLIT_MAJOR),
        stream,
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
    tile_kv: int = 64,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    plan: StreamPlan | None = None,
    last_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    host_table: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        last_kv = tuple(t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
                        for t in last_kv)
    out = torch.empty_like(q) if out is None else out
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    if variant == "stream":
        plan = plan if plan is not None else plan_stream(kv, host_table=host_table)
        _run_stream(q, kv, plan, out, tile_kv, scale, num_splits, last_kv)
    else:
        _launch(q, kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table, kv.seq_lens, variant=variant,
                tile_kv=tile_kv, sm_scale=scale, num_splits=num_splits, out=out)
    return out, traffic(kv, num_heads=q.shape[1], variant=variant, host_table=host_table)


# --- stream variant -------------------------------------------------------------------------------


@dataclass
class StreamPlan:
    """Copy schedule of the stream variant, made once per block table (host-side; reads the block table
    from the GPU once unless plan_stream is given its host copy).

    passes : [num_passes, batch, width] int32 CUDA block tables, one per chunk (entries -(ring_pos + 1)),
        plus a last one over HBM-resident pages (original entries) when any exist.
    lens : [num_passes, batch] int32 CUDA, tokens of each sequence in each pass (passes and lens are views of
        one device tensor: one host-to-device copy per step).
    copies : per chunk, the (first host page, first ring position, pages) runs to copy, as the int64 `[runs, 3]`
        CPU tensor copy_runs_packed reads by pointer (chunk_runs): made once per step, read by every layer.
    ring_k, ring_v : [num_slots, >= chunk_pages, page_size, num_kv_heads, head_dim] HBM rings.
    last : per chunk c < num_slots (the ones a call may find copied before it began), (rows, ring rows by
        slot): `[n]` int64 CUDA, the sequences whose last token's page chunk c holds, and per ring slot s that
        token's row in `ring_k.view(-1, num_kv_heads, head_dim)` when the chunk sits in slot s; None where chunk
        c holds no last token. A call given last_kv writes the tokens there, each chunk's just before its kernel.
    A ring taken over from an earlier plan (plan_stream's reuse) may hold more than chunk_pages pages per slot;
    chunks use the first ones.
    page_bytes : bytes of one page of K (V the same).
    queue, call, copied, consumed : the copy queue. queue holds the (host K, host V) data pointers of the calls
        this plan serves in order (prefetch_stream's pools; one entry, the call's own, without it); call is the
        queue index of the next call; chunk c of call i is chunk g = i * len(copies) + c of the queue and sits in
        slot g % num_slots; copied / consumed count the queue's chunks whose copies / kernels are queued. A
        copy waits for its slot's last reader, so copied <= consumed + num_slots.
    native : the C++ StreamQueue over this plan's ring, runs, events and last-token rows (csrc stream_queue.h),
        made on the plan's first GPU use: it issues a call's chunks in one Python call (_native).
    """

    passes: torch.Tensor
    lens: torch.Tensor
    copies: list[torch.Tensor]
    hbm_pass: bool
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    side: torch.cuda.Stream
    filled: list[torch.cuda.Event]
    freed: list[torch.cuda.Event]
    last: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    page_bytes: int
    queue: list[tuple[int, int]] = field(default_factory=list)
    call: int = 0
    copied: int = 0
    consumed: int = 0
    native: object = None


def stream_schedule(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, chunk_pages: int, *,
                    hp: HostPages | None = None):
    """Host-side chunking of the host pages a batch uses (CPU tensors in, CPU tensors out).

    Used host pages, sorted, are cut into chunks of <= chunk_pages; each chunk's block table keeps every
    sequence's pages in logical order, so a partly filled last page stays last and `lens` counts tokens
    exactly (attention needs no key order otherwise). Returns (tables [P, batch, width] int32, lens [P, batch]
    int32, copies per chunk as chunk_runs' int64 `[runs, 3]` tensors, hbm_pass) with P = chunks (+1 for the
    HBM-page pass). hp: host_pages of the same arguments, where the caller has it already.
    """
    table, tokens, host, pages, index = hp if hp is not None else host_pages(block_table, seq_lens, page_size)
    copies = chunk_runs(pages, chunk_pages)
    hbm = (tokens > 0) & (table < 0)
    has_hbm = bool(hbm.any())
    num_passes = len(copies) + has_hbm
    batch = table.shape[0]
    if num_passes == 0:  # no sequence has a token: no pass
        return torch.zeros((0, batch, 1), dtype=torch.int32), torch.zeros((0, batch), dtype=torch.int32), copies, False
    # each column's pass (its page's chunk; the HBM pass last; num_passes where unused) and entry in that pass,
    # then one stable sort per row puts every pass's columns together in logical order: one sort for all passes
    # (a sort per pass cost ~0.1 ms each at batch 48 on the host's critical path)
    key = torch.where(host, index // chunk_pages, torch.where(hbm, len(copies), num_passes))
    entry = torch.where(host, -(index % chunk_pages + 1), table)
    order = torch.sort(key, dim=1, stable=True).indices
    key_sorted, entry_sorted, tokens_sorted = key.gather(1, order), entry.gather(1, order), tokens.gather(1, order)
    counts = torch.zeros((batch, num_passes + 1), dtype=torch.int64).scatter_add_(1, key, torch.ones_like(key))
    rank = torch.arange(table.shape[1]) - (counts.cumsum(1) - counts).gather(1, key_sorted)
    width = max(int(counts[:, :num_passes].max()), 1)
    rows, cols = (key_sorted < num_passes).nonzero(as_tuple=True)  # once: every boolean index is a nonzero
    passes = key_sorted[rows, cols]
    out_tables = torch.zeros((num_passes, batch, width), dtype=torch.int64)
    out_tables[passes, rows, rank[rows, cols]] = entry_sorted[rows, cols]
    out_lens = torch.zeros((num_passes + 1, batch), dtype=torch.int64)
    out_lens.index_put_((passes, rows), tokens_sorted[rows, cols], accumulate=True)
    return out_tables.to(torch.int32), out_lens[:num_passes].to(torch.int32), copies, has_hbm


def chunk_runs(pages: torch.Tensor, chunk_pages: int) -> list[torch.Tensor]:
    """The copies of each chunk of the sorted page ids `pages` (chunk c: pages[c * chunk_pages:][:chunk_pages]) as
    (first page, first position in the chunk, pages) runs of consecutive ids, one int64 `[runs, 3]` CPU tensor per
    chunk (views of one contiguous tensor), the layout copy_runs_packed reads by pointer. Tensor ops only: a
    Python loop over the runs cost ~5 ms per step at ~4000 runs (fragmented decode pages) before any copy began."""
    if len(pages) == 0:
        return []
    index = torch.arange(len(pages))
    first = torch.ones(len(pages), dtype=torch.bool)
    first[1:] = (pages[1:] != pages[:-1] + 1) | (index[1:] % chunk_pages == 0)
    starts = index[first]
    lengths = torch.diff(starts, append=torch.tensor([len(pages)]))
    runs = torch.stack([pages[starts].to(torch.int64), starts % chunk_pages, lengths], dim=1)
    per_chunk = torch.bincount(starts // chunk_pages, minlength=-(-len(pages) // chunk_pages))
    return list(torch.split(runs, per_chunk.tolist()))


class HostPages(NamedTuple):
    """The host pages a batch reads, found once per block table (host_pages); CPU tensors."""

    table: torch.Tensor  # [batch, width] int64 block table
    tokens: torch.Tensor  # [batch, width] int64 tokens in each column's page
    host: torch.Tensor  # [batch, width] bool: the column's page is a host page holding tokens
    pages: torch.Tensor  # [pages] int64 sorted unique host page ids the batch reads
    index: torch.Tensor  # [batch, width] int64 each host column's index into pages (0 elsewhere)


def host_pages(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> HostPages:
    """HostPages of a block table `[batch, width]` and seq_lens `[batch]` (CPU tensors). The indices come from
    unique's inverse: torch's CPU searchsorted took ~0.3 ms per step on the H200 host."""
    table, lens = block_table.to(torch.int64), seq_lens.to(torch.int64)
    cols = torch.arange(table.shape[1])
    tokens = (lens[:, None] - cols[None, :] * page_size).clamp(0, page_size)
    host = (tokens > 0) & (table >= 0)
    where = host.nonzero(as_tuple=True)  # once: table[host] and index[host] would each find it
    pages, inverse = torch.unique(table[where], sorted=True, return_inverse=True)
    index = torch.zeros_like(table)
    index[where] = inverse
    return HostPages(table, tokens, host, pages, index)


def plan_stream(kv: PagedKV, *, chunk_bytes: int = 16 << 20, num_slots: int = 2, min_chunks: int = 1,
                min_chunk_bytes: int = 2 << 20, ring_bytes: int = STREAM_RING_BYTES, reuse: StreamPlan | None = None,
                host_table: tuple[torch.Tensor, torch.Tensor] | None = None) -> StreamPlan:
    """Plan the stream variant for `kv` (reads its block table once); the HBM ring is
    2 * num_slots * chunk_bytes (K and V), at most ring_bytes (64 MiB by default), and a new ring holds no more
    than the host pages the batch reads (or min_chunk_bytes per slot) need.

    reuse : an earlier plan (a serving path's previous step) whose ring, copy stream and events this one
        takes over when its ring holds enough pages per slot for the same page shape; a ring too small is
        replaced by one a quarter larger at least (up to chunk_bytes and ring_bytes over all slots), so growing
        contexts do not allocate a ring of a new size every step. The earlier plan must not be used afterwards.
    host_table : (block table, seq_lens) as CPU tensors equal to kv's, where the caller has them: reading
        kv's from the GPU is a device sync.
    ring_bytes : the most the ring (all slots, K and V) may hold; the kernel benchmarks' target keeps the default
        64 MiB, a serving path may allow more slots (ZeroCopyPath's stream_slots).

    min_chunks > 1 cuts small caches into that many chunks (of >= min_chunk_bytes) so copy and math overlap;
    it is off by default because each chunk costs ~0.1 ms of Python launches: on the H200 a 16 MiB cache
    took 0.63 ms as four 2 MiB chunks and 0.36 ms as one.
    """
    page_bytes = kv.page_size * kv.num_kv_heads * kv.head_dim * kv.host_k.element_size()
    most = chunk_bytes // page_bytes
    table, seq_lens = host_table if host_table is not None else (kv.block_table.cpu(), kv.seq_lens.cpu())
    hp = host_pages(table, seq_lens, kv.page_size)
    read = max(len(hp.pages), 1)  # pages read by this batch, not the arena
    chunk_pages = min(most, max(math.ceil(read / min_chunks), min_chunk_bytes // page_bytes, 1))
    check(chunk_pages >= 1 and num_slots >= 2 and 2 * num_slots * chunk_pages * page_bytes <= ring_bytes,
          f"stream ring of {num_slots} slots x 2 x {chunk_bytes} B must hold >= 1 page ({page_bytes} B) per slot, "
          f">= 2 slots and <= {ring_bytes} B")
    tables, lens, copies, hbm_pass = stream_schedule(table, seq_lens, kv.page_size, chunk_pages, hp=hp)
    device = kv.block_table.device
    page_shape = tuple(kv.host_k.shape[1:])
    fits = (reuse is not None and reuse.ring_k is not None and reuse.ring_k.shape[0] == num_slots
            and tuple(reuse.ring_k.shape[2:]) == page_shape and reuse.ring_k.dtype == kv.dtype
            and reuse.ring_k.device == device)
    if fits and reuse.ring_k.shape[1] >= chunk_pages:
        ring_k, ring_v, side, filled, freed = reuse.ring_k, reuse.ring_v, reuse.side, reuse.filled, reuse.freed
    else:
        # grow: a ring of a new size every step would allocate (and fragment torch's cache) every step
        held = grown_pages(chunk_pages, reuse.ring_k.shape[1] if fits else 0,
                           min(most, ring_bytes // (2 * num_slots * page_bytes)))
        if reuse is not None:
            release_ring(reuse)
        ring_k, ring_v, side, filled, freed = new_ring((num_slots, held, *page_shape), kv.dtype, device, num_slots)
    rows, at, chunk = _last_token_slots(hp, seq_lens, kv.page_size, chunk_pages)
    slot_rows = ring_k.shape[1] * kv.page_size  # token rows per ring slot
    # each host-to-device copy of a small pageable tensor costs ~20 us of host time before the step's first
    # copy: the tables go over as one int32 tensor, the last tokens' rows as one int64 tensor, then views
    blocks, sizes = [torch.zeros(0, dtype=torch.int64)], []
    for c in range(min(num_slots, len(copies))):  # per chunk: [sequences, their ring row in slot 0, 1, ...]
        mine = chunk == c
        blocks += [rows[mine], *(at[mine] + s * slot_rows for s in range(num_slots))]
        sizes.append(int(mine.sum()))
    flat = torch.cat(blocks).to(device)
    last, start = [], 0
    for n in sizes:
        views = flat[start:start + n * (1 + num_slots)].view(1 + num_slots, n)
        last.append((views[0], tuple(views[1:])) if n else None)
        start += n * (1 + num_slots)
    both = torch.cat([tables.flatten(), lens.flatten()]).to(device)
    return StreamPlan(
        passes=both[:tables.numel()].view(tables.shape), lens=both[tables.numel():].view(lens.shape), copies=copies,
        hbm_pass=hbm_pass,
        ring_k=ring_k, ring_v=ring_v, side=side, filled=filled, freed=freed,
        last=tuple(last), page_bytes=page_bytes,
    )  # fmt: skip


def grown_pages(need: int, held: int, most: int) -> int:
    """Pages per slot of a ring replacing one of `held` pages (0: none) that cannot hold `need`: a quarter
    more than it held at least, at most `most` (never below `need`)."""
    return max(need, min(most, held * 5 // 4))


def new_ring(shape: tuple, dtype: torch.dtype, device: torch.device, slots: int):
    """(ring_k, ring_v, copy stream, filled events, freed events) of a new ring. The rings are marked as used
    by the copy stream, so when they are freed the caching allocator does not hand their memory out before
    that stream's queued copies (a prefetch no call consumed) are done, whichever stream frees them."""
    side = torch.cuda.Stream(device)
    rings = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
    for r in rings:
        r.record_stream(side)
    events = [torch.cuda.Event() for _ in range(2 * slots)]
    for e in events:  # torch creates an event on its first record; the C++ queue takes the handles
        e.record(side)
    return (*rings, side, events[:slots], events[slots:])


def release_ring(owner) -> None:
    """Drop `owner`'s ring (a StreamPlan or a PrefillRing whose ring a larger one replaces); new_ring's
    record_stream keeps the memory from reuse until its copies are done."""
    owner.ring_k = owner.ring_v = None


def _last_token_slots(hp: HostPages, seq_lens: torch.Tensor, page_size: int,
                      chunk_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequences, token rows within a ring slot, chunks) of each sequence's last token whose page is read from
    host memory (CPU), from host_pages' `hp` of the same table and lens. stream_schedule cuts the sorted host
    pages into chunks of chunk_pages, so page i is chunk i // chunk_pages at position i % chunk_pages of its
    ring slot."""
    lens = seq_lens.to(torch.int64)
    rows = torch.nonzero(lens > 0).flatten()
    col = (lens[rows] - 1) // page_size
    keep = hp.host[rows, col]
    i, rows = hp.index[rows, col][keep], rows[keep]
    return rows, (i % chunk_pages) * page_size + (lens[rows] - 1) % page_size, i // chunk_pages


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
    plan.side.wait_stream(torch.cuda.current_stream(plan.ring_k.device))
    _set_queue(plan, [(k.data_ptr(), v.data_ptr()) for k, v in pools])
    plan.copied = _native(plan).fill(0, 0, plan.ring_k.shape[0], STREAM_WAIT_FOR_READERS)
    return plan.copied


# Test hooks of the C++ loop (tests/test_cuda_decode.py): GPU clock cycles each chunk's kernel is delayed by
# (readers lagging their copies), and whether a copy waits for its slot's last reader (False: a mutation the
# tests must catch).
STREAM_LAG_CYCLES = 0
STREAM_WAIT_FOR_READERS = True


def _native(plan: StreamPlan):
    """The plan's C++ StreamQueue, made on first use (once per plan, so per serving step)."""
    if plan.native is None:
        num_slots = plan.ring_k.shape[0]
        row = math.prod(plan.ring_k.shape[3:])  # one token of one layer: num_kv_heads x head_dim
        last = [plan.last[c] for c in range(min(num_slots, len(plan.copies)))]
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
    plan.queue, plan.call, plan.copied, plan.consumed = queue, 0, 0, 0
    _native(plan).set_queue([k for k, _ in queue], [v for _, v in queue])


def _run_stream(q, kv: PagedKV, plan: StreamPlan, out, tile_kv, scale, num_splits, last_kv=None) -> None:
    """One call's chunks (copies, waits, last tokens, kernels), HBM pass and merge, issued by the plan's C++
    StreamQueue in one call: a Python loop per chunk cost ~4x swap's host time per layer (H200, 2026-12-01)."""
    if plan.passes.shape[1] != q.shape[0]:
        raise ConfigError(f"stream plan is for batch {plan.passes.shape[1]}, q has batch {q.shape[0]}")
    main = torch.cuda.current_stream(q.device)
    n = len(plan.copies)
    pools = (kv.host_k.data_ptr(), kv.host_v.data_ptr())
    if not (plan.call < len(plan.queue) and plan.queue[plan.call] == pools):
        # not the call the queue expects (no prefetch, or other pools): a queue of this call alone, whose copies
        # follow everything queued so far (the wait_stream below; copies queued for other pools are never read)
        _set_queue(plan, [pools])
    first, early = plan.call * n, plan.copied  # chunks copied before this call: before its caller's stores
    plan.call += 1
    num_passes = plan.passes.shape[0]
    if num_passes == 0:  # no sequence has a token
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
    plan.copied, plan.consumed = _native(plan).run_layer(
        handle, first, plan.copied, early, q.data_ptr(), out.data_ptr(), ptr(o_parts), ptr(lse_parts),
        plan.passes.data_ptr(), plan.lens.data_ptr(), num_passes, plan.hbm_pass, kv.hbm_k.data_ptr(),
        kv.hbm_v.data_ptr(), part_o, part_lse, counters, batch, num_heads, num_kv_heads, head_dim, width, page_size,
        splits, tiles_per_split, hpc, tile_kv, DTYPE_CODES[q.dtype], LOAD_MODES[LOAD_MODE], int(SPLIT_MAJOR), scale,
        last_k, last_v, batch, STREAM_LAG_CYCLES, STREAM_WAIT_FOR_READERS,
    )  # fmt: skip


def merge_passes(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
    """out = the softmax-over-LSE weighted sum of the stream passes' outputs (decode and prefill).

    parts: (O, natural-log LSE) per pass; every O has out's shape (or one it views as), every LSE that shape
    without the last dim; any strides and float dtypes, so a pass can hand over a permuted view instead of a
    copy. One fp32 accumulator, updated in place per pass: each pass's O is read once.
    """
    # a row with no key in any pass (a sequence of length 0) has only -inf LSEs: weight 0, so its output is 0
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0).nan_to_num(0.0).unsqueeze(-1)
    acc = parts[0][0] * weights[0]  # fp32 (the weights are)
    for (o, _), w in zip(parts[1:], weights[1:], strict=True):
        acc.addcmul_(o, w)
    out.view(acc.shape).copy_(acc)
