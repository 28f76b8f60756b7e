"""Row scatter of one or two tensor pairs in one launch (csrc/include/directkv/scatter_rows.cuh).

A serving step stores each layer's new K and V rows into the KV pools (a staging pool, the stream ring):
`dst.view(-1, *row)[dst_rows] = src` per tensor was a torch index_put each, with its launch and ~15-30 us of
host dispatch, per layer and step. Off CUDA (the CPU tests' reference backend), or where a row is not a whole
number of 16-byte vectors, this does exactly that index_put.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from functools import cache

import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda import build


@cache
def _module():
    return build.load("scatter_rows")  # once: load() takes a lock on every call


def scatter_rows(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], dst_rows: torch.Tensor,
                 src_rows: torch.Tensor | None = None, *, stream: int | None = None) -> None:
    """For each (dst, src) pair: `dst.view(-1, *src.shape[1:])[dst_rows] = src[src_rows]` (src without src_rows).

    dst : one or two contiguous tensors of one shape, whose rows (any trailing shape) are src's rows;
    src : as many tensors `[m, *row]` of one shape and dst's dtype;
    dst_rows, src_rows : `[n]` int64 on src's device (n = m without src_rows), in [0, rows): the CUDA kernel stops
        with a device-side trap on an index outside dst or src (torch's index check is device-side too), where
        the index_put it falls back to would wrap a negative one around.
    stream : the CUDA stream handle to run on (default: the current stream); the fallback runs there too.
    The one launch is taken on CUDA for contiguous tensors on one device, 16-byte aligned, with rows of whole
    16-byte vectors; anything else falls back to the index_put.
    """
    d0, s0 = dst[0], src[0]
    row = s0.shape[1:]
    n = dst_rows.shape[0] if dst_rows.dim() == 1 else -1
    # checked in one expression, the message built only on failure: this runs once or twice per layer in serving
    if not (1 <= len(dst) == len(src) <= 2 and all(d.shape == d0.shape and d.dtype == s0.dtype and d.is_contiguous()
                                                   for d in dst)
            and all(s.shape == s0.shape and s.dtype == s0.dtype for s in src)
            and d0.numel() % max(math.prod(row), 1) == 0 and dst_rows.dtype == torch.int64
            and (n == s0.shape[0] if src_rows is None else src_rows.dtype == torch.int64 and src_rows.shape == (n,))):
        raise ConfigError(
            f"scatter_rows wants one or two pairs of contiguous dst (one shape, a whole number of src rows) and src "
            f"(one shape and dtype, dst's), int64 [n] dst_rows (and src_rows), n = src rows without src_rows; got dst "
            f"{[(tuple(d.shape), str(d.dtype), d.is_contiguous()) for d in dst]} (shape, dtype, contiguous), src "
            f"{[(tuple(s.shape), str(s.dtype)) for s in src]}, dst_rows {tuple(dst_rows.shape)} {dst_rows.dtype}, "
            f"src_rows {None if src_rows is None else (tuple(src_rows.shape), str(src_rows.dtype))}")
    row_bytes = math.prod(row) * s0.element_size()
    device = d0.device
    fast = (device.type == "cuda" and row_bytes % 16 == 0
            and all(t.device == device and t.data_ptr() % 16 == 0 for t in (*dst, *src))
            and all(s.is_contiguous() for s in src) and dst_rows.device == device and dst_rows.is_contiguous()
            and (src_rows is None or (src_rows.device == device and src_rows.is_contiguous())))
    if not fast:
        on = (torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))
              if stream is not None and device.type == "cuda" else contextlib.nullcontext())
        with on:
            for d, s in zip(dst, src, strict=True):
                d.view(-1, *row)[dst_rows] = s if src_rows is None else s[src_rows]
        return
    if n == 0:
        return
    _module().run(
        [d.data_ptr() for d in dst], [s.data_ptr() for s in src], dst_rows.data_ptr(),
        0 if src_rows is None else src_rows.data_ptr(), n, d0.numel() // math.prod(row), s0.shape[0], row_bytes,
        torch.cuda.current_stream(device).cuda_stream if stream is None else stream)
