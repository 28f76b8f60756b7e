"""A quick probe of the host's single-thread pace, recorded in every run's manifest (results.environment).

The measured serving steps of small batches wait for the host (directkv/host_time.py), and their host time varies
between runs: over the 40 stored rate sweeps the host times are fitted on (H200, 2026-12-02/03), the per-run median
host time of swap's steps of 1-8 decodes spans 8.9-21.2 ms, and FlexGen's host-led steps took 63 ms in one call and
38 ms in the next (two commits whose FlexGen path differed only in how its host pools are made). Code, load and the
host each differ between those runs; this probe records the host's part. It times Python and torch's dispatcher on
a tiny CPU op, the part of a launch from Python before the CUDA driver, once when the run's results writer starts
(a resumed run keeps the last start's). It is provenance, not an input of the cost model.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

BLOCKS, OPS = 7, 400  # ~3 ms on a current server core


def op_us(op: Callable[[], object] | None = None, *, blocks: int = BLOCKS, ops: int = OPS) -> float:
    """Median over `blocks` of the microseconds per call of `op` (default: torch.add of two 8-element CPU tensors
    into a third), each block `ops` calls."""
    if op is None:
        import torch  # here, as in results.environment: importing the results writer does not load torch

        a, b, out = torch.ones(8), torch.ones(8), torch.empty(8)

        def op() -> object:
            return torch.add(a, b, out=out)

    op()  # the first call pays for lazy initialisation
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(ops):
            op()
        times.append((time.perf_counter() - t0) / ops * 1e6)
    return statistics.median(times)


def probe() -> dict:
    """The manifest's host-pace fields: host_torch_op_us (op_us) and host_loadavg_1m (the host's 1-minute load
    average when the run started; None where the platform has none)."""
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        load = None
    return {"host_torch_op_us": round(op_us(), 3), "host_loadavg_1m": load}
