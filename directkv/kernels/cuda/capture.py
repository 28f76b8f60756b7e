"""Capture a callable into a CUDA graph the way torch requires: one warm-up call on a side stream first, so
library handles and workspaces (cuBLAS's) are made outside the capture. Used by the runner's dense layer
graphs (model/graphs.py), the stream GEMM's graph (gemm_graph.py) and the benchmarks' `:graph` rows
(replayed)."""

from __future__ import annotations

import contextlib
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
    before = torch.cuda.current_stream()
    capture = torch.cuda.graph(graph, pool=pool)
    capture.__enter__()
    try:
        outputs = fn()
    except BaseException:
        # fn failed inside the capture, maybe with a side stream forked and not joined back: ending such a
        # capture raises an error of its own, which would hide fn's (an OOM would read as a capture error), and
        # torch's exit would then skip restoring the caller's stream
        with contextlib.suppress(Exception):
            capture.__exit__(None, None, None)
        torch.cuda.set_stream(before)
        raise
    capture.__exit__(None, None, None)
    return graph.replay, outputs


def replayed(fn: Callable[[], Any], poison: Callable[[], None]) -> Callable[[], Any]:
    """fn as a benchmark row replaying a CUDA graph: the first call captures fn (cuda_capture, a private pool),
    poisons the outputs, since the capture's eager warm-up call wrote them, and replays; later calls replay.
    Each returns the capture's outputs, refreshed in place. A capture that fails raises from the first call,
    where the benchmark's run_point records it as the row's error."""
    graph: list[tuple[Callable[[], None], Any]] = []

    def call() -> Any:
        if not graph:
            graph.append(cuda_capture(fn, None))
            poison()
        graph[0][0]()
        return graph[0][1]

    return call
