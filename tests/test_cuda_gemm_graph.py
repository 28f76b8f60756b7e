"""capture_gemm: GEMM calls captured into a CUDA graph, replayed against a float64 product on the GPU.

Each replay must write all of `out` (poisoned with NaN before it) and must read the current contents of a and
B (rewritten in place between replays), for the stream forms (column panels, row panels, B stored in panels,
SM copies) and for two kernels. The GPU tests skip without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.gemm_case_study import HostPanels, gemm, host_panels
from directkv.kernels.cuda.gemm_graph import capture_gemm
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = {  # id -> (gemm options, where B is)
    "stream-n": ({"variant": "stream", "panel": 96}, "zero_copy"),
    "stream-k": ({"variant": "stream", "split": "k", "panel": 96}, "zero_copy"),
    "stream-panels": ({"variant": "stream"}, "panels"),
    "stream-sm": ({"variant": "stream", "copy": "sm", "panel": 96}, "zero_copy"),
    "stream-2ce": ({"variant": "stream", "copy_streams": 2, "panel": 96}, "zero_copy"),
    "tiled": ({"variant": "tiled"}, "zero_copy"),
    "naive": ({"variant": "naive"}, "zero_copy"),
}


def place_b(values: torch.Tensor, kind: str) -> torch.Tensor | HostPanels:
    if kind == "panels":
        return host_panels(values, panel_cols=128)
    pinned = pinned_empty(tuple(values.shape), torch.float16)
    pinned.copy_(values)
    return device_view(pinned)


def rewrite_b(b: torch.Tensor | HostPanels, values: torch.Tensor) -> None:
    """New contents at the same addresses the graph was captured with."""
    if isinstance(b, HostPanels):
        b.data.copy_(host_panels(values, panel_cols=b.panel_cols).data)
    else:
        b.copy_(values)


def replay_and_check(graph, a: torch.Tensor, b_values: torch.Tensor) -> None:
    graph.out.fill_(math.nan)
    c, _ = graph()
    torch.cuda.synchronize()
    assert c.data_ptr() == graph.out.data_ptr()
    assert not c.isnan().any(), "unwritten or NaN output elements after a replay"
    ref = a.double() @ b_values.double()
    assert float((c.double() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", [(1000, 777, 1111), (333, 1000, 517)], ids=lambda s: "x".join(map(str, s)))
def test_replays_write_out_and_read_current_inputs(case, shape):
    options, kind = CASES[case]
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").half()
    b_values = torch.randn(k, n, device="cuda").half()
    b = place_b(b_values, kind)
    graph = capture_gemm(a, b, **options)
    assert graph.out.shape == (m, n) and graph.out.dtype == torch.float16
    replay_and_check(graph, a, b_values)
    a.copy_(torch.randn(m, k, device="cuda").half())  # same addresses, new values
    b_values = torch.randn(k, n, device="cuda").half()
    rewrite_b(b, b_values)
    torch.cuda.synchronize()  # rewrite_b of HostPanels is a host-side copy
    replay_and_check(graph, a, b_values)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["stream-n", "stream-k", "stream-sm"])
def test_back_to_back_replays_follow_inputs_written_in_stream_order(case):
    """Two replays with no host sync between them, A and B rewritten on the stream in between and the first
    product copied aside on the stream. CUDA runs two graph launches on one stream in order; this checks that the
    graph's copies read B where the stream left it (its copy nodes are ordered after the graph's start) and that
    each replay writes all of C, not only what a single replay check sees."""
    options, _ = CASES[case]
    m, n, k = 2000, 1000, 1536
    a1, a2 = torch.randn(m, k, device="cuda").half(), torch.randn(m, k, device="cuda").half()
    b1, b2 = torch.randn(k, n, device="cuda").half(), torch.randn(k, n, device="cuda").half()
    a = a1.clone()
    b = place_b(b1, "zero_copy")  # a zero-copy view: b.copy_ below runs on the current stream
    graph = capture_gemm(a, b, **options)
    first = torch.full_like(graph.out, math.nan)
    graph()
    first.copy_(graph.out)
    a.copy_(a2)
    b.copy_(b2)
    graph.out.fill_(math.nan)
    graph()
    torch.cuda.synchronize()
    for got, (x, y) in ((first, (a1, b1)), (graph.out, (a2, b2))):
        ref = x.double() @ y.double()
        assert not got.isnan().any(), "unwritten or NaN output elements"
        assert float((got.double() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.gpu
@needs_cuda
def test_capture_writes_into_a_given_fp32_out():
    a = torch.randn(300, 520, device="cuda").half()
    b_values = torch.randn(520, 640, device="cuda").half()
    out = torch.full((300, 640), math.nan, dtype=torch.float32, device="cuda")
    graph = capture_gemm(a, place_b(b_values, "zero_copy"), out=out, variant="stream", panel=128)
    assert graph.out is out
    replay_and_check(graph, a, b_values)


@pytest.mark.gpu
@needs_cuda
def test_a_failure_inside_the_capture_leaves_the_stream_usable(monkeypatch):
    """The warm-up call succeeds and the captured one raises after its side stream has forked and copied a panel
    (its second cuBLAS call): the caller sees that error, not the unjoined capture's, its current stream is
    restored, and captures and eager calls after it work."""
    a = torch.randn(256, 512, device="cuda").half()
    b = place_b(torch.randn(512, 640, device="cuda").half(), "zero_copy")
    panels = -(-640 // 128)
    mm, calls = torch.mm, []

    def failing_mm(*args, **kwargs):
        calls.append(1)
        if len(calls) == panels + 2:  # the capture's second panel: the side stream is forked, not yet joined
            raise torch.cuda.OutOfMemoryError("out of memory inside the capture")
        return mm(*args, **kwargs)

    before = torch.cuda.current_stream()
    monkeypatch.setattr(torch, "mm", failing_mm)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory inside the capture"):
        capture_gemm(a, b, variant="stream", panel=128)
    monkeypatch.undo()
    assert torch.cuda.current_stream() == before
    replay_and_check(capture_gemm(a, b, variant="stream", panel=128), a, b)
    c, _ = gemm(a, b, variant="stream", panel=128)
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    assert float((c.double() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.gpu
@needs_cuda
def test_bad_options_fail_before_capture_with_gemms_message():
    a = torch.randn(64, 64, device="cuda").half()
    b = place_b(torch.randn(64, 64, device="cuda").half(), "zero_copy")
    with pytest.raises(ConfigError, match="gemm variant 'bogus'"):
        capture_gemm(a, b, variant="bogus")
    # the warm-up call raised, before any capture began; a capture after it works
    replay_and_check(capture_gemm(a, b, variant="stream"), a, b)


def test_refuses_a_cpu_tensor_with_one_line():
    with pytest.raises(ConfigError, match="capture_gemm needs a CUDA tensor a; got cpu"):
        capture_gemm(torch.zeros(4, 4, dtype=torch.float16), torch.zeros(4, 4, dtype=torch.float16), variant="stream")
