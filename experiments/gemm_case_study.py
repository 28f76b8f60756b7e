"""Fig. 2/5: C = A·B with B in pinned host memory (the paper's motivating case study).

Simulated: traffic from the closed forms, time from the cost model. The tiled kernel without a producer
warp alternates loading a stationary B tile and computing on it, so its link and compute times add; the
pipelined kernel prefetches the next B tile while computing, so they overlap (max), as do ring's stagers (beyond
the paper: B through an HBM ring by SM loads, output-stationary tiles; its closed form reads A once per column strip
and the ring's B once per row tile from HBM, which L2 mostly serves, so the model is pessimistic: 6.18 / 0.66 ms at
10240^3 / 4096^3 where the H200 measured 4.26-4.69 / 0.68-0.78 on 2026-12-04). stream (beyond the
paper) is a two-slot pipeline of copy-engine panel copies and cuBLAS panel products, timed panel by panel
(stream_ms): column panels, or with stream:k row panels whose products also read and write C. The cost model
moves every panel at the copy engine's rate; on the H200 the 2-D copies of column panels of row-major B ran at
~37-39 GB/s of 55, which is why stream:k and stream:panels (B stored in panels, measured only) exist. With a
GPU (device=cuda) the CUDA kernels, the stream forms and the cuBLAS anchors are measured in one run.
The model sends every chunk's fp32 partial C and every strip's re-read of A through HBM (the kernels'
accumulate="splits" schedule without L2), so it is pessimistic for the CUDA kernels' default (atomic
accumulation in L2, CTAs ordered to share A): at 10240^3 it gives tiled 12.1 / pipelined 7.95 ms where the H200
measured 6.87 / 5.12 (2026-12-04), and 1.15 / 0.66 ms at 4096^3 where it measured 1.03 / 0.91 (there the link
bounds it and the model's pipelined overlaps perfectly).
"""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.errors import check
from directkv.kernels import traffic_model as tm
from directkv.kernels.cuda.gemm_case_study import CHUNK_K, STREAM_SLOTS, stream_cut
from directkv.kernels.traffic import Traffic
from directkv.results import ResultsWriter
from experiments.common import Setup, as_int, base_row, int_list, progress, setup

VARIANTS = ("naive", "tiled", "pipelined", "ring", "stream", "stream:k")
DTYPE_BYTES = 2  # fp16


def stream_ms(link_s: float, on_chip_s: float, n: int, panel_cols: int) -> float:
    """Milliseconds of stream's pipeline over n columns (or rows) cut in panels of panel_cols: panel i's copy
    (its share of link_s, on the copy engine) starts when copy i - 1 is done and the product of panel
    i - STREAM_SLOTS has freed its slot; its product (its share of on_chip_s) when the copy is done and
    product i - 1 too. The first copy and the last product stand alone."""
    copy_end, mm_end = 0.0, [0.0] * STREAM_SLOTS
    for i, n0 in enumerate(range(0, n, panel_cols)):
        share = min(panel_cols, n - n0) / n
        copy_end = max(copy_end, mm_end[i % STREAM_SLOTS]) + link_s * share
        mm_end[i % STREAM_SLOTS] = max(mm_end[(i - 1) % STREAM_SLOTS], copy_end) + on_chip_s * share
    return max(mm_end) * 1e3


def cublas_hbm_traffic(n: int) -> Traffic:
    """cuBLAS with every operand in HBM: A, B read and C written once (its L2-aware tiling keeps re-reads on
    chip), so at these sizes the math bounds it. Not the tiled kernel's traffic: that schedule's fp32
    partial-C passes (~67 GB at 10240) made the simulated anchor 36 ms where cuBLAS measured 2.8 ms."""
    return Traffic(hbm_read_bytes=2 * n * n * DTYPE_BYTES, hbm_write_bytes=n * n * DTYPE_BYTES, flops=2 * n**3)


def simulated_rows(cfg: DictConfig, s: Setup, n: int) -> list[dict]:
    tiles = {t: as_int(cfg[t], t) for t in ("tile_m", "tile_n", "tile_k")}
    b_bytes = n * n * DTYPE_BYTES
    shape = {"op": "gemm", "m": n, "n": n, "k": n, "kv_bytes": float(b_bytes),
             "floor_ms": b_bytes / (s.hw.link_ce_h2d_gbps * 1e9) * 1e3}
    rows = []
    for v in cfg.variants:
        extra = {}
        stream = v.startswith("stream")
        if stream:  # copy engine on the link, cuBLAS on chip
            extra = stream_cut(n, n, "k" if v == "stream:k" else "n")
            t = tm.gemm_traffic(n, n, n, dtype_bytes=DTYPE_BYTES, variant="stream", **extra)
        elif v == "ring":  # SM loads on the link; every strip's A and every row tile's B from HBM (no L2 credit)
            t = tm.gemm_traffic(n, n, n, dtype_bytes=DTYPE_BYTES, variant="ring")
        else:  # the kernels' schedules: naive streams k tiles; tiled / pipelined keep CHUNK_K-row chunks stationary
            # (the model's in-place partial C through HBM: the CUDA kernels' accumulate="splits" less one pass each
            # way; their default, "atomic", keeps most of those passes in L2, which the model does not credit)
            t = tm.gemm_traffic(n, n, n, dtype_bytes=DTYPE_BYTES, variant=v,
                                **(tiles if v == "naive" else tiles | {"tile_k": CHUNK_K}))
        terms = s.cm.terms(t, link="ce" if stream else "sm", flops_kind="matmul")
        on_chip = max(terms["hbm"], terms["compute"])
        if stream:
            (panel,) = extra.values()
            ms = stream_ms(terms["link_read"], on_chip, n, panel)
        elif v == "tiled":  # load, then compute
            ms = (terms["link_read"] + on_chip) * 1e3
        else:  # naive: many CTAs in flight hide each other; pipelined / ring: the producer / stager warps prefetch
            ms = max(terms["link_read"], on_chip) * 1e3
        rows.append(base_row(cfg, s, system="directkv", variant=v) | shape | extra | {
            "time_ms": ms, "link_read_bytes": float(t.link_read_bytes), "hbm_read_bytes": float(t.hbm_read_bytes),
            "hbm_write_bytes": float(t.hbm_write_bytes), "flops": float(t.flops)})
    rows.append(base_row(cfg, s, system="anchor", variant="cublas_hbm") | shape | {
        "time_ms": s.cm.time(cublas_hbm_traffic(n), flops_kind="matmul") * 1e3, "link_read_bytes": 0.0})
    return rows


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    for v in cfg.variants:
        check(v in VARIANTS, f"unknown gemm variant {v!r}; valid: {', '.join(VARIANTS)}")
    sizes = int_list(cfg.sizes, "gemm size")
    for n in sizes:
        check(n >= 1, f"gemm size must be >= 1, got {n}")
    for n in progress(cfg, sizes, "gemm_case_study"):
        if writer.done(m=n):
            continue
        if s.device == "cuda":
            from experiments import kernel_bench

            rows = kernel_bench.measure_gemm(cfg, s, n)
        else:
            rows = simulated_rows(cfg, s, n)
        for r in rows:
            writer.add(r)
