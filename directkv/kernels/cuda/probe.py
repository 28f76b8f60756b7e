"""Bandwidth ceilings measured in the same run as the kernels they judge.

sm_read_gbps  : SMs streaming pinned host memory through a zero-copy view (csrc probe kernel): the ceiling
                of every zero-copy kernel. The buffer comes from cudaHostAlloc, as the KV arena's does;
                sm_read_<alloc>_gbps repeat the probe over torch's pinned allocator and over registered memory
                (zero_copy.ALLOCS), because SM loads do not read every kind of pinned memory equally fast.
ce_h2d_gbps   : copy engine, pinned host -> HBM (torch copy, non_blocking); the ceiling of staging.
ce_d2h_gbps   : copy engine, HBM -> pinned host.
hbm_copy_gbps : HBM -> HBM copy, bytes read plus bytes written.
ce_h2d_2x_gbps : two host -> HBM copies at once, on two streams (each half the buffer): does a second copy
                engine add link bandwidth?
ce_plus_sm_gbps : the copy engine moving half the buffer on a side stream while the SM probe reads the other
                half zero-copy, bytes of both over the wall time of both: whether a kernel reading host memory
                in place adds to a staging copy's bandwidth on this link, or only takes a share of it.

All in decimal GB/s (1e9 B/s), timed with directkv.timing.time_fn (median of repeats after warm-up).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from directkv.errors import check
from directkv.kernels.cuda import build
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.timing import time_fn

THREADS = 256
BLOCKS_PER_SM = 8


def stream_read_call(view: torch.Tensor, *, blocks: int | None = None) -> Callable[[], torch.Tensor]:
    """A call that launches the grid-stride float4 read kernel over all of `view` (contiguous CUDA tensor,
    nbytes % 16 == 0) on the current stream and returns its sink (one partial sum per thread).

    Pointed at a zero-copy view of pinned memory it reads across the link; at an HBM tensor, HBM.
    `blocks` defaults to BLOCKS_PER_SM CTAs of THREADS threads per SM.
    """
    check(view.device.type == "cuda" and view.is_contiguous(), "stream_read needs a contiguous CUDA tensor")
    nbytes = view.numel() * view.element_size()
    check(nbytes >= 16 and nbytes % 16 == 0 and view.data_ptr() % 16 == 0,
          f"stream_read needs a 16-byte aligned buffer of a multiple of 16 bytes; got {nbytes} B")
    mod = build.load("probe")
    blocks = blocks or BLOCKS_PER_SM * mod.num_sms()
    sink = torch.empty(blocks * THREADS, dtype=torch.float32, device=view.device)

    def run() -> torch.Tensor:
        mod.stream_read(view.data_ptr(), nbytes, sink.data_ptr(), blocks, THREADS,
                        torch.cuda.current_stream(view.device).cuda_stream)
        return sink

    return run


def stream_read_gbps(view: torch.Tensor, *, blocks: int | None = None, warmup: int = 2, repeats: int = 5) -> float:
    """GB/s of stream_read_call(view, blocks=blocks), median of `repeats` timed calls after `warmup`."""
    timing = time_fn(stream_read_call(view, blocks=blocks), warmup=warmup, repeats=repeats, device=view.device)
    return view.numel() * view.element_size() / (timing.median_ms * 1e-3) / 1e9


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, *, repeats: int, bytes_factor: int = 1) -> float:
    timing = time_fn(lambda: dst.copy_(src, non_blocking=True), warmup=2, repeats=repeats, device="cuda")
    return bytes_factor * src.numel() * src.element_size() / (timing.median_ms * 1e-3) / 1e9


def _concurrent_gbps(host: torch.Tensor, hbm: torch.Tensor, *, sm_half: bool, repeats: int) -> float:
    """GB/s of host (pinned, uint8) -> hbm moved as two halves at once: the first half by a copy on a side
    stream, the second by a second copy (sm_half=False) or by the SM probe reading it zero-copy (True)."""
    half = host.numel() // 2 // 16 * 16
    main = torch.cuda.current_stream(hbm.device)
    side = torch.cuda.Stream(hbm.device)
    read = stream_read_call(device_view(host)[half:2 * half])  # launches on the current stream: main, below

    def run() -> None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            hbm[:half].copy_(host[:half], non_blocking=True)
        if sm_half:
            read()
        else:
            hbm[half:2 * half].copy_(host[half:2 * half], non_blocking=True)
        main.wait_stream(side)

    with torch.cuda.device(hbm.device):  # time_fn's events go on the current device's stream: main's
        timing = time_fn(run, warmup=2, repeats=repeats, device=hbm.device)
    return 2 * half / (timing.median_ms * 1e-3) / 1e9


def measure_ceilings(nbytes: int = 2**30, *, repeats: int = 5) -> dict[str, float]:
    """Measure the four ceilings over buffers of `nbytes` (default 1 GiB: ~17x the H200's L2).

    Returns {"sm_read_gbps", "ce_h2d_gbps", "ce_d2h_gbps", "hbm_copy_gbps", "probe_bytes",
    "sm_read_torch_gbps", "sm_read_register_gbps", "ce_h2d_2x_gbps", "ce_plus_sm_gbps"}.
    """
    check(torch.cuda.is_available(), "measure_ceilings needs a CUDA GPU")
    check(nbytes >= 2**20 and nbytes % 16 == 0, f"nbytes must be >= 1 MiB and a multiple of 16; got {nbytes}")
    host = pinned_empty((nbytes,), torch.uint8, alloc="host_alloc")
    hbm = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")  # random, never zeros
    hbm2 = torch.empty_like(hbm)
    d2h = _copy_gbps(host, hbm, repeats=repeats)  # also fills the pinned buffer with the random bytes
    h2d = _copy_gbps(hbm2, host, repeats=repeats)
    hbm_copy = _copy_gbps(hbm2, hbm, repeats=repeats, bytes_factor=2)
    sm_read = stream_read_gbps(device_view(host), repeats=repeats)
    both = {"ce_h2d_2x_gbps": _concurrent_gbps(host, hbm2, sm_half=False, repeats=repeats),
            "ce_plus_sm_gbps": _concurrent_gbps(host, hbm2, sm_half=True, repeats=repeats)}
    others = {}
    for alloc in ("torch", "register"):
        other = pinned_empty((nbytes,), torch.uint8, alloc=alloc)
        other.copy_(hbm)
        others[f"sm_read_{alloc}_gbps"] = stream_read_gbps(device_view(other), repeats=repeats)
        del other
    torch.cuda.synchronize()
    return {"sm_read_gbps": sm_read, "ce_h2d_gbps": h2d, "ce_d2h_gbps": d2h, "hbm_copy_gbps": hbm_copy,
            "probe_bytes": float(nbytes)} | others | both
