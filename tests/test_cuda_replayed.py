"""capture.replayed, the benchmarks' `:graph` rows: a stream call captured into a CUDA graph at the first call,
its outputs poisoned after the capture's eager warm-up, then replayed. Each call's result must be the replay's
and must follow inputs rewritten in place. The prefill stream variant's copies (many page runs, batched where
CUDA allows it eagerly) become plain copy nodes under capture. The GPU tests skip without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from test_cuda_gemm import host_b
from test_cuda_prefill import BF16, assert_matches, dense_reference, make_inputs, page_bytes_of

from directkv.kernels.cuda.capture import replayed
from directkv.kernels.cuda.gemm_case_study import gemm
from directkv.kernels.cuda.prefill_attention import PASS_KERNELS, prefill_attention
from directkv.kernels.cuda.prefill_stream import plan_prefill_stream

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pass_kernel", PASS_KERNELS)
def test_prefill_stream_replays_follow_new_queries(pass_kernel):
    q, k_new, v_new, kv_cpu, kv = make_inputs((77, 1001, 8, 2, 128, BF16, 16), hbm_fraction=0.25)
    plan = plan_prefill_stream(kv, chunk_bytes=3 * page_bytes_of(kv_cpu))
    assert sum(p.ring for p in plan.passes) >= 3  # more ring chunks than slots: the ring is reused in the graph
    out = torch.full_like(q, math.nan)
    poisoned = []

    def poison() -> None:
        out.fill_(math.nan)
        poisoned.append(1)

    call = replayed(lambda: prefill_attention(q, k_new, v_new, kv, variant="stream", out=out, stream_plan=plan,
                                              pass_kernel=pass_kernel), poison)
    for _ in range(3):
        ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
        result, _ = call()
        torch.cuda.synchronize()
        assert result.data_ptr() == out.data_ptr()
        assert_matches(out, ref)
        # same addresses, new values: the queries, and the past's pages in host memory (written through the
        # zero-copy views on the stream, and in the CPU fixture the reference reads); the next replay's copy
        # nodes must read the new pages
        q.copy_(torch.randn_like(q))
        for view, cpu in ((kv.host_k, kv_cpu.host_k), (kv.host_v, kv_cpu.host_v)):
            new = torch.randn(cpu.shape, dtype=cpu.dtype)
            cpu.copy_(new)
            view.copy_(new.to(view.device))
        torch.cuda.synchronize()
        out.fill_(math.nan)
    assert poisoned == [1]  # once, between the capture and the first replay


@pytest.mark.gpu
@needs_cuda
def test_prefill_eager_calls_after_a_capture_still_match():
    """Eager calls after a capture of the same call still match (the capture issued its copies one by one; whether
    the eager calls still batch theirs is not visible from here, only that they are right)."""
    q, k_new, v_new, kv_cpu, kv = make_inputs((40, 700, 8, 2, 128, BF16, 16), hbm_fraction=0.0)
    plan = plan_prefill_stream(kv, chunk_bytes=2 * page_bytes_of(kv_cpu))
    out = torch.full_like(q, math.nan)
    replayed(lambda: prefill_attention(q, k_new, v_new, kv, variant="stream", out=out, stream_plan=plan),
             lambda: out.fill_(math.nan))()
    ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
    for _ in range(2):
        out.fill_(math.nan)
        prefill_attention(q, k_new, v_new, kv, variant="stream", out=out, stream_plan=plan)
        torch.cuda.synchronize()
        assert_matches(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_gemm_first_call_returns_the_replays_product():
    a = torch.randn(333, 517, device="cuda").half()
    b = host_b(517, 1000)
    out = torch.empty(333, 1000, dtype=torch.float16, device="cuda")
    call = replayed(lambda: gemm(a, b, out=out, variant="stream", panel=96), lambda: out.fill_(math.nan))
    for _ in range(2):
        c, _ = call()
        torch.cuda.synchronize()
        ref = a.double() @ b.double()
        assert not c.isnan().any() and float((c.double() - ref).norm() / ref.norm()) < 5e-3
        b.copy_(torch.randn(517, 1000, device="cuda").half())


def test_a_graph_row_whose_replay_writes_nothing_fails_its_check(monkeypatch):
    """The benchmark's check is the replay's: a capture whose eager warm-up writes the right product but whose
    replay writes nothing leaves the poisoned output, and the row fails (CPU stand-in for the graph)."""
    import directkv.kernels.cuda.capture as capture
    from directkv.kernels.cuda import bench_gemm
    from directkv.kernels.traffic import Traffic

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    out = torch.empty(8, 8)

    def product():
        torch.matmul(a, b, out=out)
        return out, Traffic()

    monkeypatch.setattr(capture, "cuda_capture", lambda fn, pool: (lambda: None, fn()))  # a replay that does nothing
    row = {"variant": "stream:graph"}
    with pytest.raises(ValueError, match=r"rel\. error nan against cuBLAS in HBM exceeds 0\.005: wrong product"):
        bench_gemm._measure(capture.replayed(product, lambda: out.fill_(math.nan)), row, (a @ b).double(), out,
                            warmup=0, repeats=1)
