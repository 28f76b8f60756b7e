"""Prefill attention benchmark on the GPU: the CUDA variants beside torch SDPA anchors, in one run.

Rows (one per q_len x method), all `mode="measured"`:
  naive / tiled / tiled:* / stream / stream:* : the CUDA kernels over a paged cache whose past K/V sit in
                   pinned host pages (stream: copy-engine ring overlapped with torch's FlashAttention-2
                   passes over it; stream:tiled: the same ring with our tiled kernel's passes);
  sdpa_hbm       : torch SDPA with all K/V in HBM (the compute anchor);
  sdpa_zero_copy : torch SDPA reading K/V through zero-copy views of pinned memory;
  swap_sdpa      : copy-engine copy of K/V to HBM, then SDPA (staging, not overlapped).
The anchors hold past and new K/V in one host buffer (SDPA takes one K tensor), so their kv_bytes count
past + new tokens; the kernels read only the past from the host. L2 is flushed before every timed call.

Run: python -m directkv.kernels.cuda.bench_prefill [--out results.json]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from directkv.kernels.cuda.bench_common import check_rel_err, get_ceilings, report, run_point, timed
from directkv.kernels.cuda.capture import replayed
from directkv.kernels.cuda.prefill_attention import prefill_attention
from directkv.kernels.cuda.prefill_stream import plan_prefill_stream
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.paged import PagedKV

# name -> extra keyword arguments of prefill_attention (variant is the part before ':'); "_kv": "hbm" runs
# the same kernel over a copy of the cache in HBM pages: its on-chip time with no link in the way.
KERNELS = {
    "naive": {},
    "tiled": {},
    "tiled:cg": {"host_load": "cg"},  # past pages copied to L2 only (cp.async.cg); tiled is .ca (through L1)
    "tiled:double": {"double_buffer": True},  # two half-size chunks: load one while computing the other
    "tiled:kv_hbm": {"_kv": "hbm"},
    "tiled:half_state": {"state_dtype": "input"},  # partial O between chunks normalised in bf16: half the bytes
    "stream": {},  # copy engine fills a 2-slot HBM ring while flash passes attend to the previous chunk
    "stream:per_call_plan": {"_plan": "per_call"},  # the schedule rebuilt inside every timed call (host Python)
    "stream:4chunks": {"min_chunks": 4},  # a small cache cut into 4 chunks so copy and math can overlap
    "stream:8chunks": {"min_chunks": 8},  # smaller chunks: less idle before the first and after the last
    "stream:16chunks": {"min_chunks": 16},  # 2 MiB chunks at 16K past, STREAM_MIN_CHUNK_BYTES
    "stream:tiled": {"pass_kernel": "tiled"},  # the ring's passes run our tiled kernel instead of flash
    # the same planned calls replayed from a CUDA graph (capture.replayed; captured at the row's first call):
    # no host gap between the timing's start and the first copy, nor between the passes
    "stream:graph": {"_graph": True},
    "stream:4chunks:graph": {"min_chunks": 4, "_graph": True},
    "stream:8chunks:graph": {"min_chunks": 8, "_graph": True},  # per-chunk launches cost no host time here
    "stream:16chunks:graph": {"min_chunks": 16, "_graph": True},
    # the passes merged by torch ops (an fp32 read-modify-write of the output per pass), as before merge_strided
    "stream:4chunks:graph:torch_merge": {"min_chunks": 4, "_graph": True, "merge": "torch"},
    "stream:8chunks:graph:torch_merge": {"min_chunks": 8, "_graph": True, "merge": "torch"},
}
REL_ERR_MAX = 1e-2  # bf16 against SDPA in HBM; every kernel row measured <= 0.0041 on the H200


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA with the new queries at the end of the key range; q `[1, H, q_len, D]`, k/v `[1, Hkv, L, D]`."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def paged_host_cache(past_len: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Past K/V in pinned host pages in shuffled order: (PagedKV, the same pages in HBM as a PagedKV, contiguous
    past K, V `[past, Hkv, D]` on the GPU, the pinned pools)."""
    pages = math.ceil(past_len / page_size)
    shape = (pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device="cuda").to(dtype)
    v = torch.randn(shape, device="cuda").to(dtype)
    host_k, host_v = pinned_empty(shape, dtype), pinned_empty(shape, dtype)
    perm = torch.randperm(pages, device="cuda")
    host_k.copy_(k[perm])
    host_v.copy_(v[perm])
    table = torch.empty(pages, dtype=torch.int32, device="cuda")
    table[perm] = torch.arange(pages, dtype=torch.int32, device="cuda")  # logical page i sits at host page table[i]
    empty = torch.empty((0, page_size, num_kv_heads, head_dim), dtype=dtype, device="cuda")
    lens = torch.tensor([past_len], dtype=torch.int32)
    kv = PagedKV(device_view(host_k), device_view(host_v), empty, empty, table[None], lens)
    kv_hbm = PagedKV(empty, empty, k[perm], v[perm], -(table[None] + 1), lens)
    flat = lambda t: t.reshape(-1, num_kv_heads, head_dim)[:past_len]  # noqa: E731
    return kv, kv_hbm, flat(k), flat(v), (host_k, host_v)


def bench_prefill(
    q_lens: Sequence[int] = (512, 2048, 8192),
    past_len: int = 16384,
    *,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 16,
    kernels: Sequence[str] = tuple(KERNELS),
    anchors: Sequence[str] = ("sdpa_hbm", "sdpa_zero_copy", "swap_sdpa"),
    warmup: int = 2,
    repeats: int = 5,
    ceilings: dict | None = None,
) -> list[dict]:
    """Time every kernel and anchor at each q_len against past_len cached tokens (Llama-3.1-8B heads by default).

    Returns one row per (q_len, method): time_ms (median), link_read_bytes (closed form; None where unknown),
    link_gbps (link_read_bytes, else kv_bytes, over time_ms), kv_bytes (K/V bytes the method reads from
    the host), floor_ms (kv_bytes over the copy-engine H2D rate), target_ms (1.15 x max(the kernels'
    floor_ms, sdpa_hbm time)), rel_err against sdpa_hbm, the ceilings of this run, status.
    """
    ceilings = get_ceilings() if ceilings is None else ceilings
    kv, kv_hbm, k_past, v_past, _pinned = paged_host_cache(past_len, page_size, num_kv_heads, head_dim, dtype)
    rows: list[dict] = []
    for q_len in q_lens:
        base = dict(op="prefill", q_len=q_len, context_len=past_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), mode="measured", **ceilings)
        q = torch.randn(q_len, num_heads, head_dim, device="cuda").to(dtype)
        k_new = torch.randn(q_len, num_kv_heads, head_dim, device="cuda").to(dtype)
        v_new = torch.randn(q_len, num_kv_heads, head_dim, device="cuda").to(dtype)
        methods = _methods(q, k_new, v_new, (kv, kv_hbm), torch.cat([k_past, k_new]), torch.cat([v_past, v_new]),
                           kernels, anchors)
        reference, out = methods.pop("_reference"), methods.pop("_out")
        for name, (fn, link_bytes, kv_bytes, *extra) in methods.items():
            row = dict(base, **(extra[0] if extra else {}), variant=name, kv_bytes=kv_bytes, link_read_bytes=link_bytes,
                       floor_ms=kv_bytes / (ceilings["ce_h2d_gbps"] * 1e9) * 1e3 if "ce_h2d_gbps" in ceilings else None)
            slow = name in ("sdpa_zero_copy", "naive")
            rows.append(run_point(row, partial(measure_attention, fn, row, reference, warmup=1 if slow else warmup,
                                               repeats=3 if slow else repeats, out=out if name in kernels else None)))
        _add_targets(rows, q_len)
        del methods
    return rows


def _methods(q, k_new, v_new, caches: tuple[PagedKV, PagedKV], k_all, v_all, kernels, anchors) -> dict:
    """name -> (call, link bytes or None, host K/V bytes[, extra row fields]) for one q_len, plus "_reference"
    (SDPA in HBM) and "_out" (the kernels' output buffer).

    caches: the paged cache in host pages and its copy in HBM pages; k_all, v_all `[past_len + q_len,
    num_kv_heads, head_dim]` in HBM; the anchors' pinned copy is made here.
    """
    kv = caches[0]
    tok_bytes = 2 * k_all.shape[1] * k_all.shape[2] * k_all.element_size()
    past_bytes, all_bytes = int(kv.seq_lens[0]) * tok_bytes, k_all.shape[0] * tok_bytes
    qh = q.transpose(0, 1)[None]  # SDPA layout [1, heads, tokens, dim]
    k_pin, v_pin = pinned_empty(k_all.shape, k_all.dtype), pinned_empty(v_all.shape, v_all.dtype)
    k_pin.copy_(k_all)
    v_pin.copy_(v_all)
    k_buf, v_buf = torch.empty_like(k_all), torch.empty_like(v_all)
    layout = lambda k, v: (k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # noqa: E731
    hbm_kv, host_kv = layout(k_all, v_all), layout(device_view(k_pin), device_view(v_pin))
    out = torch.empty_like(q)

    def swap() -> torch.Tensor:
        k_buf.copy_(k_pin, non_blocking=True)
        v_buf.copy_(v_pin, non_blocking=True)
        return causal_sdpa(qh, *layout(k_buf, v_buf))

    def kernel(name: str):
        """(call, extra row fields): stream's schedule is planned once here, outside the timed calls, as a
        serving step plans it once for all its layers (plan_ms: its host time), unless _plan is per_call."""
        kwargs = dict(KERNELS[name], variant=name.split(":")[0])
        cache = caches[1] if kwargs.pop("_kv", "host") == "hbm" else kv
        extra = {}
        if kwargs["variant"] == "stream" and kwargs.pop("_plan", "once") == "once":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            kwargs["stream_plan"] = plan_prefill_stream(cache, chunk_bytes=kwargs.pop("chunk_bytes", None),
                                                        min_chunks=kwargs.pop("min_chunks", 1))
            extra["plan_ms"] = (time.perf_counter() - t0) * 1e3
        graph = kwargs.pop("_graph", False)
        call = lambda: prefill_attention(q, k_new, v_new, cache, out=out, **kwargs)  # noqa: E731
        return (replayed(call, lambda: out.fill_(float("nan"))) if graph else call), extra

    methods = {}
    for name in kernels:
        fn, extra = kernel(name)
        methods[name] = (fn, None, 0 if "_kv" in KERNELS[name] else past_bytes, extra)
    anchor_fns = {
        "sdpa_hbm": (lambda: causal_sdpa(qh, *hbm_kv), 0, 0),
        "sdpa_zero_copy": (lambda: causal_sdpa(qh, *host_kv), None, all_bytes),
        "swap_sdpa": (swap, all_bytes, all_bytes),
    }
    methods.update({a: anchor_fns[a] for a in anchors})
    methods["_reference"] = causal_sdpa(qh, *hbm_kv)[0].transpose(0, 1).double()
    methods["_out"] = out  # the kernel rows' shared output, poisoned before each checked call
    return methods


def measure_attention(fn: Callable[[], object], row: dict, reference: torch.Tensor, *, warmup: int, repeats: int,
                      out: torch.Tensor | None = None, max_rel_err: float = REL_ERR_MAX) -> None:
    """One checked call (rel_err against the HBM SDPA output; a kernel's closed-form link bytes, writes only where
    it has some), then timing; a rel_err above max_rel_err (or NaN) makes the row an error. `out`, the buffer the
    kernel rows share, is poisoned first, so a call that leaves it unwritten fails instead of passing on the
    previous row's output. bench_proj measures the same way."""
    if out is not None:
        out.fill_(float("nan"))
    result = fn()
    if isinstance(result, tuple):  # a kernel: (out, Traffic)
        row["link_read_bytes"] = result[1].link_read_bytes
        if result[1].link_write_bytes:
            row["link_write_bytes"] = result[1].link_write_bytes
        result = result[0]
    else:
        result = result[0].transpose(0, 1)
    check_rel_err(row, result, reference, max_rel_err, "SDPA in HBM", "output")
    row.update(timed(fn, warmup=warmup, repeats=repeats))


def _add_targets(rows: list[dict], q_len: int) -> None:
    """link_gbps and target_ms of the rows of one q_len (target: 1.15 x max(link floor, HBM SDPA time))."""
    mine = [r for r in rows if r["q_len"] == q_len and r["op"] == "prefill"]
    hbm = next((r.get("time_ms") for r in mine if r["variant"] == "sdpa_hbm" and r["status"] == "ok"), None)
    kernel_floor = next((r["floor_ms"] for r in mine if r["variant"] in KERNELS), None)
    for r in mine:
        t = r.get("time_ms")
        moved = r["link_read_bytes"] if r["link_read_bytes"] is not None else r["kv_bytes"]
        r["link_gbps"] = moved / (t * 1e-3) / 1e9 if t and moved else None
        floors = [x for x in (kernel_floor, hbm) if x is not None]
        r["target_ms"] = 1.15 * max(floors) if floors else None


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--q-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--past-len", type=int, default=16384)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = bench_prefill(args.q_lens, args.past_len)
    report(rows, args.out, ["q_len", "variant", "status", "time_ms", "target_ms", "floor_ms", "link_gbps",
                       "link_read_bytes", "kv_bytes", "rel_err"])
    return rows


if __name__ == "__main__":
    main()
