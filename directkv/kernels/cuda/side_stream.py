"""Side streams per device: the copy stream of the `stream` variants that make their ring per call (prefill
attention, GEMM), and the stream of directkv's pipelined decode attention (engine/gpu/paths.py; slots 0: no
events).

One side stream per (device, slots, lane), with `slots` pairs of events: `filled[i]` is recorded on the side stream after
ring slot i is copied, `freed[i]` on the caller's stream after the math is done with it. Calls come from one
thread and each starts with `side.wait_stream(current)`, so ops can share the stream and re-record the
events: a wait takes the event's latest record at the time it is issued. Decode's stream variant keeps its
own stream and events in its StreamPlan, which also owns its ring across calls.
"""

from __future__ import annotations

import torch

# (device index, slots, lane) -> (side stream, filled events, freed events)
_SIDE: dict[tuple[int, int, int], tuple[torch.cuda.Stream, list[torch.cuda.Event], list[torch.cuda.Event]]] = {}


def side_stream(device: torch.device, slots: int, lane: int = 0) -> tuple[torch.cuda.Stream, list[torch.cuda.Event],
                                                                          list[torch.cuda.Event]]:
    """(side stream, filled events, freed events) of `device`, made on first use and reused by every call;
    `lane` > 0 gives further streams, for copies split across copy engines."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, slots, lane)
    if key not in _SIDE:
        _SIDE[key] = (torch.cuda.Stream(torch.device("cuda", index)), [torch.cuda.Event() for _ in range(slots)],
                      [torch.cuda.Event() for _ in range(slots)])
    return _SIDE[key]
