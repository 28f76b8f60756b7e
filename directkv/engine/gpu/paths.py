"""Each system's KV path on the GPU: where new K/V are stored and how attention reaches the cache.

A path sees one step at a time (`begin(plan)`), then one call per layer (`attend`), and accounts the
link bytes it caused. Kernels come from `directkv.kernels` (CUDA backend on a GPU, reference elsewhere),
so the same code runs in the CPU tests at toy sizes.

* ``ZeroCopyPath`` — directkv (KV in pinned host pages, read in place by the kernels) and hbm (pages in HBM).
  directkv's variant ``stream`` is the exception beyond the paper: its kernels' copy engine stages the
  pages through rings of <= 64 MiB on a side stream (decode and prefill ``stream`` variants).
* ``StagedPath`` — swap: before each layer, the copy engine moves that layer's pages of the step's
  requests into an HBM staging pool on a side stream, one layer ahead (double-buffered), then HBM attention.
* ``CpuAttnPath`` — cpu_attn: decode attention on the CPU over the pinned pages; prefill like swap. Decode-only
  steps run as two halves pipelined by the runner (forward_pipelined): one half's CPU attention overlaps
  the other half's GPU layers, as in Neo.
* FlexGen's compressed path is in ``flexgen_path.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from directkv.engine.gpu.plan import StepPlan
from directkv.engine.systems import CPU_ATTN_KERNELS
from directkv.errors import unknown_name
from directkv.kernels import get_op
from directkv.kernels.cpu_decode_attention import cpu_decode_attention as native_cpu_decode_attention
from directkv.kernels.cuda import build
from directkv.kernels.paged import PagedKV, sequence_runs
from directkv.kernels.traffic import Traffic
from directkv.memory import KVCacheManager


def kernel_backend() -> str:
    return "cuda" if torch.cuda.is_available() else "reference"


class ZeroCopyPath:
    """Attention kernels read the pages where they are: zero-copy from host, or HBM."""

    def __init__(self, kv: KVCacheManager, tier: str, variant: str, *, tile_kv: int = 64):
        self.kv, self.tier, self.variant, self.tile_kv = kv, tier, variant, tile_kv
        backend = kernel_backend()
        self.decode = get_op("decode_attention", backend)
        self.prefill = get_op("prefill_attention", backend)
        self.traffic = Traffic()  # link / HBM bytes this path caused, added to in place
        self.staging_bytes = 0

    def begin(self, plan: StepPlan) -> None:
        self.plan = plan
        if self.variant == "stream":
            self._plan_streams(plan)

    def _plan_streams(self, p: StepPlan) -> None:
        """stream: the step's copy schedules, made once (one host read of each block table) and reused by every
        layer, whose pools differ but whose block tables do not."""
        from directkv.kernels.cuda.decode_attention import plan_stream
        from directkv.kernels.cuda.prefill_attention import plan_prefill_stream

        k0, v0 = self.kv.pools(0, self.tier)
        self.decode_plan = None
        if p.num_decodes:
            self.decode_plan = plan_stream(self._paged(self.tier, k0, v0, p.decode_table, p.decode_lens))
            ring = self.decode_plan.ring_k
            self.staging_bytes = max(self.staging_bytes, 2 * ring.numel() * ring.element_size())
        self.chunk_plans = [
            plan_prefill_stream(self._paged(self.tier, k0, v0, t, torch.tensor([c.past_len], dtype=torch.int32)),
                                device=t.device)
            for c, t in zip(p.chunks, p.chunk_tables, strict=True)]
        for cp in self.chunk_plans:  # 2 slots x (K, V) of chunk_pages pages, allocated per call
            self.staging_bytes = max(self.staging_bytes, 4 * cp.chunk_pages * cp.page_bytes)

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
        flat = (-1, *k_pool.shape[2:])
        k_pool.view(flat)[self.plan.slots[rows]] = k
        v_pool.view(flat)[self.plan.slots[rows]] = v
        if self.tier == "host":
            self.traffic.link_write_bytes += 2 * k.numel() * k.element_size()
        return k_pool, v_pool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.store(layer, k, v)
        return self.attention(self.plan, self.tier, q, k, v, k_pool, v_pool, self.plan.decode_table,
                              self.plan.chunk_tables)

    def attention(self, p: StepPlan, tier: str, q, k, v, k_pool, v_pool, decode_table, chunk_tables
                  ) -> torch.Tensor:
        """Attention of the plan's rows over pools of `tier`; q/k/v rows are those of `p`."""
        out = torch.empty_like(q)
        variant = self.variant if self.variant in ("naive", "stream") else "tiled"
        stream = variant == "stream" and tier == self.tier  # the staged systems call this on their HBM staging
        variant = "tiled" if variant == "stream" and not stream else variant
        if p.num_decodes:
            o, t = self.decode(q[: p.num_decodes], self._paged(tier, k_pool, v_pool, decode_table, p.decode_lens),
                               variant=variant, **({"plan": self.decode_plan} if stream else {}))
            out[: p.num_decodes] = o
            self.traffic = self.traffic + t
        for i, (c, table) in enumerate(zip(p.chunks, chunk_tables, strict=True)):
            rows = slice(c.start, c.start + c.length)
            lens = torch.tensor([c.past_len], dtype=torch.int32)  # host-side: the kernel takes past_len as an int, no sync
            o, t = self.prefill(q[rows], k[rows], v[rows], self._paged(tier, k_pool, v_pool, table, lens),
                                variant=variant, causal=True, **({"stream_plan": self.chunk_plans[i]} if stream else {}))
            out[rows] = o
            self.traffic = self.traffic + t
        return out


class _Stager:
    """Copies one layer's pages of the step's requests into HBM, one layer ahead, on a side stream.

    Pages are copied as contiguous runs of host page ids (one cudaMemcpy per run, all of a pool's runs issued
    by one C++ call); the block tables are remapped onto the staging pool, whose entries are HBM pages.
    """

    def __init__(self, host_pools, device: torch.device):
        self.host_pools = host_pools  # layer -> list of pinned CPU tensors [num_pages, ...]
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers: list[list[torch.Tensor]] = [[], []]  # this step's views of the staging pool
        self._pool: list[list[torch.Tensor]] = [[], []]  # two buffers of `capacity` pages, kept across steps
        self.capacity = 0
        self.ready = [None, None]
        self.free = [None, None]

    def plan(self, page_lists: list[list[int]]) -> list[torch.Tensor]:
        """Fix this step's page set; returns the remapped block tables (one per page list)."""
        # Staged in host-page order, not request order: consecutive host pages then form one copy whatever
        # order the pages were handed out in (a request given recycled pages 256, 255, 254, ... had cost one
        # cudaMemcpy per 32 KB page: 2 x 1025 per layer at 16K context, 0.5-1 s per step on the H200).
        self.pages = sorted({e for pages in page_lists for e in pages})
        order = {e: i for i, e in enumerate(self.pages)}
        self.runs = _runs(self.pages)
        self.dma_runs = [(src, dst, k) for dst, src, k in self.runs]  # copy_runs_async's (src, dst, pages) order
        n = max(1, len(self.pages))
        if n > self.capacity:  # grow by a quarter at least: a new size every step fragments torch's cache
            self.capacity = max(n, self.capacity * 5 // 4)
            self.buffers = [[], []]  # drop the old pair first, so both never coexist
            self._pool = [[torch.empty((self.capacity, *p.shape[1:]), dtype=p.dtype, device=self.device)
                           for p in self.host_pools(0)] for _ in range(2)]
        self.buffers = [[t[:n] for t in pair] for pair in self._pool]
        return [torch.tensor([[-(order[e] + 1) for e in pages] or [0]], dtype=torch.int32) for pages in page_lists]

    @property
    def nbytes(self) -> int:
        """HBM the staging pool holds (its capacity, not this step's share)."""
        return sum(b.numel() * b.element_size() for buf in self._pool for b in buf)

    def issue(self, layer: int) -> None:
        buf = layer % 2
        bufs, pools = self.buffers[buf], self.host_pools(layer)
        if not self.cuda:
            for dst, src in zip(bufs, pools, strict=True):
                for dst_start, src_start, n in self.runs:
                    dst[dst_start:dst_start + n] = src[src_start:src_start + n]
            return
        with torch.cuda.stream(self.stream):
            if self.free[buf] is not None:
                self.stream.wait_event(self.free[buf])  # the layer that used this buffer is done
            # One C++ call per pool issues every run (cudaMemcpyBatchAsync where CUDA 13 has it): at ~50 requests
            # per step the runs were hundreds per layer, and one torch copy_ per run from Python cost more than
            # the copies (H200, Alpaca at 30 req/s: swap 53 ms per token against directkv's 19.5).
            copy_runs = build.load("decode_attention").copy_runs_async
            for dst, src in zip(bufs, pools, strict=True):
                copy_runs([dst.data_ptr()], [src.data_ptr()], self.dma_runs, src[0].numel() * src.element_size(),
                          self.stream.cuda_stream)
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

    def bytes_per_layer(self) -> int:
        return sum(n for _, _, n in self.runs) * sum(p[0].numel() * p.element_size() for p in self.host_pools(0))


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(staging index, host page, length) runs of consecutive host pages."""
    runs = []
    for i, e in enumerate(pages):
        if runs and e == runs[-1][1] + runs[-1][2] and i == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, e, 1))
    return runs


class StagedPath(ZeroCopyPath):
    """Pie-like swap: KV stays in pinned host pages; each layer's pages are staged into HBM by the copy engine."""

    def __init__(self, kv: KVCacheManager, *, device: torch.device | None = None, host_pools=None, tile_kv: int = 64):
        """host_pools(layer) -> the pinned CPU tensors to stage, page-major (default: the arena's K and V)."""
        super().__init__(kv, "host", "tiled", tile_kv=tile_kv)
        pools = host_pools or (lambda layer: [kv.arena.k[layer], kv.arena.v[layer]])
        self.stager = _Stager(pools, torch.device(device) if device is not None else kv.hbm_k.device)

    def begin(self, plan: StepPlan) -> None:
        super().begin(plan)
        tables = self.stager.plan(plan.page_lists(self.kv))
        dev = self.stager.device
        nd = plan.num_decodes
        width = max(t.shape[1] for t in tables) if tables else 1
        self.decode_table = (torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables[:nd]])
                             if nd else torch.zeros((0, 1), dtype=torch.int32)).to(dev)
        self.chunk_tables = [t.to(dev) for t in tables[nd:]]
        self.staging_bytes = max(self.staging_bytes, self.stager.nbytes)
        self.remap = self._slot_remap(plan.slots)  # once per step, not per layer
        self.stager.issue(0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_st, v_st = self.stager.acquire(layer)
        if layer + 1 < self.kv.model.num_layers:
            self.stager.issue(layer + 1)  # overlaps this layer's compute
        self.store(layer, k, v)  # new K/V to the host pages (the cache of record)
        flat = (-1, *k_st.shape[2:])
        # and into the staged copy, so this step's attention sees them: remap slots to staging pages
        k_st.view(flat)[self.remap] = k
        v_st.view(flat)[self.remap] = v
        self.traffic.link_read_bytes += self.stager.bytes_per_layer()
        out = self.attention(self.plan, "hbm", q, k, v, k_st, v_st, self.decode_table, self.chunk_tables)
        self.stager.release(layer)
        return out

    def _slot_remap(self, slots: torch.Tensor) -> torch.Tensor:
        """Host-pool slots of new tokens -> slots in the staging pool (pages were staged in stager order)."""
        ps = self.kv.page_size
        lut = torch.full((max(self.stager.pages, default=0) + 1,), -1, dtype=torch.int64)
        lut[torch.tensor(self.stager.pages, dtype=torch.int64)] = torch.arange(len(self.stager.pages))
        host = slots.cpu()
        return (lut[host // ps] * ps + host % ps).to(slots.device)


class CpuAttnPath(StagedPath):
    """Neo-like: decode attention on the CPU over the pinned pages; prompt chunks attend on the GPU (staged)."""

    def __init__(self, kv: KVCacheManager, *, threads: int | None = None, tile_kv: int = 64, kernel: str = "flash"):
        super().__init__(kv, tile_kv=tile_kv)
        if kernel not in CPU_ATTN_KERNELS:
            raise unknown_name("cpu_attn kernel", kernel, CPU_ATTN_KERNELS)
        if threads:
            torch.set_num_threads(threads)
        self.kernel = kernel
        self._pool = None  # CPU worker of attend_async, made on first use

    def begin(self, plan: StepPlan) -> None:
        ZeroCopyPath.begin(self, plan)
        tables = self.stager.plan(plan.page_lists(self.kv, decodes=False))
        self.decode_table = torch.zeros((0, 1), dtype=torch.int32, device=self.stager.device)
        self.chunk_tables = [t.to(self.stager.device) for t in tables]
        self.staging_bytes = max(self.staging_bytes, self.stager.nbytes)
        ps = self.kv.page_size
        # each decode's runs of consecutive pages, once per step rather than once per layer (2,048 pages per
        # sequence at 32K context made this Python a few ms per layer, on the thread the GPU launches wait for)
        pages = [self.kv.pages(r)[: -(-n // ps)] for r, n in zip(plan.decode_ids, plan.decode_lens_host, strict=True)]
        if self.kernel == "native":  # one padded CPU block table per step; rows slice it for the pipelined halves
            self.cpu_table = torch.zeros((len(pages), max((len(p) for p in pages), default=1)), dtype=torch.int32)
            for i, p in enumerate(pages):
                self.cpu_table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
            self.cpu_lens = torch.tensor(plan.decode_lens_host, dtype=torch.int32)
        else:
            self.runs = [sequence_runs(p, n, ps) for p, n in zip(pages, plan.decode_lens_host, strict=True)]
        if plan.chunks:
            self.remap = self._slot_remap(plan.slots[plan.num_decodes:])
            self.stager.issue(0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.plan
        self.store(layer, k, v)
        out = torch.empty_like(q)
        # Q of the decodes crosses first: the copy waits for the new K/V to land in host memory, and the GPU's
        # prompt-chunk attention, queued next, then runs while the CPU attends for the decodes.
        q_cpu = q[: p.num_decodes].to("cpu") if p.num_decodes else None
        if p.chunks:
            k_st, v_st = self.stager.acquire(layer)
            if layer + 1 < self.kv.model.num_layers:
                self.stager.issue(layer + 1)
            flat = (-1, *k_st.shape[2:])
            k_st.view(flat)[self.remap] = k[p.num_decodes:]
            v_st.view(flat)[self.remap] = v[p.num_decodes:]
            self.traffic.link_read_bytes += self.stager.bytes_per_layer()
            rows = slice(p.num_decodes, None)
            out[rows] = self.attention(_only_chunks(p), "hbm", q[rows], k[rows], v[rows], k_st, v_st,
                                       self.decode_table, self.chunk_tables)
            self.stager.release(layer)
        if p.num_decodes:
            out[: p.num_decodes] = self._cpu_decode(layer, q_cpu).to(q.device, q.dtype)
            self._count_q_and_out(q[: p.num_decodes])
        return out

    def _count_q_and_out(self, q: torch.Tensor) -> None:
        """Link bytes of sending `q` to the host and its attention output back."""
        self.traffic.link_read_bytes += q.numel() * q.element_size()
        self.traffic.link_write_bytes += q.numel() * q.element_size()

    def attend_async(self, layer: int, rows: slice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Decode-only steps, one part of the batch (runner.forward_pipelined): store the part's new K/V,
        send its Q to the host and queue its attention on the CPU worker; returns wait() -> out on the GPU.

        The worker waits for the Q copy's event, so the main thread goes on issuing the other part's GPU
        work; torch's CPU kernels release the GIL, so both proceed at once.
        """
        self.store(layer, k, v, rows)
        q_host = q.to("cpu", non_blocking=True)  # pinned when q is on a GPU
        copied = None
        if q.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(q.device))  # after the stores and the Q copy
        self._count_q_and_out(q)

        def work() -> torch.Tensor:
            if copied is not None:
                copied.synchronize()
            return self._cpu_decode(layer, q_host, rows)

        future = self._worker().submit(work)
        return lambda: future.result().to(q.device, q.dtype, non_blocking=True)

    def _worker(self):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attn")  # parts run in order
        return self._pool

    def _cpu_decode(self, layer: int, q: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """Decode attention on the CPU: q `[r, Hq, D]` (CPU, the pools' dtype) for the step's decodes (all of
        them, or the slice `rows`) -> out, same shape, float32. See cpu_decode_attention."""
        k_host, v_host = self.kv.arena.k[layer], self.kv.arena.v[layer]
        rows = rows or slice(0, len(self.plan.decode_ids))
        if self.kernel == "native":
            return native_cpu_decode_attention(q, k_host, v_host, self.cpu_table[rows], self.cpu_lens[rows])
        out = torch.empty(q.shape, dtype=torch.float32)
        for i, runs in enumerate(self.runs[rows]):
            out[i] = cpu_decode_attention(q[i], k_host, v_host, runs)
        return out


# Keys per piece at least: below this a piece's call costs more than its reads.
CPU_MIN_PIECE = 512
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cpu_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, runs: list[tuple[int, int]],
                         *, threads: int | None = None) -> torch.Tensor:
    """One sequence's decode attention on the CPU, read in place from the paged pools.

    q `[Hq, D]`; pools `[num_pages, page_size, Hkv, D]` (same dtype as q); `runs` the sequence's (first flat
    slot, tokens) stretches of valid slots (sequence_runs). Returns `[Hq, D]` float32.

    K/V are never copied or converted: each run of consecutive page ids is one strided view, cut into equal
    pieces so that pieces x KV heads keep every CPU thread busy, and torch's CPU flash-attention kernel (which
    reads bf16 in place and returns each piece's LSE) attends the G query heads of a KV head as G rows (GQA
    without repeating K/V). The pieces are merged by a softmax over their LSEs. Key order does not matter
    (decode: no causal mask), so scattered pages cost one call per run of consecutive ids (sequence_runs), not
    a gather.
    """
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    group = q.shape[0] // hkv
    qg = q.reshape(1, hkv, group, d)
    flat_k, flat_v = k_pool.reshape(-1, hkv, d), v_pool.reshape(-1, hkv, d)
    want = 2 * (threads or torch.get_num_threads())  # work items per call the kernel can spread over threads
    outs, lses = [], []
    for start, length in runs:
        pieces = max(1, min(-(-want // hkv), length // CPU_MIN_PIECE))
        size = length // pieces
        cuts = [(start, pieces, size)]
        if length - pieces * size:  # the remainder: one more piece
            cuts.append((start + pieces * size, 1, length - pieces * size))
        for first, count, size in cuts:
            k = flat_k[first : first + count * size].view(count, size, hkv, d).transpose(1, 2)  # [count, Hkv, size, D]
            v = flat_v[first : first + count * size].view(count, size, hkv, d).transpose(1, 2)
            o, lse = _cpu_attention(qg.expand(count, hkv, group, d), k, v)
            outs.append(o.float())
            lses.append(lse.float())
    o, lse = torch.cat(outs), torch.cat(lses)  # [pieces, Hkv, G, D], [pieces, Hkv, G]
    return (o * torch.softmax(lse, dim=0).unsqueeze(-1)).sum(0).reshape(hkv * group, d)


def _cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Lq, D], natural-log LSE [B, H, Lq]) of non-causal attention; torch's CPU flash kernel where
    this torch has it, else the same in float32 matmuls."""
    scale = q.shape[-1] ** -0.5
    if _cpu_flash is not None:
        return _cpu_flash(q, k, v, 0.0, False, scale=scale)[:2]
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def _only_chunks(p: StepPlan) -> StepPlan:
    from dataclasses import replace

    shift = p.num_decodes
    chunks = [type(c)(c.req_id, c.start - shift, c.length, c.past_len) for c in p.chunks]
    return replace(p, decode_ids=[], decode_lens_host=[], decode_lens=p.decode_lens[:0], chunks=chunks, slots=p.slots[shift:],
                   positions=p.positions[shift:])
