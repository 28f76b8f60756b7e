"""executor.hbm_prefill=sdpa: a prompt chunk over HBM pages gathered into contiguous K/V and attended by torch SDPA.
Checked on the CPU against a float64 reference (shuffled pages, pasts that end inside a page, GQA 1 / 4 / 8, the
pool's unused pages poisoned), in serving against the tiled kernel's outputs, and as a config value; on a GPU
against float64 with the kernel that ran read from the profiler (FlashAttention only; the case of a chunk with no
past and the profiler check were added after the last GPU run, 2026-12-02)."""

import math

import pytest
import torch
from test_experiments import _compose
from test_gpu_executor import _requests, _serve, runner  # noqa: F401 - runner is a fixture

import directkv.engine.gpu.paths as paths
from directkv.engine.gpu.hbm_prefill import gather_past, sdpa_chunk
from directkv.engine.systems import SystemPolicy
from directkv.errors import ConfigError
from experiments.common import setup


def _reference(q, k, v, past):
    """float64 causal attention of q `[n, H, D]` over k / v `[past + n, Hkv, D]`, token i seeing past + i + 1 keys."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    keys = torch.arange(k.shape[0])
    s = s.masked_fill(keys[None, :] > past + torch.arange(q.shape[0])[:, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("past,new", [(0, 7), (37, 5), (64, 33), (101, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_chunk_matches_float64_over_shuffled_pages(group, past, new, dtype):
    torch.manual_seed(past * 10 + new + group)
    ps, hkv, d = 16, 2, 32
    pages = -(-(past + new) // ps)
    pool_pages = pages + 5
    k_pool = torch.full((pool_pages, ps, hkv, d), math.nan, dtype=dtype)
    v_pool = torch.full_like(k_pool, math.nan)
    order = torch.randperm(pool_pages)[:pages]  # the sequence's pages, shuffled over a larger pool
    k_all = torch.randn(past + new, hkv, d).to(dtype)
    v_all = torch.randn(past + new, hkv, d).to(dtype)
    for j, page in enumerate(order.tolist()):
        n = min(ps, past + new - j * ps)
        k_pool[page, :n], v_pool[page, :n] = k_all[j * ps : j * ps + n], v_all[j * ps : j * ps + n]
    table = (-(order + 1)).to(torch.int32)
    assert torch.equal(gather_past(k_pool, table, past, ps), k_all[:past])
    q = torch.randn(new, hkv * group, d).to(dtype)
    out = sdpa_chunk(q, k_all[past:], v_all[past:], k_pool, v_pool, table, past, ps)
    assert out.shape == q.shape and not out.isnan().any()
    ref = _reference(q, k_all, v_all, past)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("name", ["hbm", "swap", "cpu_attn", "flexgen"])
def test_serving_with_sdpa_prompt_chunks_matches_the_kernel(runner, name, monkeypatch):  # noqa: F811
    calls = []
    real_chunk = paths.sdpa_chunk
    monkeypatch.setattr(paths, "sdpa_chunk", lambda *a: calls.append(a[6]) or real_chunk(*a))
    reqs = _requests()
    ref_res, ref = _serve(SystemPolicy(name), runner, reqs)
    assert not calls
    res, st = _serve(SystemPolicy(name), runner, reqs, hbm_prefill="sdpa")
    assert calls and any(past > 0 for past in calls)  # chunks with a past went through SDPA
    assert st.outputs == ref.outputs and len(st.outs) == len(ref.outs)
    # flexgen stores each layer's new K/V in 4 bits: a last-bit difference between the two kernels can move a value
    # across a quantisation step, which the next layers carry (seen: 1.2e-3 at most, on 0.8% of the elements)
    tol = dict(rtol=1e-2, atol=5e-3) if name == "flexgen" else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(st.outs, ref.outs, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, **tol)


def test_directkv_host_chunks_never_take_the_sdpa_path(runner, monkeypatch):  # noqa: F811
    # its past is in host memory: gathering it would be a copy, not zero-copy (a chunk with no past has no host
    # pages to gather: executor.directkv_no_past_prefill, default sdpa, sends those to SDPA)
    real_sdpa, sent = paths.sdpa_chunk, []

    def no_host_past(q, k, v, k_pool, v_pool, table, past_len, *rest):
        if past_len:
            pytest.fail(f"a host-tier chunk over {past_len} past tokens went through SDPA")
        sent.append(past_len)
        return real_sdpa(q, k, v, k_pool, v_pool, table, past_len, *rest)

    monkeypatch.setattr(paths, "sdpa_chunk", no_host_past)
    res, _ = _serve(SystemPolicy("directkv", "tiled"), runner, _requests(), hbm_prefill="sdpa")
    assert res.metrics["completed"] == len(_requests()) and sent  # the first chunks did go to SDPA


def test_the_option_is_read_checked_and_recorded():
    assert setup(_compose(["run_id=t", "device=cpu"])).hbm_prefill == "kernel"
    assert setup(_compose(["run_id=t", "device=cpu", "executor.hbm_prefill=sdpa"])).hbm_prefill == "sdpa"
    with pytest.raises(ConfigError, match=r"unknown executor.hbm_prefill 'flash'; valid: kernel, sdpa"):
        setup(_compose(["run_id=t", "device=cpu", "executor.hbm_prefill=flash"]))
    from test_gpu_executor import SCHED, SPEC

    from directkv.engine.gpu.executor import run_gpu
    from directkv.engine.sim_executor import MemoryConfig

    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    _, extra = run_gpu(_requests()[:2], SystemPolicy("swap"), SPEC, mem=mem, sched_cfg=SCHED, device="cpu",
                       hbm_prefill="sdpa")
    assert extra["hbm_prefill"] == "sdpa"
    with pytest.raises(ConfigError, match=r"unknown executor.hbm_prefill 'x'; valid: kernel, sdpa"):
        run_gpu(_requests()[:2], SystemPolicy("swap"), SPEC, mem=mem, sched_cfg=SCHED, device="cpu", hbm_prefill="x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("past", [0, 1001])
def test_sdpa_chunk_on_the_gpu_runs_flash_and_matches_float64(group, dtype, past):
    """Llama-3.1-8B-like heads (8 KV heads, head_dim 128), 77 new tokens over 0 or 1,001 past tokens in shuffled
    pages: the call runs torch's FlashAttention kernel and no other attention kernel (a chunk with no past had gone
    to cuDNN attention, whose per-shape plans stalled the host on ShareGPT), and matches float64."""
    torch.manual_seed(group)
    ps, hkv, d, new = 16, 8, 128, 77
    pages = -(-(past + new) // ps)
    order = torch.randperm(pages + 9)[:pages]
    k_all, v_all = (torch.randn(past + new, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    k_pool, v_pool = (torch.full((pages + 9, ps, hkv, d), math.nan, dtype=dtype, device="cuda") for _ in range(2))
    for j, page in enumerate(order.tolist()):
        n = min(ps, past + new - j * ps)
        k_pool[page, :n], v_pool[page, :n] = k_all[j * ps : j * ps + n], v_all[j * ps : j * ps + n]
    table = (-(order + 1)).to(torch.int32).cuda()
    q = torch.randn(new, hkv * group, d, dtype=dtype, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = sdpa_chunk(q, k_all[past:], v_all[past:], k_pool, v_pool, table, past, ps)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("flash" in n.lower() and "cudnn" not in n.lower() for n in kernels), kernels
    assert not any("cudnn" in n.lower() or "efficient" in n.lower() or "fmha" in n.lower() for n in kernels), kernels
    ref = _reference(q.cpu(), k_all.cpu(), v_all.cpu(), past)
    assert not out.isnan().any() and float((out.cpu().double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["hbm", "cpu_attn", "flexgen"])
def test_the_other_hbm_page_systems_serve_with_sdpa_on_the_gpu(name, monkeypatch):
    from test_gpu_executor import SCHED, SPEC

    from directkv.engine.gpu.executor import run_gpu
    from directkv.engine.sim_executor import MemoryConfig

    calls = []
    real_chunk = paths.sdpa_chunk
    monkeypatch.setattr(paths, "sdpa_chunk", lambda *a: calls.append(a[6]) or real_chunk(*a))
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy(name), SPEC, mem=mem, sched_cfg=SCHED, device="cuda",
                             cuda_graphs=True, hbm_prefill="sdpa")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["hbm_prefill"] == "sdpa"
    assert any(past > 0 for past in calls)  # the option reached the path: chunks with a past went through SDPA


def test_sdpa_chunk_traffic_by_hand():
    from directkv.kernels.traffic_model import sdpa_chunk_traffic

    kv_tok, row = 2 * 8 * 128 * 2, 32 * 128 * 2  # Llama-3.1-8B heads, bf16
    t = sdpa_chunk_traffic(100, 1000, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert t.link_read_bytes == t.link_write_bytes == 0
    # the buffer's fill reads the past and the new K/V and writes them; the call reads Q and every key once, writes O
    assert t.hbm_read_bytes == 1000 * kv_tok + 100 * kv_tok + 1100 * kv_tok + 100 * row
    assert t.hbm_write_bytes == 1100 * kv_tok + 100 * row
    assert t.flops == 4 * 128 * 32 * (100 * 1000 + 100 * 101 // 2)
    first = sdpa_chunk_traffic(100, 0, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert (first.hbm_read_bytes, first.hbm_write_bytes) == (100 * kv_tok + 100 * row, 100 * row)  # no fill
