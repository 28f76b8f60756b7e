"""Python's garbage collector during a measured serving run: what is there before it is frozen, and the
collections that still run are counted and timed.

A collection pauses the thread that queues the GPU's work; in host-bound steps (42-54% of a ShareGPT replay's
steps on the H200) the device then waits. Systems run second in a process measured ~10% faster on the median
(2026-12-01, thirteen pairs). The guess was that the first run's collections still scanned the model build's
objects; the columns below then measured 1-4 ms of collection pauses per run, far too little, and the slow start
was found elsewhere (experiments/serving.py, executor.warmup_pass). The freeze stays: it keeps those pauses
small and alike for every run.
"""

from __future__ import annotations

import gc
import time


class GcGuard:
    """Context: collect and freeze what exists (gc.freeze: later collections skip it), count and time the
    collections inside, unfreeze on exit. columns() -> gc_collections, gc_oldest_collections, gc_pause_ms."""

    def __init__(self) -> None:
        self.collections = self.oldest = 0
        self.pause_s = 0.0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.pause_s += time.perf_counter() - self._t0
        self.collections += 1
        self.oldest += info.get("generation") == 2

    def __enter__(self) -> GcGuard:
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
        gc.unfreeze()

    def columns(self) -> dict:
        return {"gc_collections": self.collections, "gc_oldest_collections": self.oldest,
                "gc_pause_ms": 1e3 * self.pause_s}
