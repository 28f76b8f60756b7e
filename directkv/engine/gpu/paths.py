"""Each system's KV path on the GPU: where new K/V are stored and how attention reaches the cache.

A path sees one step at a time (`begin(plan)`), then one call per layer (`attend`), and accounts the
link bytes it caused. Kernels come from `directkv.kernels` (CUDA backend on a GPU, reference elsewhere),
so the same code runs in the CPU tests at toy sizes.

* ``ZeroCopyPath`` — directkv (KV in pinned host pages, read in place by the kernels) and hbm (pages in HBM).
  directkv's variant ``stream`` is the exception beyond the paper: its kernels' copy engine stages the
  pages through small rings on a side stream (decode and prefill ``stream`` variants; the decodes' ring and
  the first prompt chunk's of 384 MiB at most each by default, 768 for the OPT models, executor.directkv_stream_slots
  (auto): the decodes' in 3 (6) slots of 64 MiB of K and as much V, executor.directkv_stream_chunk_mib, the chunk's
  in up to 12 (24) of 16 MiB). The decodes'
  copies of all the step's layers are queued at its start (prefetch_stream): each is issued as soon as the
  kernel that last reads its ring slot is, so the next layers' chunks are copied during the dense work before
  their attention, as swap's copies overlap compute, but into the small ring instead of a whole layer's
  staging. The first prompt chunk's ring is prefetched one layer ahead, as many chunks as it has slots; both
  rings' copies go through one copy stream, in the order they are queued (ZeroCopyPath.copy_stream). A
  prompt chunk of a small past (<= 2 MiB of K) is read in place by the tiled kernel instead.
  With ``executor.directkv_pipelined`` a step runs as two parts (``attend_async``): halves of a decode-only
  step, or decodes | prompt chunks of a mixed one; one part's zero-copy attention runs on a side stream
  while the other part's dense layers run on the main one.
* ``StagedPath`` — swap: before each layer, the copy engine moves that layer's pages of the step's
  requests into an HBM staging pool on a side stream, one layer ahead (double-buffered), then HBM attention.
* ``CpuAttnPath`` (cpu_attn_path.py) — cpu_attn: decode attention on the CPU over the pinned pages; prefill like swap. Decode-only
  steps run as two halves pipelined by the runner (forward_pipelined): one half's CPU attention overlaps
  the other half's GPU layers, as in Neo.
* FlexGen's compressed path is in ``flexgen_path.py``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from directkv.engine.gpu.hbm_prefill import sdpa_chunk
from directkv.engine.gpu.plan import StepPlan
from directkv.errors import ConfigError, check
from directkv.kernels import get_op
from directkv.kernels.cuda import decode_attention as cuda_decode
from directkv.kernels.cuda import prefill_stream
from directkv.kernels.cuda.scatter_rows import scatter_rows
from directkv.kernels.cuda.side_stream import side_stream
from directkv.kernels.cuda.stream_plan import chunk_runs, plan_stream
from directkv.kernels.paged import PagedKV
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import (
    SERVING_STREAM_CHUNK_MIB,
    SERVING_STREAM_SLOTS,
    check_stream_slots,
    decode_ring,
    sdpa_chunk_traffic,
    stream_reads_in_place,
    stream_ring_bytes,
)
from directkv.memory import KVCacheManager


def kernel_backend(device: torch.device | str) -> str:
    """Our CUDA kernels for tensors on a CUDA device, the torch reference elsewhere: a CPU run on a machine with a
    GPU (the CPU tests under `pytest` there) stays on the reference, as on a machine without one."""
    return "cuda" if torch.device(device).type == "cuda" else "reference"


class ZeroCopyPath:
    """Attention kernels read the pages where they are: zero-copy from host, or HBM."""


    def __init__(self, kv: KVCacheManager, tier: str, variant: str, *, side_ctas: int | None = None,
                 stream_slots: int = SERVING_STREAM_SLOTS, stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB,
                 device: torch.device | str | None = None):
        """side_ctas: attend_async's kernels are split to about this many CTAs (None: the kernel's own plan,
        which fills every SM and leaves none to the other half's dense layers). stream_slots: the stream
        variant's rings' HBM, in slots of 16 MiB of K and of V (executor.directkv_stream_slots): how much the copy
        engine may run ahead of the kernels (and so of the host, which queues a slot's next copy after its
        reader). The decode ring holds it in slots of stream_chunk_mib MiB of K (executor.directkv_stream_chunk_mib;
        decode_ring); the first prompt chunk's ring in up to stream_slots slots of 16 MiB (prefill_ring_slots),
        prefetched a layer ahead. The default, 12, lets the copy engine stage the next layer's decode K/V during a
        prompt chunk's attention and dense work: with 2, Llama 16K steps of 2 decodes + a 2,046-token chunk took
        1.10-1.36x swap's time (H200, 2026-12-01)."""
        check_stream_slots(stream_slots)
        self.kv, self.tier, self.variant, self.side_ctas = kv, tier, variant, side_ctas
        self.stream_slots = stream_slots
        self.decode_slots, self.decode_chunk_bytes = decode_ring(stream_slots, stream_chunk_mib)
        self.device = torch.device(device) if device is not None else kv.hbm_k.device  # the run's device
        backend = kernel_backend(self.device)
        # the CUDA kernels write their rows of the step's output in place (out=): a copy after them was a
        # device-to-device cudaMemcpy on the main stream per layer, which seems to queue behind the ring's
        # copies (H200, 2026-12-01, ShareGPT at 30 req/s: stream 1.33x swap with it, 1.15x without, two calls)
        self.in_place = backend == "cuda"
        self.decode = get_op("decode_attention", backend)
        self.prefill = get_op("prefill_attention", backend)
        self.traffic = Traffic()  # link / HBM bytes this path caused, added to in place
        self.staging_bytes = 0
        self._kept: dict[str, object] = {"decode": None, "chunk": None}  # stream: rings kept across steps
        self._side: torch.cuda.Stream | None = None  # stream: the rings' copy stream (copy_stream)
        # a tiled prompt chunk's new tokens: "kernel" (with the past, one kernel) or "flash" (prefill_attention's
        # new_pass); set by make_path from executor.prefill_new_pass
        self.prefill_new_pass = "kernel"
        # a prompt chunk over HBM pages (hbm; the staged systems' staging pool): "kernel" (our tiled kernel) or
        # "sdpa" (hbm_prefill.sdpa_chunk); set by make_path from executor.hbm_prefill; and a chunk with no past
        # (directkv; executor.directkv_no_past_prefill). "kernel" here, the paper's path: make_path sets the
        # serving defaults (sdpa for directkv's chunks with no past) and keeps the other systems' at kernel
        self.hbm_prefill = "kernel"
        self.no_past_prefill = "kernel"

    def begin(self, plan: StepPlan) -> None:
        self.plan = plan
        self._parts: dict[tuple[int, int], tuple] = {}  # attend_async: (block table, lens) of each half, per step
        if self.variant == "stream":
            self._plan_streams(plan)
            # the rings share one copy stream (copy_stream), so what is queued first is copied first: the first
            # prompt chunk's layer 0 before the decodes' first layers, which its attention would otherwise wait for
            self._prefetch_chunk(0)
            if self.decode_plan is not None and self.tier == "host":
                layers = range(self.kv.model.num_layers)
                cuda_decode.prefetch_stream(self.decode_plan, [self.kv.pools(i, self.tier) for i in layers])

    def _plan_streams(self, p: StepPlan) -> None:
        """stream: the step's copy schedules, made once (one host read of each block table) and reused by every
        layer, whose pools differ but whose block tables do not."""
        k0, v0 = self.kv.pools(0, self.tier)
        # the rings (and their copy streams) are kept from step to step (plan_stream / prefill_ring's reuse):
        # a ring of a new size every step cost a few ms per step on the H200 in the steps after a prompt
        self.decode_plan = None
        if p.num_decodes:
            self.decode_plan = plan_stream(
                self._paged(self.tier, k0, v0, p.decode_table, p.decode_lens), reuse=self._kept["decode"],
                host_table=(p.decode_table_cpu, p.decode_lens_cpu), num_slots=self.decode_slots,
                chunk_bytes=self.decode_chunk_bytes, ring_bytes=stream_ring_bytes(self.stream_slots),
                side=self.copy_stream(k0.device))
            self._kept["decode"] = self.decode_plan
        # A chunk of a small past (<= 2 MiB of K; <= 4 MiB for a prompt's tail of <= 16 tokens) is read in place
        # by the tiled kernel instead (decided before any planning; stream_reads_in_place): the passes and merge
        # around its ring cost more than the read (H200, 2026-12-01: ShareGPT-like steps of 35-43 decodes beside a
        # few prompt chunks took 172-182 ms with every chunk streamed, against swap's 82-105).
        page_bytes = math.prod(k0.shape[1:]) * k0.element_size()
        self.chunk_streamed = [
            self.tier == "host" and not stream_reads_in_place(c.past_len, c.length, k0.shape[1], page_bytes)
            for c in p.chunks]
        # planned from the host copies of the chunk tables: reading the device ones back cost a sync per chunk
        self.chunk_plans = [
            prefill_stream.plan_prefill_stream(
                self._paged(self.tier, k0, v0, t, torch.tensor([c.past_len], dtype=torch.int32)), device=p.slots.device)
            if streamed else None
            for c, t, streamed in zip(p.chunks, p.chunk_tables_cpu, self.chunk_streamed, strict=True)]
        # the first chunk's ring is kept for the step, so each layer's first chunks can be prefetched like the
        # decodes'; any further chunk (a prompt ending inside the step's token budget) gets one per call
        first = self.chunk_plans[0] if self.chunk_plans else None
        self.chunk_ring = None
        if first is not None:
            self.chunk_ring = self._kept["chunk"] = prefill_stream.prefill_ring(
                first, k0, p.chunk_tables[0].device, reuse=self._kept["chunk"], slots=self.stream_slots,
                side=self.copy_stream(k0.device))
        # HBM rings held at once: the kept decode and first-chunk rings, and the largest per-call one
        ring = [4 * cp.chunk_pages * cp.page_bytes if cp is not None else 0 for cp in self.chunk_plans]
        held = max(ring[1:], default=0)
        for kept in self._kept.values():
            if kept is not None and kept.ring_k is not None:
                held += 2 * kept.ring_k.numel() * kept.ring_k.element_size()
        self.staging_bytes = max(self.staging_bytes, held)

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """stream: the one copy stream of the decodes' ring and the first prompt chunk's, made on first use.
        With a stream each, the copy engine served the decodes' copies of the layers ahead before the prompt
        chunk's of the next layer, whose attention waited while the decodes' ring was full: H200, 2026-12-02,
        Llama-3.1-8B steps of one 32K decode and a 2,047-token chunk over a 2K past took 122 ms against swap's
        90, the copy engine idle ~1.7 ms in every layer until a decode kernel freed a slot (profile)."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    @staticmethod
    def _paged(tier: str, k_pool, v_pool, table, lens) -> PagedKV:
        empty = k_pool[:0]
        if tier == "host":
            return PagedKV(k_pool, v_pool, empty, empty, table, lens)
        return PagedKV(empty, empty, k_pool, v_pool, table, lens)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: slice = slice(None)
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the new K/V of the step's `rows` (all by default) into their slots (zero-copy stores for the
        host tier)."""
        k_pool, v_pool = self.kv.pools(layer, self.tier)
        scatter_rows((k_pool, v_pool), (k, v), self.plan.slots[rows])
        if self.tier == "host":
            self.traffic.link_write_bytes += 2 * k.numel() * k.element_size()
        return k_pool, v_pool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.store(layer, k, v)
        p = self.plan
        out = self.attention(p, self.tier, q, k, v, k_pool, v_pool, p.decode_table, p.chunk_tables,
                             tables_cpu=((p.decode_table_cpu, p.decode_lens_cpu), p.chunk_tables_cpu))
        if self.variant == "stream" and layer + 1 < self.kv.model.num_layers:
            self._prefetch_chunk(layer + 1)
        return out

    def _prefetch_chunk(self, layer: int) -> None:
        """stream: start copying the first ring chunks of the first prompt chunk's past in `layer`'s pools now,
        so the copy engine works while the GPU runs the dense work before that layer's attention (the previous
        layer's output projection and MLP, this one's norm and QKV); the rest is copied during its attention.
        The step's first prefetch waits for all the main stream has queued (the previous step's stores); later
        ones only for their ring slots' readers (a prompt chunk's past is complete before its step)."""
        if self.tier != "host" or self.chunk_ring is None:
            return
        prefill_stream.prefetch_prefill_stream(self.chunk_plans[0], self.chunk_ring, *self.kv.pools(layer, self.tier),
                                               after_stream=layer == 0)

    def attention(self, p: StepPlan, tier: str, q, k, v, k_pool, v_pool, decode_table, chunk_tables, *,
                  tables_cpu: tuple | None = None) -> torch.Tensor:
        """Attention of the plan's rows over pools of `tier`; q/k/v rows are those of `p`. tables_cpu: CPU copies
        of ((decode_table, decode lens), chunk_tables) for the CUDA kernels' closed-form Traffic, which would
        otherwise read the device tables back: a device sync in a step's first layer, after which stream's copy
        engine idled until the host caught up (H200 profiles, 2026-12-01; no gain in serving was measured)."""
        out = torch.empty_like(q)
        variant = self.variant  # naive | tiled | stream (make_path refuses the rest; the staged systems are tiled)
        stream = variant == "stream"
        nd = p.num_decodes
        if nd:
            # stream: the decodes' new K/V were stored after some of this layer's chunks were queued (during earlier
            # layers), so they go into the ring too
            opts = {"plan": self.decode_plan, "last_kv": (k[:nd], v[:nd])} if stream else {}
            if self.in_place:
                opts["out"] = out[:nd]
                if tables_cpu is not None:
                    opts["host_table"] = tables_cpu[0]
            o, t = self.decode(q[:nd], self._paged(tier, k_pool, v_pool, decode_table, p.decode_lens),
                               variant=variant, **opts)
            if not self.in_place:
                out[:nd] = o
            self.traffic = self.traffic + t
        self._chunks(p, tier, variant, q, k, v, k_pool, v_pool, chunk_tables, out, stream=stream,
                     chunk_tables_cpu=None if tables_cpu is None else tables_cpu[1])
        return out

    def _chunks(self, p: StepPlan, tier: str, variant: str, q, k, v, k_pool, v_pool, chunk_tables, out, *,
                stream: bool = False, base: int = 0, chunk_tables_cpu: list | None = None) -> None:
        """Prefill attention of every prompt chunk of `p` into `out`; q/k/v/out rows start at the plan's row
        `base`; chunk_tables_cpu: CPU copies of chunk_tables (attention's tables_cpu)."""
        for i, (c, table) in enumerate(zip(p.chunks, chunk_tables, strict=True)):
            rows = slice(c.start - base, c.start - base + c.length)
            # no link bytes: the past is in HBM already, or there is none (directkv_no_past_prefill: the chunk's own
            # K/V are the projection's output in HBM; in the OPT-13B 3 x 16K steps holding a request's first
            # 8K-token chunk directkv's tiled kernel took 71-112 ms more than swap's SDPA and SDPA here 18 ms less
            # to 7 more, H200 2026-12-02, steps/ of context_sweep/20261202-161447-0 and -161554-1)
            if (self.hbm_prefill == "sdpa" and tier == "hbm") or (self.no_past_prefill == "sdpa" and c.past_len == 0):
                option = "executor.hbm_prefill" if tier == "hbm" else "executor.directkv_no_past_prefill"
                out[rows] = sdpa_chunk(q[rows], k[rows], v[rows], k_pool, v_pool, table[0], c.past_len,
                                       self.kv.page_size, option)
                self.traffic = self.traffic + sdpa_chunk_traffic(
                    c.length, c.past_len, num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                    dtype_bytes=q.element_size())
                continue
            lens = torch.tensor([c.past_len], dtype=torch.int32)  # host-side: the kernel takes past_len as an int, no sync
            streamed = stream and self.chunk_streamed[i]
            opts = {"stream_plan": self.chunk_plans[i], "stream_ring": self.chunk_ring if i == 0 else None} if streamed else {}
            chunk_variant = "tiled" if stream and not streamed else variant
            if self.in_place:  # the CUDA kernels
                opts["out"] = out[rows]
                if chunk_tables_cpu is not None:
                    opts["host_table"] = chunk_tables_cpu[i]
                if chunk_variant == "tiled" and self.prefill_new_pass != "kernel":
                    opts["new_pass"] = self.prefill_new_pass
            o, t = self.prefill(q[rows], k[rows], v[rows], self._paged(tier, k_pool, v_pool, table, lens),
                                variant=chunk_variant, causal=True, **opts)
            if not self.in_place:
                out[rows] = o
            self.traffic = self.traffic + t

    def attend_async(self, layer: int, rows: slice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """One part of a pipelined step (runner.forward_pipelined): store the part's new K/V, then queue its
        attention on a side stream; returns wait() -> out, which makes the main stream wait. A part is some
        of the decodes, or all prompt chunks (rows from the first chunk's row on).

        The zero-copy kernel is bound by the host link, the other part's projections and MLP by HBM (and the
        chunks' by the tensor cores), so the two can overlap, as swap's copy of the next layer overlaps this
        layer's compute.
        """
        p = self.plan
        chunks = rows.start == p.num_decodes and rows.stop > rows.start
        if self.variant not in ("naive", "tiled") or not (chunks or rows.stop <= p.num_decodes):
            raise ConfigError(f"attend_async serves variants naive / tiled, a part of the decodes or all chunks; "
                              f"got variant {self.variant!r}, rows {rows.start}:{rows.stop} of a step of "
                              f"{p.num_decodes} decodes")  # message built only on failure: hot path
        k_pool, v_pool = self.store(layer, k, v, rows)
        if not chunks:
            # the same table and lens tensors every layer: the kernels' Traffic memo reads them once per step
            key = (rows.start, rows.stop)
            if key not in self._parts:
                self._parts[key] = (p.decode_table[rows], p.decode_lens[rows],
                                    (p.decode_table_cpu[rows], p.decode_lens_cpu[rows]))
            table, lens, host = self._parts[key]
            paged = self._paged(self.tier, k_pool, v_pool, table, lens)

        def attention(splits: int | None = None) -> torch.Tensor:
            if chunks:
                out = torch.empty_like(q)
                self._chunks(p, self.tier, self.variant, q, k, v, k_pool, v_pool, p.chunk_tables, out,
                             base=rows.start, chunk_tables_cpu=p.chunk_tables_cpu)
                return out
            opts = {} if splits is None else {"num_splits": splits}
            if self.in_place:
                opts["host_table"] = host
            out, t = self.decode(q, paged, variant=self.variant, **opts)
            self.traffic = self.traffic + t
            return out

        if q.device.type != "cuda":
            out = attention()
            return lambda: out
        splits = None if chunks else self.side_splits(q, k_pool.shape[2], table.shape[1], k_pool.shape[1])
        main = torch.cuda.current_stream(q.device)
        side = side_stream(q.device, 0)[0]
        side.wait_stream(main)  # q and this part's new K/V are written on the main stream
        with torch.cuda.stream(side):
            out = attention(splits)
        done = torch.cuda.Event()
        done.record(side)
        # the caching allocator must not hand q's (or the chunks' new K/V's) block to the main stream, nor
        # out's to the side stream, while the other stream may still use it
        for t in (q, k, v) if chunks else (q,):
            t.record_stream(side)
        out.record_stream(main)

        def wait() -> torch.Tensor:
            main.wait_event(done)
            return out

        return wait

    def side_splits(self, q: torch.Tensor, num_kv_heads: int, width: int, page_size: int) -> int | None:
        """attend_async's split count over block tables `width` pages wide: CTAs = rows x head groups x splits ~
        side_ctas, but no fewer splits than keep each within the kernel's shared-memory page table."""
        if self.side_ctas is None:
            return None
        groups = q.shape[0] * q.shape[1] // cuda_decode.heads_per_cta(self.variant, q.shape[1] // num_kv_heads)
        return max(1, self.side_ctas // groups, cuda_decode.table_min_splits(width, page_size))


class _Stager:
    """Copies one layer's pages of the step's requests into HBM, one layer ahead, on a side stream.

    Pages are copied as contiguous runs of host page ids (all of a pool's runs issued by one C++ call,
    copy_runs_packed); the block tables are remapped onto the staging pool, whose entries are HBM pages.
    """

    def __init__(self, host_pools, device: torch.device):
        self.host_pools = host_pools  # layer -> list of host tensors [num_pages, ...] (pinned in a CUDA run)
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers: list[list[torch.Tensor]] = [[], []]  # this step's views of the staging pool
        self._pool: list[list[torch.Tensor]] = [[], []]  # two buffers of `capacity` pages, kept across steps
        self.capacity = 0
        self.ready = [None, None]
        self.free = [None, None]

    def plan(self, page_lists: list[list[int]], past_pages: list[int] | None = None) -> list[torch.Tensor]:
        """Fix this step's page set; returns the remapped block tables (one `[1, pages]` int32 CPU tensor per page
        list, `[[0]]` for an empty one). past_pages: per list, how many of its leading pages to copy from the host
        (StepPlan.past_page_counts; None: all). The rest hold only this step's new tokens, which reach the staged
        copy by scatter_rows: they get staging pages but are not copied (a prompt chunk of 8K tokens had its 8K
        tokens' pages copied in every layer for nothing: 168 MB per OPT-13B layer)."""
        # Staged in host-page order, not request order: consecutive host pages then form one copy whatever
        # order the pages were handed out in (a request given recycled pages 256, 255, 254, ... had cost one
        # cudaMemcpy per 32 KB page: 2 x 1025 per layer at 16K context, 0.5-1 s per step on the H200).
        # Array ops, not a Python loop per page: this runs before the step's first copy.
        flat = torch.tensor(list(itertools.chain.from_iterable(page_lists)), dtype=torch.int64)
        self.pages, where = torch.unique(flat, sorted=True, return_inverse=True)
        copied = np.ones(len(self.pages), dtype=bool)
        if past_pages is not None:
            check(len(past_pages) == len(page_lists), f"past_pages has {len(past_pages)} entries for "
                  f"{len(page_lists)} page lists")
            old = np.concatenate([np.arange(len(pages)) < n for pages, n in zip(page_lists, past_pages, strict=True)]
                                 + [np.zeros(0, dtype=bool)])
            copied[:] = False
            np.logical_or.at(copied, where.numpy(), old)  # a page some list holds older tokens in is copied
        # copy_runs_packed's (host page, staging index, pages) runs, packed once for every layer's copies of the step
        staged = np.flatnonzero(copied)
        self.dma_runs = (chunk_runs(self.pages.numpy()[staged], len(self.pages), positions=staged)[0] if len(staged)
                         else torch.zeros((0, 3), dtype=torch.int64))
        # link bytes of one layer's staging, counted by every layer of the step
        self.layer_bytes = int(copied.sum()) * sum(p[0].numel() * p.element_size() for p in self.host_pools(0))
        n = max(1, len(self.pages))
        if n > self.capacity:  # grow by a quarter at least: a new size every step fragments torch's cache
            capacity = max(n, self.capacity * 5 // 4)
            # Drop the old pair before the new one is made, and hand its segments back to the device: the old
            # pair outlived the new one's allocation, and torch kept every smaller pool cached, so an OPT-13B
            # 3 x 32K run reserved 15.8 GB for 7.4 GB of staging (a Pie-like swap holds one buffer pair).
            # The price: while prompts fill the cache the pool grows in ~6 of 14 steps of an OPT-13B 3 x 16K run,
            # each growth adding 5-20 ms of planning (H200, 2026-12-03); decode-only steps never grow it.
            self.buffers = self._pool = [[], []]
            if self.cuda:
                self.stream.synchronize()  # the copy stream writes the pair by pointer: torch cannot track that use
                torch.cuda.empty_cache()
            self._pool = [[torch.empty((capacity, *p.shape[1:]), dtype=p.dtype, device=self.device)
                           for p in self.host_pools(0)] for _ in range(2)]
            self.capacity = capacity  # after the allocation: one that fails leaves no pool claiming a size
        self.buffers = [[t[:n] for t in pair] for pair in self._pool]
        tables = torch.split((-(where + 1)).to(torch.int32), [len(pages) for pages in page_lists])
        return [t.reshape(1, -1) if len(t) else torch.zeros((1, 1), dtype=torch.int32) for t in tables]

    @property
    def nbytes(self) -> int:
        """HBM the staging pool holds (its capacity, not this step's share)."""
        return sum(b.numel() * b.element_size() for buf in self._pool for b in buf)

    def issue(self, layer: int) -> None:
        buf = layer % 2
        bufs, pools = self.buffers[buf], self.host_pools(layer)
        if not self.cuda:
            for dst, src in zip(bufs, pools, strict=True):
                for src_start, dst_start, n in self.dma_runs.tolist():
                    dst[dst_start:dst_start + n] = src[src_start:src_start + n]
            return
        with torch.cuda.stream(self.stream):
            if self.free[buf] is not None:
                self.stream.wait_event(self.free[buf])  # the layer that used this buffer is done
            # One C++ call per pool issues every run (cudaMemcpyBatchAsync where CUDA 13 has it): at ~50 requests
            # per step the runs were hundreds per layer, and one torch copy_ per run from Python cost more than
            # the copies (H200, Alpaca at 30 req/s: swap 53 ms per token against directkv's 19.5).
            for dst, src in zip(bufs, pools, strict=True):
                cuda_decode.copy_runs_packed([dst.data_ptr()], [src.data_ptr()], self.dma_runs,
                                             src[0].numel() * src.element_size(), self.stream.cuda_stream)
            self.ready[buf] = torch.cuda.Event()
            self.ready[buf].record(self.stream)

    def acquire(self, layer: int) -> list[torch.Tensor]:
        buf = layer % 2
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[buf])
        return self.buffers[buf]

    def release(self, layer: int) -> None:
        if self.cuda:
            self.free[layer % 2] = torch.cuda.Event()
            self.free[layer % 2].record(torch.cuda.current_stream(self.device))


class StagedPath(ZeroCopyPath):
    """Pie-like swap: KV stays in pinned host pages; each layer's pages are staged into HBM by the copy engine."""

    def __init__(self, kv: KVCacheManager, *, device: torch.device | None = None, host_pools=None):
        """host_pools(layer) -> the host tensors to stage (pinned in a CUDA run), page-major (default: the arena's K
        and V)."""
        super().__init__(kv, "host", "tiled", device=device)
        pools = host_pools or (lambda layer: [kv.arena.k[layer], kv.arena.v[layer]])
        self.stager = _Stager(pools, self.device)

    def begin(self, plan: StepPlan) -> None:
        super().begin(plan)
        tables = self.stager.plan(plan.page_lists(self.kv), plan.past_page_counts(self.kv))
        self.stager.issue(0)  # first: the copy engine starts while the host builds the tables below
        dev = self.stager.device
        nd = plan.num_decodes
        width = max(t.shape[1] for t in tables) if tables else 1
        # one padded tensor (pad_sequence), not a pad per decode and a cat: this runs before every step's layers
        decode_cpu = (torch.nn.functional.pad(torch.nn.utils.rnn.pad_sequence([t[0] for t in tables[:nd]],
                                                                               batch_first=True),
                                              (0, width - max(t.shape[1] for t in tables[:nd])))
                      if nd else torch.zeros((0, 1), dtype=torch.int32))
        self.decode_table = decode_cpu.to(dev)
        self.chunk_tables = [t.to(dev) for t in tables[nd:]]
        self.tables_cpu = ((decode_cpu, plan.decode_lens_cpu), tables[nd:])  # attention's tables_cpu
        self.staging_bytes = max(self.staging_bytes, self.stager.nbytes)
        self.remap = self._slot_remap(plan.slots_cpu)  # once per step, not per layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_st, v_st = self.stager.acquire(layer)
        if layer + 1 < self.kv.model.num_layers:
            self.stager.issue(layer + 1)  # overlaps this layer's compute
        self.store(layer, k, v)  # new K/V to the host pages (the cache of record)
        # and into the staged copy, so this step's attention sees them: remap slots to staging pages
        scatter_rows((k_st, v_st), (k, v), self.remap)
        self.traffic.link_read_bytes += self.stager.layer_bytes
        out = self.attention(self.plan, "hbm", q, k, v, k_st, v_st, self.decode_table, self.chunk_tables,
                             tables_cpu=self.tables_cpu)
        self.stager.release(layer)
        return out

    def _slot_remap(self, host: torch.Tensor) -> torch.Tensor:
        """Host-pool slots of new tokens (a CPU tensor: the plan's slots_cpu, so no device sync) -> their slots in
        the staging pool, on its device (pages were staged in stager order)."""
        ps, pages = self.kv.page_size, self.stager.pages
        at = torch.searchsorted(pages, host // ps).clamp(max=max(len(pages) - 1, 0))
        # every new token's page is staged (page_lists hold the step's new tokens); a page that were not would be
        # written into its neighbour's staging page, silently
        check(len(host) == 0 or bool(torch.equal(pages[at], host // ps)),
              "swap staging: a new token's page is not among the step's staged pages")
        return (at * ps + host % ps).to(self.stager.device)
