"""The prefill `stream` variant's host side: how a sequence's past is cut into ring chunks (stream_passes,
plan_prefill_stream), the HBM ring kept across calls (PrefillRing, prefill_ring) and the copies into it
(copy_pass, prefetch_prefill_stream). prefill_attention runs the passes over them (its `_run_stream`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from directkv.errors import check
from directkv.kernels.cuda.decode_attention import copy_runs_packed
from directkv.kernels.cuda.stream_plan import (
    HostPages,
    grown_pages,
    host_pages,
    new_ring,
    release_ring,
    stream_schedule,
)
from directkv.kernels.paged import PagedKV, sequence_runs
from directkv.kernels.traffic_model import (
    STREAM_CHUNK_BYTES,
    STREAM_MIN_CHUNK_BYTES,
    STREAM_RING_BYTES,
    STREAM_SLOTS,
    check_stream_slots,
    prefill_ring_slots,
)


def check_stream_options(variant: str, chunk_bytes: int | None, min_chunks: int) -> None:
    """chunk_bytes and min_chunks belong to the stream variant; their values before any tensor is touched."""
    if variant != "stream":
        check(chunk_bytes is None and min_chunks == 1, f"chunk_bytes / min_chunks are options of variant 'stream'; "
              f"got variant {variant!r} with chunk_bytes={chunk_bytes!r}, min_chunks={min_chunks!r}")
        return
    check(isinstance(min_chunks, int) and not isinstance(min_chunks, bool) and min_chunks >= 1,
          f"min_chunks {min_chunks!r} must be an int >= 1")
    if chunk_bytes is not None:
        check(isinstance(chunk_bytes, int) and not isinstance(chunk_bytes, bool)
              and 1 <= chunk_bytes <= STREAM_CHUNK_BYTES,
              f"chunk_bytes {chunk_bytes!r} must be an int in 1..{STREAM_CHUNK_BYTES} (ring of {STREAM_SLOTS} slots "
              f"x (K, V) <= {STREAM_RING_BYTES} B)")


def stream_chunk_pages(host_pages: int, page_bytes: int, *, chunk_bytes: int | None = None, min_chunks: int = 1) -> int:
    """Pages per ring chunk for `host_pages` host pages of `page_bytes` bytes (of K; V the same).

    chunk_bytes (default STREAM_CHUNK_BYTES, the most a slot of the 64 MiB ring of 2 slots x (K, V) holds; a kept
    ring, prefill_ring, has slots of that size too, up to its `slots`) rounded down
    to whole pages and to the host pages there are; min_chunks > 1 cuts a small cache into that many chunks
    so copy and math overlap, but not into chunks below STREAM_MIN_CHUNK_BYTES (each chunk costs launches).
    Unlike decode's plan_stream (balanced_chunk_pages) the last chunk may be short, down to one page: a serving
    step prefetches a prompt's first chunks (one per ring slot) a layer ahead, and full-size first chunks copy more
    ahead than equal ones would. Whether the short tail idles the copy engine here, as it did in decode, was not
    measured.
    """
    check_stream_options("stream", chunk_bytes, min_chunks)
    chunk_bytes = STREAM_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    pages = chunk_bytes // page_bytes
    check(pages >= 1, f"chunk_bytes {chunk_bytes} holds no KV page of {page_bytes} B; valid: "
          f"{page_bytes}..{STREAM_CHUNK_BYTES}")
    cut = max(math.ceil(host_pages / min_chunks), STREAM_MIN_CHUNK_BYTES // page_bytes, 1)
    return min(pages, cut, max(host_pages, 1))  # no ring bigger than the pages it will hold


@dataclass(frozen=True)
class StreamPass:
    """One pass of the stream variant over part of the past (include_new = 0).

    table : `[width]` int32 CPU block table of the pass: ring positions -(pos + 1) for a ring chunk, the
        original (negative) entries for the HBM-page pass; pages in logical order, so a partly filled last
        page stays last and past_len counts the pass's tokens exactly.
    copies : ring chunk only: the (first host page, first ring position, pages) runs to copy, as the int64
        `[runs, 3]` CPU tensor copy_runs_packed reads by pointer (stream_plan.chunk_runs), made once for
        every call of the plan; no rows for the HBM pass.
    """

    table: torch.Tensor
    past_len: int
    copies: torch.Tensor
    ring: bool


def stream_passes(block_table: torch.Tensor, past_len: int, page_size: int, chunk_pages: int, *,
                  hp: HostPages | None = None) -> list[StreamPass]:
    """The passes over the past of one sequence (CPU in, CPU out): ring chunks of <= chunk_pages host pages in
    copy order, then one over the HBM-resident pages if any (stream_plan.stream_schedule, batch 1). A pass
    with no tokens is dropped (the kernel refuses zero keys); past_len 0 gives none. hp: host_pages of the
    table's first past_len tokens, where the caller has it already."""
    if past_len == 0:
        return []
    table = block_table.reshape(1, -1)[:, : -(-past_len // page_size)].cpu()
    tables, lens, copies, _ = stream_schedule(table, torch.tensor([past_len]), page_size, chunk_pages, hp=hp)
    passes = []
    for i in range(tables.shape[0]):
        ring = i < len(copies)
        if int(lens[i, 0]) > 0:
            runs = copies[i] if ring else torch.zeros((0, 3), dtype=torch.int64)
            passes.append(StreamPass(tables[i, 0], int(lens[i, 0]), runs, ring))
    return passes


@dataclass(frozen=True)
class PrefillStreamPlan:
    """The stream variant's host-side schedule for one block table and past, made once by plan_prefill_stream.

    passes : stream_passes of the past; tables : `[len(passes), width]` int32 block tables of the passes on
    the GPU (None when there are none); runs : per pass, the (first ring slot, slots) stretches the flash
    passes attend to (() for the HBM-page pass); chunk_pages, page_bytes : the ring's geometry.
    """

    past_len: int
    chunk_pages: int
    page_bytes: int
    passes: tuple[StreamPass, ...]
    tables: torch.Tensor | None
    runs: tuple[tuple[tuple[int, int], ...], ...]


def plan_prefill_stream(kv: PagedKV, *, chunk_bytes: int | None = None, min_chunks: int = 1,
                        device: torch.device | str | None = None) -> PrefillStreamPlan:
    """Plan stream for the one-sequence cache `kv` (reads its block table on the CPU once: a device sync
    when the table lives on the GPU). Reuse it for every call over the same table and past: the schedule is
    Python over every page (~ms at 16K tokens), which the GPU would otherwise wait for on every call."""
    check_stream_options("stream", chunk_bytes, min_chunks)
    check(kv.batch == 1, f"prefill takes one sequence; kv.batch is {kv.batch}")
    past_len = int(kv.seq_lens[0])
    table = kv.block_table[:1, : -(-past_len // kv.page_size)].cpu()
    page_bytes = math.prod(kv.host_k.shape[1:]) * kv.host_k.element_size()
    hp = host_pages(table, torch.tensor([past_len]), kv.page_size)
    read = len(hp.pages)  # the decode plan's count
    chunk_pages = stream_chunk_pages(read, page_bytes, chunk_bytes=chunk_bytes, min_chunks=min_chunks)
    passes = tuple(stream_passes(table, past_len, kv.page_size, chunk_pages, hp=hp))
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    tables = torch.stack([p.table for p in passes]).to(device) if passes else None
    runs = tuple(tuple(sequence_runs(-(p.table[: -(-p.past_len // kv.page_size)].numpy().astype(np.int64) + 1),
                                     p.past_len, kv.page_size)) if p.ring else () for p in passes)
    return PrefillStreamPlan(past_len, chunk_pages, page_bytes, passes, tables, runs)


@dataclass
class PrefillRing:
    """The stream variant's HBM ring kept across calls (every layer of a serving step), with its own copy stream
    and events: ring_k, ring_v `[slots, >= chunk_pages, page_size, num_kv_heads, head_dim]` (slots >=
    STREAM_SLOTS; chunk c of a call goes to slot c % slots). prefetched: (the plan, host K pointer, host V
    pointer, passes) that prefetch_prefill_stream copied ahead; None when none."""

    ring_k: torch.Tensor
    ring_v: torch.Tensor
    side: torch.cuda.Stream
    filled: list[torch.cuda.Event]
    freed: list[torch.cuda.Event]
    prefetched: tuple[PrefillStreamPlan, int, int, int] | None = None

    @property
    def nbytes(self) -> int:
        return 2 * self.ring_k.numel() * self.ring_k.element_size()

    @property
    def slots(self) -> int:
        return self.ring_k.shape[0]


def prefill_ring(plan: PrefillStreamPlan, pool: torch.Tensor, device: torch.device | str, *,
                 reuse: PrefillRing | None = None, slots: int = STREAM_SLOTS,
                 side: torch.cuda.Stream | None = None) -> PrefillRing:
    """A ring on `device` for the calls `plan` serves, over host pools shaped like `pool`
    `[num_pages, page_size, num_kv_heads, head_dim]`, of up to `slots` slots: one per ring chunk of the plan,
    at least STREAM_SLOTS (prefill_ring_slots), so prefetch_prefill_stream can copy up to `slots` chunks ahead.
    reuse: an earlier ring, returned as it is when it holds enough slots and pages per slot for the same page
    shape, else replaced by one with the slots needed (at least as many as it had, up to `slots`) and pages a
    quarter more at least (up to STREAM_CHUNK_BYTES per slot), so growing contexts do not allocate a ring of a
    new size every step. side: a new ring's copy stream (None: its own; plan_stream's side)."""
    check_stream_slots(slots)
    page_shape, device = tuple(pool.shape[1:]), torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" names the current device; tensors say cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    need = prefill_ring_slots(sum(p.ring for p in plan.passes), slots)
    fits = (reuse is not None and reuse.ring_k is not None and tuple(reuse.ring_k.shape[2:]) == page_shape
            and reuse.ring_k.dtype == pool.dtype and reuse.ring_k.device == device)
    if fits and reuse.ring_k.shape[1] >= plan.chunk_pages and reuse.slots >= need:
        return reuse
    pages = plan.chunk_pages
    if fits:  # slots and pages never shrink below the ring replaced
        need = max(need, min(reuse.slots, slots))
        held = reuse.ring_k.shape[1]
        pages = held if held >= pages else grown_pages(pages, held, STREAM_CHUNK_BYTES // plan.page_bytes)
    if reuse is not None:
        release_ring(reuse)
    return PrefillRing(*new_ring((need, pages, *page_shape), pool.dtype, device, need, side))


def prefetch_prefill_stream(plan: PrefillStreamPlan, ring: PrefillRing, host_k: torch.Tensor,
                            host_v: torch.Tensor, *, after_stream: bool = True) -> int:
    """Start copying the plan's first ring chunks of the pools (host_k, host_v) into `ring` now, on its copy
    stream (one chunk per slot at most: ring.slots); the next prefill_attention call with this plan and ring over the same
    pools skips those copies (the decodes' prefetch_stream queues every layer instead). The past pages a
    prompt chunk attends to are complete before its step, so any of them may be copied early. Returns the
    chunks issued. after_stream: the copies wait for everything the current stream has queued (the ring's
    readers and the pools' writers: a serving step's first prefetch); False: only for each slot's last readers
    (its freed event), for the step's later layers, whose pools' writers the first prefetch already waited for
    on this ring's copy stream."""
    n = min(sum(p.ring for p in plan.passes), ring.slots)  # ring passes come first
    if after_stream:
        ring.side.wait_stream(torch.cuda.current_stream(ring.ring_k.device))  # the ring's readers, the pools' writers
    else:
        for slot in range(n):
            ring.side.wait_event(ring.freed[slot])
    for c in range(n):
        copy_pass(plan, ring.ring_k, ring.ring_v, ring.side, ring.filled, ring.freed, host_k, host_v, c)
    ring.prefetched = (plan, host_k.data_ptr(), host_v.data_ptr(), n)
    return n


def copy_pass(plan: PrefillStreamPlan, ring_k, ring_v, side, filled, freed, host_k, host_v, c: int) -> None:
    """Queue ring pass c's copies into slot c % slots on `side` (slots: the ring's, ring_k.shape[0]), after the
    passes of c - slots."""
    slots = ring_k.shape[0]
    slot = c % slots
    if c >= slots:
        side.wait_event(freed[slot])  # the passes of chunk c - slots are done with the slot
    slot_bytes = ring_k.stride(0) * ring_k.element_size()
    runs = plan.passes[c].copies
    copy_runs_packed([ring_k.data_ptr() + slot * slot_bytes, ring_v.data_ptr() + slot * slot_bytes],
                     [host_k.data_ptr(), host_v.data_ptr()], runs, plan.page_bytes, side.cuda_stream)
    filled[slot].record(side)
