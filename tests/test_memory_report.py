"""memory_report (the profiler's --memory): GPU memory summed by the code that allocated it, from the caching
allocator's history. Synthetic snapshots in torch's documented format on the CPU; a real one on a GPU."""

from __future__ import annotations

import pytest
import torch

from directkv.engine.gpu import memory_report as mr

PKG = mr.PACKAGE_DIR  # frames of this package, wherever it is installed
RING = [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 9, "name": "pad"},
        {"filename": PKG + "kernels/cuda/prefill_stream.py", "line": 120, "name": "prefill_ring"},
        {"filename": PKG + "engine/gpu/paths.py", "line": 150, "name": "_plan_streams"}]
PASS = [{"filename": PKG + "kernels/cuda/prefill_attention.py", "line": 470, "name": "_flash_past"}]
TEST = [{"filename": "/usr/lib/python3/site-packages/torch/cuda/memory.py", "line": 1, "name": "f"},
        {"filename": "/home/u/directkv/bench.py", "line": 7, "name": "main"}]  # a checkout named directkv: not ours


def _snapshot() -> dict:
    """A ring segment of 100 made first; a pass segment of 50, freed (the allocator at its cap) and made again as
    40; one segment of 7 from before the history. Reserved: 7 + 100 + 50 = 157 at its peak, 147 at the end. The
    tensors: the ring's 60 for good, two passes of 20 and 25 freed after the peak (105), a pass of 30 after them
    (90 then)."""
    trace = [
        {"action": "segment_alloc", "addr": 1000, "size": 100, "frames": RING},
        {"action": "alloc", "addr": 1000, "size": 60, "frames": RING},
        {"action": "segment_alloc", "addr": 2000, "size": 50, "frames": PASS},
        {"action": "alloc", "addr": 2000, "size": 20, "frames": PASS},
        {"action": "alloc", "addr": 2020, "size": 25, "frames": PASS},
        {"action": "free_requested", "addr": 2000, "size": 20, "frames": PASS},
        {"action": "free_completed", "addr": 2000, "size": 20, "frames": PASS},
        {"action": "free_completed", "addr": 2020, "size": 25, "frames": PASS},
        {"action": "segment_free", "addr": 2000, "size": 50, "frames": []},
        {"action": "segment_alloc", "addr": 3000, "size": 40, "frames": PASS},
        {"action": "alloc", "addr": 3000, "size": 30, "frames": PASS},
        {"action": "free_completed", "addr": 3000, "size": 30, "frames": PASS},
    ]
    segments = [{"address": 1000, "total_size": 100, "allocated_size": 60},
                {"address": 3000, "total_size": 40, "allocated_size": 0},
                {"address": 500, "total_size": 7, "allocated_size": 7}]
    return {"segments": segments, "device_traces": [[], trace]}


def test_origin_is_the_innermost_frame_of_the_package_else_outside_torch():
    assert mr.origin(RING) == "directkv/kernels/cuda/prefill_stream.py:120 prefill_ring"
    assert mr.origin(TEST) == "bench.py:7 main"
    assert mr.origin([]) == mr.origin(TEST[:1]) == "(no stack)"


def test_reserved_peak_replayed_with_the_segments_alive_then():
    peak, shares, freed = mr.reserved_by_origin(_snapshot())
    assert (peak, freed) == (157, 1)
    assert [(s.origin.split(" ")[0], s.count, s.bytes) for s in shares] == [
        ("directkv/kernels/cuda/prefill_stream.py:120", 1, 100),
        ("directkv/kernels/cuda/prefill_attention.py:470", 1, 50),
        ("(before", 1, 7)]


def test_the_active_peak_and_what_was_alive_then():
    peak, shares = mr.peak_by_origin(_snapshot())
    assert peak == 105  # the ring's 60 and two passes; the later single pass made only 90
    assert [(s.origin.split(" ")[0], s.count, s.bytes) for s in shares] == [
        ("directkv/kernels/cuda/prefill_stream.py:120", 1, 60),
        ("directkv/kernels/cuda/prefill_attention.py:470", 2, 45)]


def test_report_lines_and_a_full_history_said():
    snap = _snapshot()
    lines = mr.report(snap, top=2)
    assert lines[0].startswith("reserved peak 0.000 GB in 3 segments (1 segments freed in the run)")
    assert "dropped" not in lines[0] and "prefill_stream.py:120 prefill_ring" in lines[2]
    assert "(before the history)" not in "\n".join(lines)  # the top 2 only
    assert "dropped" in mr.report(snap, max_entries=len(snap["device_traces"][1]))[0]


def test_profile_memory_refuses_a_cpu_run(capsys):
    from directkv.engine.gpu.profile import main

    assert main(["--system", "swap", "--memory", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--memory reads the CUDA caching allocator's history: it needs the run on a CUDA GPU" in err


def test_profile_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from directkv.engine.gpu.profile import main

    assert main(["--system", "swap", "--device", "cuda"]) == 2
    assert "device=cuda but no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_history_names_this_file():
    """torch's own snapshot format (the device's torch may differ from this one): a tensor larger than all the free
    space in torch's cache (so no cached segment can serve it) shows in a segment made for it and among the
    tensors at the active peak, charged to this test."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    size = torch.cuda.memory_reserved() - torch.cuda.memory_allocated() + (48 << 20)
    mr.start_recording()
    try:
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        del x
    finally:
        snap = mr.stop_recording()
    here = "test_memory_report.py"
    peak, alive = mr.peak_by_origin(snap)
    assert peak >= size and any(here in s.origin and s.bytes >= size for s in alive)
    _, segments, _ = mr.reserved_by_origin(snap)
    assert any(here in s.origin and s.bytes >= size for s in segments)
    assert mr.report(snap)[0].startswith("reserved peak")
