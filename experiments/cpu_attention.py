"""cpu_attn's CPU decode attention, measured on this machine's CPU: the two kernels the executor can use.

`flash` is the torch loop the cpu_attn path runs per layer (torch's CPU flash-attention kernel per run of
pages of each decode, directkv.engine.gpu.cpu_attn_path.torch_decode_attention); `native` is the OpenMP op
directkv.kernels.cpu_decode_attention, one call for every decode. Each point is a batch of decodes over
pages in consecutive order (as a fresh server hands them out: the torch loop then makes one call per
sequence) or shuffled (a fragmented free list: one call per page), the model's heads, fresh random values;
both kernels are
checked against a float64 reference before timing (perf_counter, median of repeats). Rows are `measured`
whatever `device` says: the CPU is the device here, and `hardware` names it (`cpu: <model>`), not the
GPU spec of the config.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from directkv.engine.systems import CPU_ATTN_KERNELS
from directkv.errors import check, unknown_name
from directkv.hostinfo import cpu_name
from directkv.kernels.paged import sequence_runs
from directkv.results import ResultsWriter
from directkv.timing import time_fn
from experiments.common import Setup, as_int, base_row, check_context, progress, setup

KERNELS = CPU_ATTN_KERNELS
PAGE_ORDERS = ("consecutive", "shuffled")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE_SIZE = 16


def make_point(batch: int, context: int, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               page_order: str = "consecutive", seed: int = 0):
    """q `[batch, Hq, D]`, pools `[pages, 16, Hkv, D]`, block table `[batch, width]` int32, seq_lens `[batch]`:
    every sequence holds `context` tokens, in consecutive pool pages or at shuffled positions."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // PAGE_SIZE)
    shape = (batch * pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(batch * pages, generator=gen) if page_order == "shuffled" else torch.arange(batch * pages)
    table = order.to(torch.int32).view(batch, pages).contiguous()
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_pool, v_pool, table, torch.full((batch,), context, dtype=torch.int32)


def reference(q, k_pool, v_pool, table, lens) -> torch.Tensor:
    """float64 attention of each query over its sequence's gathered keys, `[batch, Hq, D]`."""
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    group = q.shape[1] // hkv
    out = []
    for b, n in enumerate(lens.tolist()):
        ids = table[b, : -(-n // PAGE_SIZE)].long()
        k = k_pool[ids].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, dim=1)
        v = v_pool[ids].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[b].double(), k) / math.sqrt(d), dim=-1)
        out.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(out)


def kernel_fn(kernel: str, q, k_pool, v_pool, table, lens, threads: int):
    """The call the cpu_attn path makes per layer with `kernel`, on these inputs."""
    if kernel == "native":
        from directkv.kernels.cpu_decode_attention import DecodeTables, cpu_decode_attention

        tables = DecodeTables.check(table, lens, page_size=PAGE_SIZE)  # once per step in the path, not per layer
        return lambda: cpu_decode_attention(q, k_pool, v_pool, tables, threads=threads)
    from directkv.engine.gpu.cpu_attn_path import torch_decode_attention

    runs = [sequence_runs(table[b, : -(-n // PAGE_SIZE)].tolist(), n, PAGE_SIZE) for b, n in enumerate(lens.tolist())]
    return lambda: torch.stack([torch_decode_attention(q[b], k_pool, v_pool, r, threads=threads)
                                for b, r in enumerate(runs)])


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    kernels = [str(k) for k in cfg.kernels]
    for k in kernels:
        if k not in KERNELS:
            raise unknown_name("cpu_attention kernel", k, KERNELS)
    dtype_name = str(cfg.dtype)
    if dtype_name not in DTYPES:
        raise unknown_name("cpu_attention dtype", dtype_name, DTYPES)
    points = []
    for p in cfg.points:
        check(len(p) == 2, f"each point is [decodes, cached tokens]; got {list(p)!r}")
        batch, context = as_int(p[0], "decodes"), as_int(p[1], "cached tokens")
        check(batch >= 1, f"decodes must be >= 1, got {batch}")
        check_context(s.model, context)
        points.append((batch, context))
    orders = [str(o) for o in cfg.page_orders]
    for o in orders:
        if o not in PAGE_ORDERS:
            raise unknown_name("cpu_attention page order", o, PAGE_ORDERS)
    threads = as_int(cfg.threads, "threads") if cfg.threads is not None else torch.get_num_threads()
    check(threads >= 1, f"threads must be >= 1, got {threads}")
    hardware = f"cpu: {cpu_name()}"
    grid = [(o, b, c) for o in orders for b, c in points]
    previous = torch.get_num_threads()
    # the flash kernel runs on torch's intra-op threads (the native one takes `threads` itself), as the serving
    # path sets them for cpu_attn; without this `threads` only shaped flash's work split
    torch.set_num_threads(threads)
    try:
        _measure(cfg, s, writer, kernels, grid, threads, dtype_name, hardware)
    finally:
        torch.set_num_threads(previous)


def _measure(cfg: DictConfig, s: Setup, writer: ResultsWriter, kernels: list[str],
             grid: list[tuple[str, int, int]], threads: int, dtype_name: str, hardware: str) -> None:
    """Every (page order, decodes, tokens) point of the grid for each kernel, one row each."""
    m, dtype = s.model, DTYPES[dtype_name]
    for order, batch, context in progress(cfg, grid, "cpu_attention"):
        todo = [k for k in kernels if not writer.done(variant=k, batch_size=batch, context_len=context,
                                                       page_order=order)]
        if not todo:
            continue  # a resumed run: no inputs or float64 reference for a point it has
        inputs = make_point(batch, context, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                            dtype=dtype, page_order=order)
        ref = reference(*inputs)
        kv_bytes = 2 * batch * context * m.num_kv_heads * m.head_dim * inputs[1].element_size()
        for kernel in todo:
            row = base_row(cfg, s, system="cpu_attn", variant=kernel, mode="measured", hardware=hardware) | {
                "op": "cpu_decode", "batch_size": batch, "context_len": context, "page_order": order,
                "kv_bytes": float(kv_bytes),
                "threads": threads, "dtype": dtype_name, "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
                "head_dim": m.head_dim}
            try:
                if kernel == "native":  # which of its compiled items ran: the ISA decides its speed
                    from directkv.kernels.cpu_decode_attention import kernel_item

                    row["native_item"] = kernel_item(dtype, m.num_heads, m.num_kv_heads, m.head_dim)
                fn = kernel_fn(kernel, *inputs, threads)
                out = fn()
                row["rel_err"] = float((out.double() - ref).norm() / ref.norm())
                t = time_fn(fn, warmup=as_int(cfg.warmup, "warmup"), repeats=as_int(cfg.repeats, "repeats"), device="cpu")
                row |= t.as_dict() | {"gbps": kv_bytes / (t.median_ms * 1e-3) / 1e9}
            except Exception as e:  # noqa: BLE001 - a failing point is recorded and the sweep goes on
                row |= {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
            writer.add(row)
