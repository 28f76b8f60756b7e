"""Python's garbage collector during a measured serving run: what is there before it is frozen, and the
collections that still run are counted and timed.

A collection pauses the thread that queues the GPU's work; in host-bound steps (42-54% of a ShareGPT replay's
steps on the H200) the device then waits. Systems run second in a process measured ~10% faster on the median
(2026-12-01, thirteen pairs). One possible cause, not measured: the first run's collections still scanned the
model build's objects, which a later run finds in the oldest generation. The freeze removes that difference, and
the columns below say how long collections paused each run.
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
