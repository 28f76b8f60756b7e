"""K/V projection + attention benchmark on the GPU: separate vs fused beside HBM anchors, in one run.

Rows (one per q_len x method), all `mode="measured"`; every method projects x `[q_len, hidden]` to Q, K, V
(RoPE on Q and K) and attends over past_len cached tokens plus the new ones:
  separate  : cuBLAS projections, new K/V stored to their pinned host pages, the tiled kernel reads past and
              new K/V back from the pages (proj_attention.py);
  fused     : cuBLAS Q projection; the new K/V are projected inside the tiled kernel, stored once, never read
              back;
  sdpa_hbm  : cuBLAS projections and torch SDPA with every K/V in HBM (the compute anchor);
  swap_sdpa : the past K/V copied by the copy engine from pinned memory into HBM, then as sdpa_hbm.
link_read_bytes / link_write_bytes are the closed forms (kernels) or the copy (swap); link_gbps is both over
time_ms. L2 is flushed before every timed call. The kernels write the same cache slots on every repeat.

Run: python -m directkv.kernels.cuda.bench_proj [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import torch

from directkv.kernels.cuda.bench_common import get_ceilings, report, run_point
from directkv.kernels.cuda.bench_prefill import causal_sdpa, measure_attention, paged_host_cache
from directkv.kernels.cuda.proj_attention import VARIANTS, proj_attention, project, rope_tables
from directkv.kernels.cuda.zero_copy import pinned_empty

# bf16 projections then attention, against cuBLAS + SDPA: 0.0028-0.0031 at Llama's shapes on the H200; small test
# shapes (hidden 128) round more, and the GPU test accepts < 2e-2
PROJ_REL_ERR_MAX = 2e-2


def bench_proj(
    q_lens: Sequence[int] = (1, 512, 2048),
    past_len: int = 16384,
    *,
    hidden: int = 4096,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    rope_theta: float | None = 500000.0,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 16,
    warmup: int = 2,
    repeats: int = 5,
    ceilings: dict | None = None,
) -> list[dict]:
    """Time separate, fused and the anchors at each q_len (Llama-3.1-8B shapes by default).

    Returns one row per (q_len, method): time_ms (median), link_read_bytes, link_write_bytes, kv_bytes (past
    K/V bytes on the host), floor_ms (kv_bytes over this run's copy-engine H2D rate), rel_err against
    sdpa_hbm's output, the ceilings of this run, status.
    """
    ceilings = get_ceilings() if ceilings is None else ceilings
    rows: list[dict] = []
    for q_len in q_lens:
        base = dict(op="proj_attention", q_len=q_len, context_len=past_len, hidden=hidden, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                    mode="measured", **ceilings)
        kv, _, k_all, v_all, _pinned = paged_host_cache(past_len + q_len, page_size, num_kv_heads, head_dim, dtype)
        kv = dataclasses.replace(kv, seq_lens=torch.tensor([past_len], dtype=torch.int32))
        x = torch.randn(q_len, hidden, device="cuda").to(dtype)
        wq, wk, wv = ((torch.randn(hidden, cols, device="cuda") / hidden**0.5).to(dtype)
                      for cols in (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim))
        methods = _methods(x, (wq, wk, wv), kv, k_all[:past_len], v_all[:past_len], rope_theta, head_dim)
        reference = methods.pop("_reference")
        kv_bytes = 2 * k_all[:past_len].numel() * k_all.element_size()
        floor = kv_bytes / (ceilings["ce_h2d_gbps"] * 1e9) * 1e3 if "ce_h2d_gbps" in ceilings else None
        for name, fn in methods.items():
            row = dict(base, variant=name, kv_bytes=kv_bytes, floor_ms=floor,
                       link_read_bytes=kv_bytes if name == "swap_sdpa" else 0 if name == "sdpa_hbm" else None)
            rows.append(run_point(row, partial(measure_attention, fn, row, reference, warmup=warmup, repeats=repeats,
                                               max_rel_err=PROJ_REL_ERR_MAX)))
            # both directions: the kernels' writes of the new K/V cross the same link
            t, moved = row.get("time_ms"), (row["link_read_bytes"] or 0) + (row.get("link_write_bytes") or 0)
            row["link_gbps"] = moved / (t * 1e-3) / 1e9 if t and moved else None
        del methods, kv
    return rows


def _methods(x, weights, kv, k_past, v_past, rope_theta, head_dim: int) -> dict[str, Callable]:
    """name -> call for one q_len, plus "_reference" (sdpa_hbm's output, float64)."""
    wq, wk, wv = weights
    q_len, past = x.shape[0], k_past.shape[0]
    k_pin, v_pin = pinned_empty(k_past.shape, k_past.dtype), pinned_empty(v_past.shape, v_past.dtype)
    k_pin.copy_(k_past)
    v_pin.copy_(v_past)
    k_buf, v_buf = torch.empty_like(k_past), torch.empty_like(v_past)

    def dense(k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
        rot = None if rope_theta is None else rope_tables(past, q_len, head_dim, float(rope_theta), x.device)
        q, k, v = project(x, wq, head_dim, rot), project(x, wk, head_dim, rot), project(x, wv, head_dim, None)
        layout = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        return causal_sdpa(layout(q), layout(torch.cat([k_old, k])), layout(torch.cat([v_old, v])))  # SDPA's layout

    def swap() -> torch.Tensor:
        k_buf.copy_(k_pin, non_blocking=True)
        v_buf.copy_(v_pin, non_blocking=True)
        return dense(k_buf, v_buf)

    out = torch.empty(q_len, wq.shape[1] // head_dim, head_dim, dtype=x.dtype, device=x.device)
    methods: dict[str, Callable] = {v: partial(proj_attention, x, wq, wk, wv, kv, variant=v, rope_theta=rope_theta, out=out)
                                    for v in VARIANTS}
    methods |= {"sdpa_hbm": lambda: dense(k_past, v_past), "swap_sdpa": swap}
    methods["_reference"] = dense(k_past, v_past)[0].transpose(0, 1).double()
    return methods


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--q-lens", type=int, nargs="+", default=[1, 512, 2048])
    parser.add_argument("--past-len", type=int, default=16384)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = bench_proj(args.q_lens, args.past_len)
    report(rows, args.out, ["q_len", "variant", "status", "time_ms", "floor_ms", "link_gbps", "link_read_bytes",
                       "link_write_bytes", "rel_err"])
    return rows


if __name__ == "__main__":
    main()
