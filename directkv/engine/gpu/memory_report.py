"""What holds a serving run's GPU memory, by the code that allocated it (the profiler's --memory).

The results' `gpu_mem_gb` is torch's reserved peak: the caching allocator's segments (its cudaMalloc calls), kept
until an allocation at the memory cap makes it free cached ones. `gpu_peak_allocated_gb` is the most its tensors held
at once. The gap between the two is segment space no tensor used at that moment. With the allocator's history
recorded (Python stacks of the allocations, for the whole run) this module sums both by origin, the innermost frame
in the directkv package (else the innermost frame outside torch):

* reserved_by_origin: the segments alive at the reserved peak, replayed from the history, each charged to the
  allocation that made torch cudaMalloc (or map) it; segments made before the history count as alive throughout;
* peak_by_origin: the tensors alive at the active peak, replayed from the history: sizes as requested (torch's
  allocated counter counts them rounded to its blocks) and freed when torch completed the free (a block used by
  another stream is freed after that stream's work), so it is close to, not equal to, `gpu_peak_allocated_gb`.

H200, 2026-12-03, OPT-13B 3 x 32K: folding the prefill stream's passes took 0.49 GB off the allocated peak but only
0.17 GB off the reserved one; this is the tool that says which segments keep the rest. Recording stacks slows every
allocation, so a recorded run's step times are not comparable with others.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

# allocator events kept (a ring: a longer run loses its first ones, and the report says so); each holds a stack of
# a few KB, so this is a few hundred MB of host memory at most (an OPT-13B 3 x 32K run makes ~10^5)
HISTORY_ENTRIES = 400_000
PACKAGE_DIR = str(Path(__file__).resolve().parents[2]) + "/"  # .../directkv/, this package wherever it lies
SEGMENT_MADE = ("segment_alloc", "segment_map")  # segment_map / _unmap: expandable segments' ranges
SEGMENT_GONE = ("segment_free", "segment_unmap")


def start_recording(max_entries: int = HISTORY_ENTRIES) -> None:
    """Record the caching allocator's history from now on (current CUDA device), with the Python stacks of
    allocations only (a free's stack is never read)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)


def stop_recording() -> dict:
    """The allocator's snapshot (segments and history, torch.cuda.memory._snapshot's dict); recording stops."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def discard() -> None:
    """Stop recording without a snapshot, raising nothing: for a run that failed, whose error must show."""
    with contextlib.suppress(Exception):
        torch.cuda.memory._record_memory_history(enabled=None)


def origin(frames: list[dict]) -> str:
    """"path:line function" of the innermost frame in this package (frames come innermost first, as torch records
    them), else of the innermost frame outside torch; "(no stack)" without frames."""
    def fmt(f: dict) -> str:
        name = f["filename"]
        name = "directkv/" + name[len(PACKAGE_DIR):] if name.startswith(PACKAGE_DIR) else name.rsplit("/", 1)[-1]
        return f"{name}:{f['line']} {f['name']}"
    ours = [f for f in frames if f["filename"].startswith(PACKAGE_DIR)]
    if ours:
        return fmt(ours[0])
    outside = [f for f in frames if "/torch/" not in f["filename"] and f["filename"].endswith(".py")]
    return fmt(outside[0]) if outside else "(no stack)"


@dataclass(frozen=True)
class Share:
    origin: str
    count: int  # segments (reserved_by_origin) or tensors (peak_by_origin)
    bytes: int


def _trace(snapshot: dict) -> list[dict]:
    traces = snapshot.get("device_traces") or [[]]
    return max(traces, key=len)  # the recorded device's (others are empty)


def complete(snapshot: dict, max_entries: int = HISTORY_ENTRIES) -> bool:
    """Whether the history holds the whole recording (a full ring may have dropped its first events)."""
    return len(_trace(snapshot)) < max_entries


def _replay(trace: list[dict], made: tuple, gone: tuple, base: int = 0) -> tuple[int, dict[int, tuple[int, str]]]:
    """(the peak of bytes alive, what was alive then: address -> (bytes, origin)) over the events `made` and `gone`,
    from `base` bytes alive before the history; one pass for the peak, one with origins up to it."""
    live, total, peak, at = {}, base, base, -1
    for i, e in enumerate(trace):
        if e["action"] in made:
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] in gone and e["addr"] in live:
            total -= live.pop(e["addr"])
    alive: dict[int, tuple[int, str]] = {}
    for e in trace[:at + 1]:  # origins only now: formatting every event's stack would cost the most
        if e["action"] in made:
            alive[e["addr"]] = (e["size"], origin(e.get("frames", [])))
        elif e["action"] in gone:
            alive.pop(e["addr"], None)
    return peak, alive


def _shares(alive) -> list[Share]:
    count, size = Counter(), Counter()
    for n, key in alive:
        count[key] += 1
        size[key] += n
    return sorted((Share(k, count[k], size[k]) for k in size), key=lambda s: -s.bytes)


def reserved_by_origin(snapshot: dict) -> tuple[int, list[Share], int]:
    """(the reserved peak in bytes, the segments alive then summed by the origin of the allocation that made each,
    largest first, how many segments the history saw freed). Segments alive at the end that the history did not
    see made (made before it, or dropped from a full one) count as "(before the history)", alive throughout."""
    trace = _trace(snapshot)
    seen = {e["addr"] for e in trace if e["action"] in SEGMENT_MADE}
    before = [seg["total_size"] for seg in snapshot.get("segments", []) if seg["address"] not in seen]
    peak, alive = _replay(trace, SEGMENT_MADE, SEGMENT_GONE, sum(before))
    freed = sum(e["action"] in SEGMENT_GONE for e in trace)
    return peak, _shares([*alive.values(), *((n, "(before the history)") for n in before)]), freed


def peak_by_origin(snapshot: dict) -> tuple[int, list[Share]]:
    """(the active peak in bytes over the history (module docstring), the tensors alive then summed by origin,
    largest first). A tensor allocated before the history is not seen."""
    peak, alive = _replay(_trace(snapshot), ("alloc",), ("free_completed",))
    return peak, _shares(alive.values())


def report(snapshot: dict, top: int = 15, max_entries: int = HISTORY_ENTRIES) -> list[str]:
    """Printable lines: the reserved segments at the reserved peak and the tensors at the active peak, each by
    origin (the `top` largest)."""
    reserved, segments, freed = reserved_by_origin(snapshot)
    peak, at_peak = peak_by_origin(snapshot)
    end = snapshot.get("segments", [])
    gb = lambda n: f"{n / 1e9:7.3f}"  # noqa: E731
    lines = [f"reserved peak {gb(reserved).strip()} GB in {sum(s.count for s in segments)} segments ({freed} segments "
             f"freed in the run); at the end {gb(sum(x['total_size'] for x in end)).strip()} GB reserved, "
             f"{gb(sum(x['allocated_size'] for x in end)).strip()} GB allocated; active peak {gb(peak).strip()} GB"
             + ("" if complete(snapshot, max_entries) else " (history full: its first events were dropped)"),
             f"{'GB':>11} {'segments':>9}  made by (at the reserved peak)"]
    lines += [f"{gb(s.bytes):>11} {s.count:>9}  {s.origin}" for s in segments[:top]]
    lines += [f"{'GB':>11} {'tensors':>9}  allocated by (at the active peak)"]
    lines += [f"{gb(s.bytes):>11} {s.count:>9}  {s.origin}" for s in at_peak[:top]]
    return lines
