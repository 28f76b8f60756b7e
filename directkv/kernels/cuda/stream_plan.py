"""Host-side plan of the decode attention `stream` variant (decode_attention.py runs it).

The copy engine moves the host pages a batch reads into a small HBM ring, chunk by chunk, while the tiled kernel
reads the previous chunk. Planned once per block table (a serving step), reused by every layer: the chunks'
copy runs, one block table and token count per pass, the ring (kept across steps and grown by a quarter when
too small) and the rows where each sequence's last token lands in the ring. Host array work plus the ring's
allocation; no kernel runs here. The array work is numpy's: each of its ~50 small operations costs ~1 us of
host time where torch's CPU ops cost ~5-10 us, and the planning of a step comes before its first copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from directkv.errors import check
from directkv.kernels.paged import PagedKV
from directkv.kernels.traffic_model import (
    STREAM_CHUNK_BYTES,
    STREAM_MIN_CHUNK_BYTES,
    STREAM_RING_BYTES,
    STREAM_SLOTS,
)


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
        this plan serves in order (decode_attention.prefetch_stream's pools; one entry, the call's own, without
        it); call is the queue index of the next call; chunk c of call i is chunk g = i * len(copies) + c of the queue and sits in
        slot g % num_slots; copied / consumed count the queue's chunks whose copies / kernels are queued. A
        copy waits for its slot's last reader, so copied <= consumed + num_slots.
    native : the C++ StreamQueue over this plan's ring, runs, events and last-token rows (csrc stream_queue.h),
        made on the plan's first GPU use (decode_attention._native): it issues a call's chunks in one Python call.
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
    batch, cols = table.shape
    if num_passes == 0:  # no sequence has a token: no pass
        return torch.zeros((0, batch, 1), dtype=torch.int32), torch.zeros((0, batch), dtype=torch.int32), copies, False
    # each column's pass (its page's chunk; the HBM pass last; num_passes where unused) and entry in that pass,
    # then one stable sort per row puts every pass's columns together in logical order: one sort for all passes
    # (a sort per pass cost ~0.1 ms each at batch 48 on the host's critical path)
    key = np.where(host, index // chunk_pages, np.where(hbm, len(copies), num_passes))
    entry = np.where(host, -(index % chunk_pages + 1), table)
    r = np.arange(batch)[:, None]
    order = r, np.argsort(key, axis=1, kind="stable")
    key_sorted, entry_sorted, tokens_sorted = key[order], entry[order], tokens[order]
    per_row = num_passes + 1  # key values per row; each row's columns per key counted in one flat bincount
    flat = (key + r * per_row).ravel()
    counts = np.bincount(flat, minlength=batch * per_row).reshape(batch, per_row)
    rank = np.arange(cols) - (counts.cumsum(1) - counts)[r, key_sorted]
    width = max(int(counts[:, :num_passes].max()), 1)
    rows, at = np.nonzero(key_sorted < num_passes)  # once: every boolean index is a nonzero
    passes = key_sorted[rows, at]
    out_tables = np.zeros((num_passes, batch, width), dtype=np.int32)
    out_tables[passes, rows, rank[rows, at]] = entry_sorted[rows, at]
    out_lens = np.bincount(passes * batch + rows, weights=tokens_sorted[rows, at], minlength=num_passes * batch)
    return (torch.from_numpy(out_tables), torch.from_numpy(out_lens.astype(np.int32).reshape(num_passes, batch)),
            copies, has_hbm)


def chunk_runs(pages, chunk_pages: int, positions=None) -> list[torch.Tensor]:
    """The copies of each chunk of the sorted page ids `pages` (1-D, a CPU tensor or an array; chunk c:
    pages[c * chunk_pages:][:chunk_pages]) as (first page, first position in the chunk, pages) runs of
    consecutive ids, one int64 `[runs, 3]` CPU tensor per chunk (views of one contiguous tensor), the layout
    copy_runs_packed reads by pointer. positions: each page's place in the chunked destination (sorted; default
    0, 1, 2, ...), for a copy of some pages of a larger set (swap's staging, which leaves a step's new pages
    uncopied): a run then also needs consecutive positions. Array ops only: a Python loop over the runs cost
    ~5 ms per step at ~4000 runs (fragmented decode pages) before any copy began."""
    pages = np.asarray(pages, dtype=np.int64)
    n = len(pages)
    if n == 0:
        return []
    index = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    first = np.ones(n, dtype=bool)
    first[1:] = (pages[1:] != pages[:-1] + 1) | (index[1:] != index[:-1] + 1) | (index[1:] % chunk_pages == 0)
    starts = np.flatnonzero(first)
    runs = np.stack([pages[starts], index[starts] % chunk_pages, np.diff(starts, append=n)], axis=1)
    per_chunk = np.bincount(index[starts] // chunk_pages, minlength=-(-(index[-1] + 1) // chunk_pages))
    return list(torch.split(torch.from_numpy(runs), per_chunk.tolist()))


class HostPages(NamedTuple):
    """The host pages a batch reads, found once per block table (host_pages); numpy arrays."""

    table: np.ndarray  # [batch, width] int64 block table
    tokens: np.ndarray  # [batch, width] int64 tokens in each column's page
    host: np.ndarray  # [batch, width] bool: the column's page is a host page holding tokens
    pages: np.ndarray  # [pages] int64 sorted unique host page ids the batch reads
    index: np.ndarray  # [batch, width] int64 each host column's index into pages (0 elsewhere)


def host_pages(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> HostPages:
    """HostPages of a block table `[batch, width]` and seq_lens `[batch]` (CPU tensors). The indices come from
    unique's inverse: torch's CPU searchsorted took ~0.3 ms per step on the H200 host."""
    check(block_table.device.type == "cpu" and seq_lens.device.type == "cpu",
          f"host_pages plans from CPU copies of the block table and seq_lens (plan_stream's host_table); got "
          f"{block_table.device} and {seq_lens.device}")
    table, lens = block_table.numpy().astype(np.int64), seq_lens.numpy().astype(np.int64)
    tokens = np.clip(lens[:, None] - np.arange(table.shape[1])[None, :] * page_size, 0, page_size)
    host = (tokens > 0) & (table >= 0)
    where = np.nonzero(host)  # once: table[host] and index[host] would each find it
    pages, inverse = np.unique(table[where], return_inverse=True)
    index = np.zeros_like(table)
    index[where] = inverse.ravel()
    return HostPages(table, tokens, host, pages, index)


def plan_stream(kv: PagedKV, *, chunk_bytes: int = STREAM_CHUNK_BYTES, num_slots: int = STREAM_SLOTS,
                min_chunks: int = 1, min_chunk_bytes: int = STREAM_MIN_CHUNK_BYTES, ring_bytes: int = STREAM_RING_BYTES,
                reuse: StreamPlan | None = None,
                host_table: tuple[torch.Tensor, torch.Tensor] | None = None,
                side: torch.cuda.Stream | None = None) -> StreamPlan:
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
        64 MiB, a serving path may allow more (ZeroCopyPath's decode_slots of decode_chunk_bytes).
    side : the copy stream of a new ring (None: a stream of its own; a ring taken over keeps its stream). A
        serving path gives its decode and prompt rings one stream, so their copies run in the order it queues
        them (ZeroCopyPath.copy_stream).

    Each ring slot holds min(chunk_bytes, max(read / min_chunks, min_chunk_bytes)) of K, and the pages read are cut
    into as few chunks of at most a slot as will do, all of one size (balanced_chunk_pages), so a chunk may be
    smaller than min_chunk_bytes. min_chunks > 1 cuts small caches into about that many chunks so copy and math
    overlap; it is off by default: on the H200 it was slower both before the C++ loop (a 16 MiB cache took
    0.63 ms as four 2 MiB chunks and 0.36 ms as one) and after it (bench_decode's stream:4chunks rows, 4K x 1,
    0.8-0.9 points of the copy rate below one chunk, 2026-12-01).
    """
    page_bytes = kv.page_size * kv.num_kv_heads * kv.head_dim * kv.host_k.element_size()
    most = chunk_bytes // page_bytes
    table, seq_lens = host_table if host_table is not None else (kv.block_table.cpu(), kv.seq_lens.cpu())
    hp = host_pages(table, seq_lens, kv.page_size)
    read = max(len(hp.pages), 1)  # pages read by this batch, not the arena
    # slots keep the size they had before chunks were balanced, so rings are reused and grown as before
    slot_pages = min(most, max(math.ceil(read / min_chunks), min_chunk_bytes // page_bytes, 1))
    check(slot_pages >= 1 and num_slots >= 2 and 2 * num_slots * slot_pages * page_bytes <= ring_bytes,
          f"stream ring of {num_slots} slots x 2 x {chunk_bytes} B must hold >= 1 page ({page_bytes} B) per slot, "
          f">= 2 slots and <= {ring_bytes} B")
    chunk_pages = balanced_chunk_pages(read, slot_pages)
    tables, lens, copies, hbm_pass = stream_schedule(table, seq_lens, kv.page_size, chunk_pages, hp=hp)
    device = kv.block_table.device
    page_shape = tuple(kv.host_k.shape[1:])
    fits = (reuse is not None and reuse.ring_k is not None and reuse.ring_k.shape[0] == num_slots
            and tuple(reuse.ring_k.shape[2:]) == page_shape and reuse.ring_k.dtype == kv.dtype
            and reuse.ring_k.device == device)
    if fits and reuse.ring_k.shape[1] >= slot_pages:
        ring_k, ring_v, side, filled, freed = reuse.ring_k, reuse.ring_v, reuse.side, reuse.filled, reuse.freed
    else:
        # grow: a ring of a new size every step would allocate (and fragment torch's cache) every step
        held = grown_pages(slot_pages, reuse.ring_k.shape[1] if fits else 0,
                           min(most, ring_bytes // (2 * num_slots * page_bytes)))
        ring_k, ring_v, side, filled, freed = new_ring((num_slots, held, *page_shape), kv.dtype, device, num_slots,
                                                       side)
    if reuse is not None:
        release_ring(reuse)  # taken over or replaced: the earlier plan must not copy into this ring
    rows, at, chunk = _last_token_slots(hp, seq_lens, kv.page_size, chunk_pages)
    slot_rows = ring_k.shape[1] * kv.page_size  # token rows per ring slot
    # each host-to-device copy of a small pageable tensor costs ~20 us of host time before the step's first
    # copy: the tables go over as one int32 tensor, the last tokens' rows as one int64 tensor, then views
    blocks, sizes = [np.zeros(0, dtype=np.int64)], []
    for c in range(min(num_slots, len(copies))):  # per chunk: [sequences, their ring row in slot 0, 1, ...]
        mine = chunk == c
        blocks += [rows[mine], *(at[mine] + s * slot_rows for s in range(num_slots))]
        sizes.append(int(mine.sum()))
    flat = torch.from_numpy(np.concatenate(blocks)).to(device)
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


def balanced_chunk_pages(read: int, most: int) -> int:
    """Pages per chunk when `read` pages are cut into as few chunks of <= most pages as will do, of equal size
    (the last short by fewer pages than there are chunks). With chunks of `most` a decode reading one page past
    a multiple of it got a one-page last chunk: its copy ended before the kernel of the chunk before had freed
    the slot the next copy needed, and the copy engine idled for that kernel (~60 us per layer at Llama
    16K x 1 on the H200, 2026-12-01: stream's decode-only steps 43.1 ms against swap's 40.9)."""
    return math.ceil(read / math.ceil(read / most))


def grown_pages(need: int, held: int, most: int) -> int:
    """Pages per slot of a ring replacing one of `held` pages (0: none) that cannot hold `need`: a quarter
    more than it held at least, at most `most` (never below `need`)."""
    return max(need, min(most, held * 5 // 4))


def new_ring(shape: tuple, dtype: torch.dtype, device: torch.device, slots: int,
             side: torch.cuda.Stream | None = None):
    """(ring_k, ring_v, copy stream, filled events, freed events) of a new ring; side: its copy stream (None: a
    new one). The rings are marked as used by the copy stream, so when they are freed the caching allocator does
    not hand their memory out before that stream's queued copies (a prefetch no call consumed) are done,
    whichever stream frees them."""
    side = torch.cuda.Stream(device) if side is None else side
    rings = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
    for r in rings:
        r.record_stream(side)
    events = [torch.cuda.Event() for _ in range(2 * slots)]
    for e in events:  # torch creates an event on its first record; the C++ queue takes the handles
        e.record(side)
    return (*rings, side, events[:slots], events[slots:])


def release_ring(owner) -> None:
    """Drop `owner`'s ring (a StreamPlan whose ring a later plan took over or replaced, or a PrefillRing whose
    ring a larger one replaces) and a plan's C++ queue, which holds the ring's addresses; new_ring's
    record_stream keeps the memory from reuse until its copies are done."""
    owner.ring_k = owner.ring_v = None
    if isinstance(owner, StreamPlan):
        owner.native = None


def _last_token_slots(hp: HostPages, seq_lens: torch.Tensor, page_size: int,
                      chunk_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequences, token rows within a ring slot, chunks) of each sequence's last token whose page is read from
    host memory (int64 arrays), from host_pages' `hp` of the same table and lens (a CPU tensor).
    stream_schedule cuts the sorted host pages into chunks of chunk_pages, so page i is chunk i // chunk_pages
    at position i % chunk_pages of its ring slot."""
    lens = seq_lens.numpy().astype(np.int64)
    rows = np.flatnonzero(lens > 0)
    col = (lens[rows] - 1) // page_size
    keep = hp.host[rows, col]
    i, rows = hp.index[rows, col][keep], rows[keep]
    return rows, (i % chunk_pages) * page_size + (lens[rows] - 1) % page_size, i // chunk_pages
