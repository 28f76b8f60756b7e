"""What holds a serving run's GPU memory, by the code that allocated it (the profiler's --memory).

The results' `gpu_mem_gb` is torch's reserved peak: the caching allocator's segments (its cudaMalloc calls), which a
run never gives back, so the segments alive at the end of a run are its reserved peak. `gpu_peak_allocated_gb` is
the most its tensors held at once. The gap between the two is segment space no tensor used at that moment. With the
allocator's history recorded (Python stacks, for the whole run) this module sums both by origin, the innermost
`directkv` frame of the allocation (else the innermost frame outside torch):

* reserved_by_origin: the live segments, each charged to the allocation that made torch cudaMalloc it;
* peak_by_origin: the tensors alive at the allocated peak, replayed from the history.

H200, 2026-12-03, OPT-13B 3 x 32K: folding the prefill stream's passes took 0.49 GB off the allocated peak but only
0.17 GB off the reserved one; this is the tool that says which segments keep the rest. Recording stacks slows every
allocation, so a recorded run's step times are not comparable with others.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

HISTORY_ENTRIES = 2_000_000  # allocator events kept (a ring: a longer run loses its first ones, and says so)
PACKAGE = "/directkv/"


def start_recording(max_entries: int = HISTORY_ENTRIES) -> None:
    """Record the caching allocator's history with Python stacks from now on (current CUDA device)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)


def stop_recording() -> dict:
    """The allocator's snapshot (segments and history, torch.cuda.memory._snapshot's dict); recording stops."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def origin(frames: list[dict]) -> str:
    """"path:line function" of the innermost frame in the package (frames come innermost first, as torch records
    them), else of the innermost frame outside torch; "(no stack)" without frames."""
    def fmt(f: dict) -> str:
        name = f["filename"]
        name = name[name.rindex(PACKAGE) + 1:] if PACKAGE in name else name.rsplit("/", 1)[-1]
        return f"{name}:{f['line']} {f['name']}"
    ours = [f for f in frames if PACKAGE in f["filename"]]
    if ours:
        return fmt(ours[0])
    outside = [f for f in frames if "/torch/" not in f["filename"] and f["filename"].endswith(".py")]
    return fmt(outside[0]) if outside else "(no stack)"


@dataclass(frozen=True)
class Share:
    origin: str
    count: int  # segments (reserved_by_origin) or tensors (peak_by_origin)
    bytes: int
    used: int = 0  # reserved_by_origin: bytes of those segments in use at the end


def _trace(snapshot: dict) -> list[dict]:
    traces = snapshot.get("device_traces") or [[]]
    return max(traces, key=len)  # the recorded device's (others are empty)


def complete(snapshot: dict, max_entries: int = HISTORY_ENTRIES) -> bool:
    """Whether the history holds the whole recording (a full ring may have dropped its first events)."""
    return len(_trace(snapshot)) < max_entries


def reserved_by_origin(snapshot: dict) -> list[Share]:
    """The live segments (the reserved peak) summed by the origin of the allocation that made each, largest first;
    a segment made before the recording (or dropped from a full history) counts as "(before the history)"."""
    made: dict[int, str] = {}
    for e in _trace(snapshot):
        if e["action"] == "segment_alloc":
            made[e["addr"]] = origin(e.get("frames", []))
    count, size, used = Counter(), Counter(), Counter()
    for seg in snapshot.get("segments", []):
        key = made.get(seg["address"], "(before the history)")
        count[key] += 1
        size[key] += seg["total_size"]
        used[key] += seg["allocated_size"]
    return sorted((Share(k, count[k], size[k], used[k]) for k in size), key=lambda s: -s.bytes)


def peak_by_origin(snapshot: dict) -> tuple[int, list[Share]]:
    """(the allocated peak in bytes over the history, the tensors alive then summed by origin, largest first).
    Replayed from alloc / free_completed events; a tensor allocated before the history is not seen."""
    trace = _trace(snapshot)
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    alive: dict[int, tuple[int, str]] = {}
    for e in trace[:at + 1]:  # again up to the peak, now with origins (costly: only the live ones are kept)
        if e["action"] == "alloc":
            alive[e["addr"]] = (e["size"], origin(e.get("frames", [])))
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    count, size = Counter(), Counter()
    for n, key in alive.values():
        count[key] += 1
        size[key] += n
    return peak, sorted((Share(k, count[k], size[k]) for k in size), key=lambda s: -s.bytes)


def report(snapshot: dict, top: int = 15, max_entries: int = HISTORY_ENTRIES) -> list[str]:
    """Printable lines: the reserved segments and the allocated peak, each by origin (the `top` largest)."""
    reserved = reserved_by_origin(snapshot)
    peak, at_peak = peak_by_origin(snapshot)
    gb = lambda n: f"{n / 1e9:7.3f}"  # noqa: E731
    lines = [f"reserved at the end (the reserved peak): {gb(sum(s.bytes for s in reserved))} GB in "
             f"{sum(s.count for s in reserved)} segments; allocated peak over the history: {gb(peak)} GB"
             + ("" if complete(snapshot, max_entries) else " (history full: its first events were dropped)"),
             f"{'reserved GB':>11} {'in use GB':>9} {'segments':>8}  made by"]
    lines += [f"{gb(s.bytes):>11} {gb(s.used):>9} {s.count:>8}  {s.origin}" for s in reserved[:top]]
    lines += ["tensors alive at the allocated peak:", f"{'GB':>11} {'tensors':>9}  allocated by"]
    lines += [f"{gb(s.bytes):>11} {s.count:>9}  {s.origin}" for s in at_peak[:top]]
    return lines
