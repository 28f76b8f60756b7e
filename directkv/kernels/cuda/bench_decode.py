"""Decode-attention benchmark: CUDA variants and torch anchors side by side, ceilings from the same run.

Every point (context, batch) gets one row per variant (VARIANTS: "naive", "tiled", "tiled:global_merge" (tiled with
its splits merged through HBM even where it would merge them in thread-block clusters), "stream", stream's chunk cuts
and "stream:layers", whose calls are queued as a serving step's layers) and per anchor ("sdpa_hbm": torch
SDPA on K/V in HBM; "sdpa_zero_copy": SDPA reading the zero-copy view; "swap_sdpa": copy K/V to HBM with the
copy engine, then SDPA; "read_probe": the ceilings' plain streaming-read kernel over the same pinned K/V bytes,
timed like the rows, so a small point's share of the 1 GiB ceiling that no kernel can exceed is measured beside
it). All sequences of a point hold `context` tokens.

Timing: each timed repeat runs `inner` calls back to back (inner sized so a repeat takes ~target_ms), so the
host's launch overhead overlaps the GPU as in a real decode step; time_ms is the median repeat / inner.
The zero-copy inputs rotate over enough copies of the cache to exceed 3x the L2, so no call reads K/V that
the previous one left in L2. link_gbps is kv_bytes (one read of the cache) / time_ms for every row, so the
naive variant's extra reads and the HBM anchor show up as lower / higher effective rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from directkv.errors import check
from directkv.kernels.cuda import decode_attention as dec
from directkv.kernels.cuda.decode_attention import decode_attention, prefetch_stream, traffic
from directkv.kernels.cuda.probe import measure_ceilings, stream_read_call
from directkv.kernels.cuda.stream_plan import plan_stream
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.paged import PagedKV
from directkv.timing import time_fn

ANCHORS = ("sdpa_hbm", "sdpa_zero_copy", "swap_sdpa", "read_probe")
# variant name -> plan_stream options of the stream rows (None: a zero-copy variant, run as named)
VARIANTS: dict[str, dict | None] = {
    "naive": None,
    "tiled": None,
    "stream": {},  # one chunk per ring slot (16 MiB of K): a cache that fits one slot is copied, then read
    # a small cache cut into about 4 / 8 chunks (slots of >= 2 MiB) so its copies overlap the kernels of the chunks
    # before. Not in the default rows: no faster than one chunk on the H200 (2026-12-01); --variants runs them
    "stream:4chunks": {"min_chunks": 4},
    "stream:8chunks": {"min_chunks": 8},
    # the calls of a repeat queued as one serving step's layers (prefetch_stream, as the executor queues them), so
    # call i + 1's copy fills the other ring slot while call i's kernel reads its own; the rows above run each
    # call alone, its copy after the previous call's kernel freed slot 0
    "stream:layers": {"_layers": True},
}
# zero-copy rows run with decode_attention options: name -> (variant, options)
ZERO_COPY_OPTIONS: dict[str, tuple[str, dict]] = {
    # the split merge through HBM partials, a fence and a counter, beside tiled's cluster merge in the same run
    "tiled:global_merge": ("tiled", {"cluster_merge": False}),
}
ROW_VARIANTS = (*VARIANTS, *ZERO_COPY_OPTIONS)  # every variant row a point can have
DEFAULT_VARIANTS = ("naive", "tiled", "tiled:global_merge", "stream", "stream:layers")


class _Point:
    """The cache of one (context, batch) point: `copies` page pools in pinned memory and in HBM.

    Pools are `[batch * pages_per_seq, page_size, num_kv_heads, head_dim]`; copy i's block table maps
    sequence b to a random permutation of the pages (or in order), seq_lens all `context`.
    """

    def __init__(self, arena: torch.Tensor, context: int, batch: int, copies: int, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int, page_order: str,
                 gen: torch.Generator):
        self.context, self.batch, self.copies = context, batch, copies
        pages_per_seq = math.ceil(context / page_size)
        shape = (batch * pages_per_seq, page_size, num_kv_heads, head_dim)
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.host, self.views, self.hbm, self.tables = [], [], [], []
        # copy i's K and V back to back as one uint8 zero-copy view: what read_probe streams
        self.flat = [device_view(arena[2 * i * nbytes : (2 * i + 2) * nbytes]) for i in range(copies)]
        for i in range(2 * copies):  # K0, V0, K1, V1, ...
            pinned = arena[i * nbytes : (i + 1) * nbytes].view(dtype).view(shape)
            hbm = torch.randn(shape, dtype=dtype, device="cuda", generator=gen)
            pinned.copy_(hbm)
            self.host.append(pinned)
            self.views.append(device_view(pinned))
            self.hbm.append(hbm)
        for _ in range(copies):
            ids = torch.arange(batch * pages_per_seq, device="cuda")
            if page_order == "random":
                ids = ids[torch.randperm(len(ids), device="cuda", generator=gen)]
            self.tables.append(ids.view(batch, pages_per_seq).to(torch.int32))
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn((batch, num_heads, head_dim), dtype=dtype, device="cuda", generator=gen)
        empty = torch.empty((0, *shape[1:]), dtype=dtype, device="cuda")
        self.kvs = [PagedKV(self.views[2 * i], self.views[2 * i + 1], empty, empty, self.tables[i], self.seq_lens)
                    for i in range(copies)]

    def dense(self, pools: list[torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy i's K, V as `[batch, num_kv_heads, context, head_dim]` views in physical page order (SDPA)."""
        def view(t: torch.Tensor) -> torch.Tensor:
            return t.view(self.batch, -1, *t.shape[2:])[:, : self.context].transpose(1, 2)

        return view(pools[2 * i]), view(pools[2 * i + 1])

    def reference(self) -> torch.Tensor:
        """fp32 attention of copy 0 in logical order, `[batch, num_heads, head_dim]`."""
        idx = self.tables[0].long()

        def logical(t: torch.Tensor) -> torch.Tensor:
            return t[idx].flatten(1, 2)[:, : self.context].transpose(1, 2).float()

        q = self.q.float().unsqueeze(2)
        return F.scaled_dot_product_attention(q, logical(self.hbm[0]), logical(self.hbm[1]), enable_gqa=True)[:, :, 0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def bench_decode(
    contexts: Sequence[int],
    batches: Sequence[int],
    *,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 16,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    anchors: Sequence[str] = ANCHORS,
    repeats: int = 5,
    target_ms: float = 20.0,
    max_host_bytes: int = 16 << 30,
    page_order: str = "random",
    tile_kv: int = 64,
    num_splits: int | None = None,
    ceilings: dict[str, float] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Time decode attention at every (context, batch); one dict per point and variant or anchor.

    Parameters
    ----------
    contexts, batches : tokens per sequence and sequences per batch, swept as a grid.
    max_host_bytes : pinned bytes a point may use (its K/V copies); larger points get status "oom" rows
        (e.g. 128K x 64 at Llama-3.1-8B shapes is 34 GB per copy).
    page_order : "random" (pages of all sequences shuffled, as a KV manager leaves them) or "sequential".
    tile_kv, num_splits : passed to the CUDA variants.
    ceilings : measure_ceilings() result to reuse; measured here when None.

    Returns
    -------
    Rows with op, variant, context_len, batch, shape and dtype fields, time_ms, link_gbps, kv_bytes,
    link_read_bytes (closed form), floor_ms (kv_bytes / ce_h2d), sm_read_ceiling_gbps, ce_h2d_gbps,
    pct_of_sm_ceiling, rel_err (vs fp32 SDPA; variants only), inner, mode="measured", status, error.
    """
    bad = [v for v in variants if v not in ROW_VARIANTS]
    check(not bad, f"unknown decode variant(s) {bad}; valid: {', '.join(ROW_VARIANTS)}")
    bad = [a for a in anchors if a not in ANCHORS]
    check(not bad, f"unknown decode anchor(s) {bad}; valid: {', '.join(ANCHORS)}")
    ceilings = ceilings or measure_ceilings()
    esize = torch.empty((), dtype=dtype).element_size()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(seed)
    points = [(c, b) for c in contexts for b in batches]

    def kv_bytes(c: int, b: int) -> int:
        return 2 * b * math.ceil(c / page_size) * page_size * num_kv_heads * head_dim * esize

    def copies(c: int, b: int) -> int:
        return max(1, math.ceil(3 * l2 / kv_bytes(c, b)))

    fits = [(c, b) for c, b in points if copies(c, b) * kv_bytes(c, b) <= max_host_bytes]
    arena = pinned_empty((max((copies(c, b) * kv_bytes(c, b) for c, b in fits), default=16),), torch.uint8)
    rows: list[dict] = []
    for c, b in points:
        base = dict(op="decode", context_len=c, batch=b, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), page_size=page_size,
                    kv_bytes=kv_bytes(c, b), floor_ms=kv_bytes(c, b) / ceilings["ce_h2d_gbps"] / 1e6,
                    sm_read_ceiling_gbps=ceilings["sm_read_gbps"], ce_h2d_gbps=ceilings["ce_h2d_gbps"],
                    hbm_copy_gbps=ceilings["hbm_copy_gbps"], load_mode=dec.LOAD_MODE,
                    split_major=dec.SPLIT_MAJOR, tile_kv=tile_kv, mode="measured")
        names = [*variants, *anchors]
        if (c, b) not in fits:
            msg = f"needs {copies(c, b) * kv_bytes(c, b)} pinned bytes > max_host_bytes {max_host_bytes}"
            rows += [dict(base, variant=v, status="oom", error=msg) for v in names]
            continue
        try:
            point = _Point(arena, c, b, copies(c, b), num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=dtype, page_size=page_size, page_order=page_order, gen=gen)
            ref = point.reference()
        except Exception as exc:  # noqa: BLE001 - one bad point must not end the sweep
            status = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
            rows += [dict(base, variant=v, status=status, error=f"{type(exc).__name__}: {exc}") for v in names]
            continue
        opts = dict(tile_kv=tile_kv, num_splits=num_splits)
        for name in names:
            rows.append(dict(base, variant=name, **_measure(point, name, ref, base, repeats, target_ms, opts)))
        del point, ref
        torch.cuda.empty_cache()
    return rows


def _calls(point: _Point, name: str, opts: dict) -> tuple[Callable[[int, int], torch.Tensor], int, dict]:
    """(call (i, n) -> output, the i-th of n calls of a repeat; link_read_bytes; extra row columns) of a variant
    or anchor; stream rows get stream_chunks, the ring chunks per call (variants whose plans coincide at a point
    say so)."""
    out = torch.empty_like(point.q)
    if name == "read_probe":
        reads = [stream_read_call(view) for view in point.flat]
        return (lambda i, n: reads[i % point.copies]()), point.flat[0].numel(), {}
    if name in ANCHORS:
        if name == "swap_sdpa":
            stage = [torch.empty_like(t) for t in point.hbm[:2]]

            def swap(i: int, n: int) -> torch.Tensor:
                for dst, src in zip(stage, point.host[2 * (i % point.copies) : 2 * (i % point.copies) + 2], strict=True):
                    dst.copy_(src, non_blocking=True)
                return _sdpa(point.q, *point.dense(stage, 0))

            return swap, point.kvs[0].host_k.numel() * 2 * point.q.element_size(), {}
        pools = point.hbm if name == "sdpa_hbm" else point.views
        link = 0 if name == "sdpa_hbm" else point.kvs[0].host_k.numel() * 2 * point.q.element_size()
        return (lambda i, n: _sdpa(point.q, *point.dense(pools, i % point.copies))), link, {}
    if name in ZERO_COPY_OPTIONS:
        base, extra = ZERO_COPY_OPTIONS[name]
        return (lambda i, n: decode_attention(point.q, point.kvs[i % point.copies], variant=base, out=out, **opts,
                                              **extra)[0]), \
            traffic(point.kvs[0], num_heads=point.q.shape[1], variant=base).link_read_bytes, {}
    if VARIANTS[name] is not None:  # stream: the copy engine reads host DRAM, not L2: one copy suffices
        options = dict(VARIANTS[name])
        layers = options.pop("_layers", False)
        plan = plan_stream(point.kvs[0], **options)
        kv = point.kvs[0]

        def stream(i: int, n: int) -> torch.Tensor:
            if layers and i == 0:  # the repeat's n calls queued up front; their first chunks' copies start now
                prefetch_stream(plan, [(kv.host_k, kv.host_v)] * n)
            return decode_attention(point.q, kv, variant="stream", out=out, plan=plan, **opts)[0]

        return stream, traffic(kv, num_heads=point.q.shape[1], variant="stream").link_read_bytes, \
            {"stream_chunks": len(plan.copies)}
    return (lambda i, n: decode_attention(point.q, point.kvs[i % point.copies], variant=name, out=out, **opts)[0]), \
        traffic(point.kvs[0], num_heads=point.q.shape[1], variant=name).link_read_bytes, {}


def _measure(point: _Point, name: str, ref: torch.Tensor, base: dict, repeats: int, target_ms: float,
             opts: dict) -> dict:
    try:
        call, link_bytes, extra = _calls(point, name, opts)
        first = call(0, 1)  # warms up the build, the split plan and the traffic memo
        # anchors read pages in physical order, which mixes sequences: their output is not comparable
        rel_err = float("nan") if name in ANCHORS else _rel_err(first, ref)
        rate = base["hbm_copy_gbps"] / 2 if name == "sdpa_hbm" else base["sm_read_ceiling_gbps"]
        est_ms = max(base["kv_bytes"] / rate / 1e6, 1e-3)
        inner = max(1, min(1000, round(target_ms / est_ms)))
        timing = time_fn(lambda: [call(i, inner) for i in range(inner)], warmup=1, repeats=repeats)
        time_ms = timing.median_ms / inner
        gbps = base["kv_bytes"] / time_ms / 1e6
        return dict(status="ok", error="", time_ms=time_ms, time_min_ms=timing.min_ms / inner, inner=inner,
                    link_gbps=gbps, link_read_bytes=link_bytes, rel_err=rel_err,
                    pct_of_sm_ceiling=100 * gbps / base["sm_read_ceiling_gbps"], **extra)
    except Exception as exc:  # noqa: BLE001 - one bad point must not end the sweep
        status = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
        return dict(status=status, error=f"{type(exc).__name__}: {exc}")


def tune_decode(contexts: Sequence[int] = (4096, 32768), batches: Sequence[int] = (1,), *,
                ceilings: dict[str, float], repeats: int = 3, **kwargs) -> tuple[list[dict], tuple[str, bool]]:
    """Time the tiled variant under every load mode and grid order; set the fastest as the module default.

    Returns (rows, (load_mode, split_major) picked by the geometric mean of link_gbps over the points).
    """
    rows, score, previous = [], {}, (dec.LOAD_MODE, dec.SPLIT_MAJOR)
    for mode in dec.LOAD_MODES:
        for split_major in (False, True):
            dec.LOAD_MODE, dec.SPLIT_MAJOR = mode, split_major
            got = bench_decode(contexts, batches, variants=("tiled",), anchors=(), ceilings=ceilings,
                               repeats=repeats, **kwargs)
            rows += got
            ok = [r["link_gbps"] for r in got if r["status"] == "ok" and r["rel_err"] < 1e-2]
            if len(ok) == len(got):
                score[(mode, split_major)] = math.exp(sum(map(math.log, ok)) / len(ok))
    best = max(score, key=score.get) if score else previous
    dec.LOAD_MODE, dec.SPLIT_MAJOR = best
    return rows, best


def format_rows(rows: list[dict]) -> str:
    """A compact fixed-width table of bench rows (what a device run prints last)."""
    head = f"{'variant':<15}{'ctx':>7}{'batch':>6}{'time_ms':>10}{'GB/s':>8}{'%sm':>7}{'rel_err':>9}  status"
    lines = [head]
    for r in rows:
        name = r["variant"]
        if r.get("tuning"):
            name = f"{name}:{r['load_mode'].removeprefix('cp_async_')}:{'S' if r['split_major'] else 'H'}"
        if r["status"] != "ok":
            lines.append(f"{name:<15}{r['context_len']:>7}{r['batch']:>6}  {r['status']}: {r['error'][:60]}")
            continue
        lines.append(f"{name:<15}{r['context_len']:>7}{r['batch']:>6}{r['time_ms']:>10.3f}"
                     f"{r['link_gbps']:>8.2f}{r['pct_of_sm_ceiling']:>7.1f}{r['rel_err']:>9.1e}  ok")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Decode attention benchmark (CUDA variants + torch anchors)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS), choices=list(ROW_VARIANTS))
    ap.add_argument("--anchors", nargs="*", default=list(ANCHORS))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tile-kv", type=int, default=64)
    ap.add_argument("--page-order", default="random", choices=["random", "sequential"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-host-gb", type=float, default=16.0)
    ap.add_argument("--tune", action="store_true", help="pick load mode and grid order first (tune_decode)")
    ap.add_argument("--json", help="write the rows and ceilings here")
    args = ap.parse_args(argv)
    ceilings = measure_ceilings()
    print(" ".join(f"{k}={v:.2f}" for k, v in ceilings.items() if k.endswith("gbps")))
    tuning: list[dict] = []
    if args.tune:
        tuning, best = tune_decode(ceilings=ceilings, page_size=args.page_size, tile_kv=args.tile_kv)
        tuning = [dict(r, tuning=True) for r in tuning]
        print(format_rows(tuning), f"\npicked load_mode={best[0]} split_major={best[1]}", flush=True)
    rows = bench_decode(args.contexts, args.batches, variants=args.variants, anchors=args.anchors,
                        page_size=args.page_size, tile_kv=args.tile_kv, page_order=args.page_order,
                        repeats=args.repeats, max_host_bytes=int(args.max_host_gb * 2**30), ceilings=ceilings)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "tuning": tuning, "rows": rows}, f, indent=1)
    print(format_rows(rows))


if __name__ == "__main__":
    main()
