"""The one timing utility: CUDA events around the call, warm-up first, median of repeats.

On a CPU-only machine it falls back to perf_counter so the same code path runs in tests; results
carry which clock was used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    clock: str  # "cuda_events" or "perf_counter"

    def as_dict(self, prefix: str = "time") -> dict[str, float | int | str]:
        return {
            f"{prefix}_ms": self.median_ms,
            f"{prefix}_min_ms": self.min_ms,
            f"{prefix}_max_ms": self.max_ms,
            "repeats": self.repeats,
            "clock": self.clock,
        }


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    device: str | torch.device | None = None,
    setup: Callable[[], object] | None = None,
) -> Timing:
    """Time `fn()`; `setup()` (untimed) runs before every call, e.g. to poison outputs or flush L2."""
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    samples: list[float] = []
    if use_cuda:
        torch.cuda.synchronize()
        for _ in range(repeats):
            if setup:
                setup()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
    else:
        for _ in range(repeats):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(samples), min(samples), max(samples), repeats, "cuda_events" if use_cuda else "perf_counter")
