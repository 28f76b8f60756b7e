"""cpu_attn's KV path (Neo-like): decode attention on the CPU over the pinned pages, prompt chunks staged into
HBM like swap. Decode-only steps run as two halves pipelined by the runner (forward_pipelined): one half's CPU
attention overlaps the other half's GPU layers.

The CPU attention is `executor.cpu_attn_kernel`: "flash" is torch_decode_attention below (torch's CPU
flash-attention kernel, one call per run of pages of each decode); "native" is the OpenMP op
directkv.kernels.cpu_decode_attention (every decode of a layer in one call).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from directkv.engine.gpu.paths import StagedPath, ZeroCopyPath
from directkv.engine.gpu.plan import StepPlan
from directkv.engine.systems import CPU_ATTN_KERNELS, DEFAULT_CPU_ATTN_KERNEL
from directkv.errors import ConfigError, unknown_name
from directkv.kernels.cpu_decode_attention import DecodeTables
from directkv.kernels.cpu_decode_attention import cpu_decode_attention as native_cpu_decode_attention
from directkv.kernels.cuda import build
from directkv.kernels.cuda.scatter_rows import scatter_rows
from directkv.kernels.paged import sequence_runs
from directkv.memory import KVCacheManager


class CpuAttnPath(StagedPath):
    """Neo-like: decode attention on the CPU over the pinned pages; prompt chunks attend on the GPU (staged)."""


    def __init__(self, kv: KVCacheManager, *, threads: int | None = None, kernel: str = DEFAULT_CPU_ATTN_KERNEL):
        super().__init__(kv)
        if kernel not in CPU_ATTN_KERNELS:
            raise unknown_name("cpu_attn kernel", kernel, CPU_ATTN_KERNELS)
        if kernel == "native" and not build.can_build("cpu_decode_attention"):  # say so before serving starts
            raise ConfigError("cpu_attn kernel 'native' needs a C++ compiler (set CXX or install g++); or use "
                              "executor.cpu_attn_kernel=flash")
        if threads:
            torch.set_num_threads(threads)
        self.kernel = kernel
        self._pool = None  # CPU worker of attend_async, made on first use

    def begin(self, plan: StepPlan) -> None:
        ZeroCopyPath.begin(self, plan)
        flash = self.kernel != "native"  # only flash walks each decode's page list; native takes the table
        lists = plan.page_lists(self.kv, decodes=flash)
        first_chunk = plan.num_decodes if flash else 0
        # the chunks' pages are staged like swap's
        self.chunk_tables_cpu = self.stager.plan(lists[first_chunk:],
                                                 plan.past_page_counts(self.kv, decodes=flash)[first_chunk:])
        self.chunk_tables = [t.to(self.stager.device) for t in self.chunk_tables_cpu]
        self.staging_bytes = max(self.staging_bytes, self.stager.nbytes)
        ps = self.kv.page_size
        # the decodes' tables (native) or runs of consecutive pages (flash), once per step rather than once per
        # layer (2,048 pages per sequence at 32K context made this Python a few ms per layer, on the thread the
        # GPU launches wait for)
        if not flash and plan.num_decodes:  # one table per step, checked once; pipelined parts take its rows
            self.cpu_tables = DecodeTables.check(plan.decode_table_cpu, plan.decode_lens_cpu, page_size=ps)
            self._row_tables: dict[tuple[int, int], DecodeTables] = {}  # per part, made on its first layer
        else:
            self.runs = [sequence_runs(p, n, ps) for p, n in zip(lists[:first_chunk], plan.decode_lens_host,
                                                                  strict=True)]
        if plan.chunks:
            self.remap = self._slot_remap(plan.slots_cpu[plan.num_decodes:])
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
            scatter_rows((k_st, v_st), (k[p.num_decodes:], v[p.num_decodes:]), self.remap)
            self.traffic.link_read_bytes += self.stager.layer_bytes
            rows = slice(p.num_decodes, None)
            self._chunks(p, "hbm", self.variant, q[rows], k[rows], v[rows], k_st, v_st, self.chunk_tables, out[rows],
                         base=p.num_decodes, chunk_tables_cpu=self.chunk_tables_cpu)
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
        them, or the slice `rows`) -> out, same shape, float32: the native kernel or torch_decode_attention."""
        k_host, v_host = self.kv.arena.k[layer], self.kv.arena.v[layer]
        rows = rows or slice(0, len(self.plan.decode_ids))
        if self.kernel == "native":
            key = (rows.start, rows.stop)
            if key not in self._row_tables:
                self._row_tables[key] = self.cpu_tables.rows(rows)
            return native_cpu_decode_attention(q, k_host, v_host, self._row_tables[key])
        out = torch.empty(q.shape, dtype=torch.float32)
        for i, runs in enumerate(self.runs[rows]):
            out[i] = torch_decode_attention(q[i], k_host, v_host, runs)
        return out


# Keys per piece at least: below this a piece's call costs more than its reads.
CPU_MIN_PIECE = 512
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def torch_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, runs: list[tuple[int, int]],
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

