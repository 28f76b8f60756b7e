"""GEMM case-study benchmark on the GPU: the CUDA variants beside cuBLAS anchors, in one run.

Rows (one per size x method), all `mode="measured"`, C = A B with square fp16 operands, fp16 C:
  naive / tiled / pipelined / ring / raster (+ ':' options) : the CUDA kernels with B in pinned host memory
                    (zero-copy view);
  stream (+ ':' options) : B in the same pinned memory, moved by the copy engine panel by panel into an HBM
                    ring and multiplied by cuBLAS (beyond the paper); stream:k cuts B into row panels (each
                    one contiguous copy, C accumulated in fp16), stream:panels reads B from a copy stored in
                    column-panel order (each panel one contiguous copy); a ':graph' row replays the same
                    call captured once into a CUDA graph (capture.replayed, as gemm_graph.capture_gemm captures
                    it, at the row's first call, outside the timing);
  cublas_hbm        : torch.matmul with B in HBM (the compute anchor);
  cublas_zero_copy  : torch.matmul reading B through the zero-copy view.
L2 is flushed before every timed call.

Run: python -m directkv.kernels.cuda.bench_gemm [--sizes 4096 10240] [--out results.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial

import torch

from directkv.kernels.cuda.bench_common import check_rel_err, get_ceilings, report, run_point, timed
from directkv.kernels.cuda.capture import replayed
from directkv.kernels.cuda.gemm_case_study import gemm, host_panels, stationary_hbm_floor_bytes
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty

# name -> extra keyword arguments of gemm (variant is the part before ':'); "_b": "hbm" runs the kernel with
# B in HBM: its on-chip time with no link in the way; "_b": "panels" gives it the same pinned B stored in
# column panels (host_panels, made once before timing); "_panels": N cuts B into N panels (panel = size / N);
# "_graph": the call is captured into a CUDA graph at its first (checked) call and replayed after that.
KERNELS = {
    "naive": {},
    "tiled": {},  # B by cp.async.cg, chunks added into one fp32 C (accumulate "atomic"): the defaults
    "tiled:ca": {"host_load": "ca"},  # B copied through L1 (cp.async.ca)
    "tiled:splits": {"accumulate": "splits"},  # a partial C per k-split in DRAM, summed by the reduce kernel
    # the default: a CTA (pair) an SM walking the (strip, chunk) items, the next B chunk staged in HBM while the
    # current one is computed, column-strip pairs sharing A tiles by TMA multicast
    "pipelined": {},
    "pipelined:ca": {"host_load": "ca"},  # persistent: only each CTA's first chunk (the staging copies are .cg)
    "pipelined:splits": {"accumulate": "splits"},  # a CTA (pair) an item: persistent CTAs need "atomic"
    "pipelined:c1": {"cluster": 1},  # single CTAs reading their own A tiles
    "pipelined:slots2": {"stage_slots": 2},  # one warp stages ahead into two HBM slots, the other loads
    # a CTA (pair) an item, B loaded once the CTA starts (no overlap within a CTA)
    "pipelined:grid": {"persistent": False},
    "pipelined:grid:c1": {"persistent": False, "cluster": 1},
    # 4 CTAs a strip, so a CTA owns several chunks and prefetches the next one into L2 (not persistent)
    "pipelined:s4": {"k_splits": 4},
    "pipelined:s4:no_prefetch": {"k_splits": 4, "prefetch": "none"},
    "tiled:b_hbm": {"_b": "hbm"},  # B in HBM: the kernels' on-chip time with no link in the way
    "pipelined:b_hbm": {"_b": "hbm"},
    "pipelined:b_hbm:c1": {"_b": "hbm", "cluster": 1},
    "pipelined:b_hbm:grid": {"_b": "hbm", "persistent": False},
    "pipelined:b_hbm:splits": {"_b": "hbm", "accumulate": "splits"},
    # B through an HBM ring of bands by the SMs' stager warps, output-stationary 256 x 128 tiles over all of k
    "ring": {},
    "ring:c2": {"cluster": 2},  # pairs on adjacent strips sharing each A tile by TMA multicast (planned band 2 at 10240)
    "ring:b_hbm": {"_b": "hbm"},  # its on-chip time
    "ring:b_hbm:c2": {"_b": "hbm", "cluster": 2},
    "ring:band1": {"band": 1},  # a strip a band: tiles of one strip together, A re-read by each strip
    "ring:band2": {"band": 2},
    "ring:band4": {"band": 4},
    "ring:band6": {"band": 6},  # more tiles than CTAs a band at 10240
    "raster": {},  # naive's kernel, CTAs down the m tiles first: does L2 serve B's repeats from host memory?
    "raster:b_hbm": {"_b": "hbm"},  # its on-chip time
    "stream": {},  # copy-engine panels into a 2-slot HBM ring, cuBLAS per panel (plan_panel_cols)
    "stream:2ce": {"copy_streams": 2},  # each panel's 2-D copy split over two side streams (copy engines)
    "stream:sm": {"copy": "sm"},  # each panel copied by a 32-CTA kernel reading B zero-copy (SM loads)
    "stream:sm16": {"copy": "sm", "copy_ctas": 16},  # fewer copy CTAs: more SMs left to cuBLAS
    "stream:sm132": {"copy": "sm", "copy_ctas": 132},  # one per SM: most loads in flight, most contention
    "stream:k": {"split": "k"},  # row panels: one contiguous copy each, C accumulated over them (beta = 1)
    "stream:panels": {"_b": "panels"},  # B stored column panel by panel on the host: one contiguous copy each
    # narrower panels than the default plan's >= 8: the first panel's copy and the last panel's product, which
    # nothing overlaps, shrink with the panel, while each panel adds a cuBLAS call and a copy
    "stream:panels16": {"_b": "panels", "_panels": 16},
    "stream:panels32": {"_b": "panels", "_panels": 32},
    "stream:k16": {"split": "k", "_panels": 16},
    "stream:k32": {"split": "k", "_panels": 32},
    # the same calls replayed from a CUDA graph: per-panel host work (a copy, two events, a cuBLAS call from
    # Python) gone, so narrow panels cost only their GPU time
    "stream:graph": {"_graph": True},
    "stream:k:graph": {"split": "k", "_graph": True},
    "stream:panels:graph": {"_b": "panels", "_graph": True},
    "stream:panels16:graph": {"_b": "panels", "_panels": 16, "_graph": True},
    "stream:panels32:graph": {"_b": "panels", "_panels": 32, "_graph": True},
}
ANCHORS = ("cublas_hbm", "cublas_zero_copy")
SLOW = ("naive", "cublas_zero_copy")  # B re-read across the link per row tile: fewer repeats
REL_ERR_MAX = 5e-3  # fp16 C against cuBLAS's fp16 C: row panels, which round C once per panel, measured 5.6e-4
# Closed-form link bytes are what the SMs request; for raster, L2 decides what crosses the link (ncu tells)
SM_REQUESTS_ONLY = ("raster",)


def bench_gemm(
    sizes: Sequence[int] = (4096, 10240),
    *,
    kernels: Sequence[str] = tuple(KERNELS),
    anchors: Sequence[str] = ANCHORS,
    warmup: int = 2,
    repeats: int = 5,
    ceilings: dict | None = None,
) -> list[dict]:
    """Time every kernel and anchor for each size n (m = n = k = size).

    Returns one row per (size, method): time_ms (median), tflops, link_read_bytes (closed form; None where
    unknown), link_gbps (link_read_bytes, else b_bytes, over time_ms), b_bytes, floor_ms (b_bytes over the
    copy-engine H2D rate), target_ms (1.15 x max(floor_ms, cublas_hbm time)), rel_err against cublas_hbm,
    the ceilings of this run, status; tiled / pipelined rows with accumulate "splits" also hbm_floor_bytes
    (stationary_hbm_floor_bytes) and hbm_floor_ms (those bytes at this run's HBM copy rate: no schedule that sends
    every chunk's partial C through DRAM is faster).
    """
    ceilings = get_ceilings() if ceilings is None else ceilings
    rows: list[dict] = []
    for size in sizes:
        m = n = k = size
        b_bytes = k * n * 2
        base = dict(op="gemm", m=m, n=n, k=k, dtype="float16", mode="measured", b_bytes=b_bytes, kv_bytes=b_bytes,
                    floor_ms=b_bytes / (ceilings["ce_h2d_gbps"] * 1e9) * 1e3 if "ce_h2d_gbps" in ceilings else None,
                    **ceilings)
        point = _size_rows(m, n, k, base, kernels, anchors, warmup, repeats)
        hbm = next((r["time_ms"] for r in point if r["variant"] == "cublas_hbm" and r["status"] == "ok"), None)
        floors = [x for x in (base["floor_ms"], hbm) if x is not None]
        for r in point:
            t = r.get("time_ms")
            moved = r["link_read_bytes"] if r["link_read_bytes"] is not None else b_bytes
            r["link_gbps"] = moved / (t * 1e-3) / 1e9 if t and moved else None
            r["tflops"] = 2 * m * n * k / (t * 1e-3) / 1e12 if t else None
            r["target_ms"] = 1.15 * max(floors) if floors else None
            if KERNELS.get(r["variant"], {}).get("accumulate") == "splits":  # fp32 partial C through DRAM
                r["hbm_floor_bytes"] = stationary_hbm_floor_bytes(m, n, k)
                hbm_gbps = ceilings.get("hbm_copy_gbps")
                r["hbm_floor_ms"] = r["hbm_floor_bytes"] / (hbm_gbps * 1e9) * 1e3 if hbm_gbps else None
        rows += point
    return rows


def _size_rows(m: int, n: int, k: int, base: dict, kernels, anchors, warmup: int, repeats: int) -> list[dict]:
    a = torch.randn(m, k, device="cuda").half()
    b_hbm = torch.randn(k, n, device="cuda").half()
    b_pin = pinned_empty((k, n), torch.float16)
    b_pin.copy_(b_hbm)
    b_view = device_view(b_pin)
    # pinned copies of B in panel order (200 MiB each at 10240), one per panel width a row reads, made before
    # any timing
    panels = {x: n // KERNELS[x]["_panels"] if "_panels" in KERNELS[x] else None for x in kernels}
    b_panels = {panels[x]: host_panels(b_pin, panel_cols=panels[x]) for x in kernels if KERNELS[x].get("_b") == "panels"}
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    reference = (a @ b_hbm).double()

    def kernel(name: str) -> Callable[[], object]:
        kwargs = dict(KERNELS[name], variant=name.split(":")[0])
        home = kwargs.pop("_b", "host")
        b = {"hbm": b_hbm, "host": b_view}[home] if home != "panels" else b_panels[panels[name]]
        if kwargs.pop("_panels", None) is not None and home != "panels":  # HostPanels carry their own cut
            kwargs["panel"] = panels[name]
        graph = kwargs.pop("_graph", False)
        call = lambda: gemm(a, b, out=out, **kwargs)  # noqa: E731
        # a graph is captured by the row's first, checked call, inside run_point: a failure is the row's error
        return replayed(call, lambda: out.fill_(float("nan"))) if graph else call

    methods = {name: (kernel(name), None) for name in kernels}
    anchor_fns = {"cublas_hbm": (lambda: a @ b_hbm, 0), "cublas_zero_copy": (lambda: a @ b_view, None)}
    methods.update({name: anchor_fns[name] for name in anchors})
    rows = []
    for name, (fn, link_bytes) in methods.items():
        row = dict(base, variant=name, link_read_bytes=link_bytes)
        slow = name.split(":")[0] in SLOW
        rows.append(run_point(row, partial(_measure, fn, row, reference, out, warmup=1 if slow else warmup,
                                           repeats=3 if slow else repeats)))
    return rows


def _measure(fn: Callable[[], object], row: dict, reference: torch.Tensor, out: torch.Tensor, *, warmup: int,
             repeats: int) -> None:
    """One checked call (rel_err against cuBLAS in HBM; a kernel's closed-form link bytes), then timing. `out`,
    which every kernel row writes, is poisoned first, so a call that leaves it unwritten (a graph that replays
    nothing) shows NaN instead of the previous row's product."""
    out.fill_(float("nan"))
    result = fn()
    if isinstance(result, tuple):  # a kernel: (c, Traffic)
        if row["variant"].split(":")[0] not in SM_REQUESTS_ONLY:
            row["link_read_bytes"] = result[1].link_read_bytes
        result = result[0]
    check_rel_err(row, result, reference, REL_ERR_MAX, "cuBLAS in HBM", "product")
    row.update(timed(fn, warmup=warmup, repeats=repeats))


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 10240])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = bench_gemm(args.sizes)
    report(rows, args.out, ["m", "variant", "status", "time_ms", "target_ms", "floor_ms", "hbm_floor_ms", "tflops",
                       "link_gbps", "link_read_bytes", "rel_err"])
    return rows


if __name__ == "__main__":
    main()
