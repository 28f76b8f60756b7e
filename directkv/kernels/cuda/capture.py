"""Capture a callable into a CUDA graph the way torch requires: one warm-up call on a side stream first, so
library handles and workspaces (cuBLAS's) are made outside the capture. Used by the runner's dense layer
graphs (model/graphs.py) and by the stream GEMM's graph (gemm_graph.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# device index -> the one side stream every capture's warm-up runs on
_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def cuda_capture(fn: Callable[[], Any], pool: Any) -> tuple[Callable[[], None], Any]:
    """Capture fn into a CUDA graph in `pool` (None: a private pool) after one warm-up call on a side stream.
    Returns (replay, outputs): fn's outputs from the capture, refreshed in place by each replay. All warm-ups
    share one side stream per device: torch keeps a cuBLAS workspace per (handle, stream), so a new stream per
    capture (576 of them for Llama's 9 sizes x 32 layers x 2) would leave one workspace per capture behind."""
    index = torch.cuda.current_device()
    if index not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[index] = torch.cuda.Stream()
    side = _WARMUP_STREAMS[index]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph.replay, outputs
