"""Merge of attention passes stacked in one buffer, one CUDA launch (csrc/include/directkv/merge_stacked.cuh).

The stream variants attend to a cache in passes (ring chunks, HBM pages), each giving a normalised O and its
log-sum-exp. decode_attention's stream stacks its passes in one buffer and merges them with this kernel once
per call, in place of the eight or so torch ops of merge_strided.merge_passes (which merges passes of any
layout, as prefill's are); its C++ loop launches the kernel itself (launch_merge_stacked). This wrapper is the op's entry
for other callers and the kernel's tests.
"""

from __future__ import annotations

from functools import cache

import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda import build

OUT_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@cache
def _module():
    return build.load("merge_stacked")  # once: load() takes a lock on every call


def merge_stacked(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, *, stream: int | None = None) -> torch.Tensor:
    """out = sum over p of softmax_p(lse[p]) * o[p], queued on `stream` (a CUDA stream handle; default the current
    stream); returns out.

    o : `[P, *rows, head_dim]` fp32 CUDA, contiguous, P >= 1, head_dim a multiple of 4.
    lse : `[P, *rows]` fp32 natural-log LSEs, contiguous; -inf where a pass saw no key of a row (that pass's O
        is then not read, so it may be unwritten; a row no pass saw gets zeros).
    out : `[*rows, head_dim]` contiguous, fp16 / bf16 / fp32, on o's device.
    """
    # checked in one expression, the message built only on failure: this runs once per layer in serving
    if not (o.dim() >= 2 and o.shape[0] >= 1 and lse.shape == o.shape[:-1] and out.shape == o.shape[1:]
            and o.dtype == lse.dtype == torch.float32 and out.dtype in OUT_DTYPE_CODES and o.shape[-1] % 4 == 0
            and o.is_cuda and o.device == lse.device == out.device
            and o.is_contiguous() and lse.is_contiguous() and out.is_contiguous()):
        raise ConfigError(
            f"merge_stacked wants contiguous CUDA tensors on one device: o [P >= 1, *rows, D] fp32 with D a multiple "
            f"of 4, lse [P, *rows] fp32, out [*rows, D] of {[str(d) for d in OUT_DTYPE_CODES]}; got o "
            f"{tuple(o.shape)} {o.dtype} {o.device}, lse {tuple(lse.shape)} {lse.dtype} {lse.device}, out "
            f"{tuple(out.shape)} {out.dtype} {out.device}, contiguous {[t.is_contiguous() for t in (o, lse, out)]}")
    head_dim = o.shape[-1]
    _module().run(
        o.data_ptr(), lse.data_ptr(), out.data_ptr(), out.numel() // head_dim, head_dim, o.shape[0], head_dim,
        OUT_DTYPE_CODES[out.dtype], torch.cuda.current_stream(out.device).cuda_stream if stream is None else stream)
    return out
