"""One kernel call to profile under Nsight Compute (see directkv/counters.py).

`python -m experiments.ncu_target OP VARIANT --context N [--batch B] [--q-len Q]`: builds host-resident
inputs (pinned memory, zero-copy views), runs the call once to warm up, then once inside an NVTX range
named `measure`, which is what ncu profiles. Llama-3.1-8B attention shapes (32/8 heads, head_dim 128, bf16).
VARIANT `read_probe` is the ceilings' streaming-read kernel over as many pinned bytes as OP's host inputs hold
(host_bytes): what ncu's PCIe byte counter reports for one plain read of those bytes, the yardstick of the
kernels' re-read factors (kernel_bench adds it to every profiled row).
"""

from __future__ import annotations

import argparse

import torch

from directkv.kernels import get_op
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.paged import PagedKV

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16


def host_paged(batch: int, context: int) -> PagedKV:
    pages = -(-context // PAGE)
    shape = (batch * pages, PAGE, HKV, D)
    k, v = pinned_empty(shape, DT), pinned_empty(shape, DT)
    k.copy_(torch.randn(shape, dtype=DT))
    v.copy_(torch.randn(shape, dtype=DT))
    table = torch.randperm(batch * pages, dtype=torch.int32).view(batch, pages).cuda()
    empty = torch.empty((0, PAGE, HKV, D), dtype=DT, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return PagedKV(device_view(k), device_view(v), empty, empty, table, lens)


def host_dense(batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous `[batch, num_kv_heads, context, head_dim]` K, V in pinned memory, as zero-copy views."""
    out = []
    for _ in range(2):
        t = pinned_empty((batch, HKV, context, D), DT)
        t.copy_(torch.randn(t.shape, dtype=DT))
        out.append(device_view(t))
    return out[0], out[1]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def host_bytes(op: str, context: int, batch: int) -> int:
    """Bytes of OP's host-resident inputs as call() builds them: the K and V pools of host_paged (every page
    of every sequence), or the GEMM's B."""
    if op == "gemm":
        return context * context * torch.float16.itemsize
    return 2 * batch * -(-context // PAGE) * PAGE * HKV * D * DT.itemsize


def read_probe(nbytes: int):
    """The SM zero-copy read ceiling's kernel (probe.stream_read_call) over `nbytes` of pinned memory."""
    from directkv.kernels.cuda.probe import stream_read_call

    host = pinned_empty((nbytes // 2,), DT)
    host.copy_(torch.randn(host.shape, dtype=DT))
    return stream_read_call(device_view(host))


def call(op: str, variant: str, context: int, batch: int, q_len: int):
    if variant == "read_probe":
        return read_probe(host_bytes(op, context, batch))
    name = variant
    variant, _, detail = variant.partition(":")
    opts = {"host_load": detail} if detail in ("ca", "cg") else {}  # prefill's host-load mode
    if op == "gemm":
        if variant != "cublas_zero_copy":  # the benchmark row's own options
            from directkv.kernels.cuda.bench_gemm import KERNELS

            opts = dict(KERNELS.get(name, {"_unknown": name}))
            if any(key.startswith("_") for key in opts):  # B elsewhere than the host, a graph, or no such row
                raise SystemExit(f"ncu_target: gemm row {name!r} is not profiled (B in pinned host memory, eager calls "
                                 f"only)")
        a = torch.randn(context, context, dtype=torch.float16, device="cuda")
        b_host = pinned_empty((context, context), torch.float16)
        b_host.copy_(torch.randn(context, context, dtype=torch.float16))
        b = device_view(b_host)
        if variant == "cublas_zero_copy":
            return lambda: a @ b
        return lambda: get_op("gemm", "cuda")(a, b, variant=variant, **opts)
    if variant == "sdpa_zero_copy":  # the naive zero-copy anchor: SDPA reading host K/V in place
        k, v = host_dense(batch, context)  # same bytes as the measured row: every sequence of the batch
        q = torch.randn(batch, HQ, 1 if op == "decode" else q_len, D, dtype=DT, device="cuda")
        return lambda: sdpa(q, k, v, causal=False)  # prefill: all past visible, no mask needed
    kv = host_paged(batch, context)
    if op == "decode":
        q = torch.randn(batch, HQ, D, dtype=DT, device="cuda")
        return lambda: get_op("decode_attention", "cuda")(q, kv, variant=variant)
    q = torch.randn(q_len, HQ, D, dtype=DT, device="cuda")
    kn, vn = (torch.randn(q_len, HKV, D, dtype=DT, device="cuda") for _ in range(2))
    return lambda: get_op("prefill_attention", "cuda")(q, kn, vn, kv, variant=variant, causal=True, **opts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["decode", "prefill", "gemm"])
    ap.add_argument("variant")
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q-len", type=int, default=2048)
    a = ap.parse_args()
    fn = call(a.op, a.variant, a.context, a.batch, a.q_len)
    fn()
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range("measure"):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
