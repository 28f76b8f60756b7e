"""CUDA prefill attention (naive, tiled) against a float64 dense reference on the GPU.

Fresh random inputs every run, output poisoned with NaN, lengths that are not tile multiples, GQA 1/4/8,
bf16 and fp16, head_dim 64 and 128, host and HBM pages mixed in random order (spare pages unused), both
host-load forms (cp.async.cg and .ca). The GPU tests skip without CUDA; the argument check runs anywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.prefill_attention import HOST_LOADS, prefill_attention
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.paged import PagedKV
from directkv.kernels.reference import prefill_attention as reference_prefill
from directkv.kernels.reference.fixtures import random_paged_kv

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
BF16, FP16 = torch.bfloat16, torch.float16

# (q_len, past_len, num_heads, num_kv_heads, head_dim, dtype, page_size)
CASES = [
    (1, 0, 4, 4, 64, BF16, 16),
    (7, 1, 8, 2, 128, FP16, 16),
    (65, 1000, 8, 1, 128, BF16, 16),  # GQA 8
    (300, 4097, 32, 8, 128, BF16, 16),  # Llama-3.1-8B heads
    (300, 1000, 8, 2, 64, FP16, 32),
    (65, 4097, 8, 8, 64, FP16, 7),  # page size not a power of two
    (7, 4097, 32, 4, 128, FP16, 16),  # GQA 8
    (1, 1000, 4, 1, 64, BF16, 16),  # GQA 4, one query
]
# (variant, extra kwargs): the planned tiled kernel, and tiled forced to several chunks per split so the
# partial state round-trips through HBM, with one buffer and 4-warp CTAs (two per SM) or two buffers.
RUNS = [
    ("naive", {}),
    ("tiled", {}),
    ("tiled", {"kv_chunk": 128, "num_splits": 3, "double_buffer": False}),
    ("tiled", {"kv_chunk": 64, "num_splits": 2, "double_buffer": True}),
]


def _case_id(case) -> str:
    q_len, past, h, hkv, d, dtype, ps = case
    return f"q{q_len}-past{past}-h{h}x{hkv}-d{d}-{str(dtype)[6:]}-ps{ps}"


def to_gpu(kv: PagedKV) -> PagedKV:
    """The CPU fixture with host pools moved into pinned memory (zero-copy views) and HBM pools to the GPU."""

    def host(t: torch.Tensor) -> torch.Tensor:
        pinned = pinned_empty(t.shape, t.dtype)
        pinned.copy_(t)
        return device_view(pinned)

    return PagedKV(host(kv.host_k), host(kv.host_v), kv.hbm_k.cuda(), kv.hbm_v.cuda(), kv.block_table.cuda(),
                   kv.seq_lens)


def dense_reference(q, k_new, v_new, kv_cpu: PagedKV, *, causal: bool, scale: float) -> torch.Tensor:
    """float64 attention on the GPU over gathered past K/V followed by the new K/V; `[q_len, heads, dim]`."""
    k_past, v_past = kv_cpu.gather(0)
    k = torch.cat([k_past.cuda(), k_new]).double()
    v = torch.cat([v_past.cuda(), v_new]).double()
    q_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        past = k.shape[0] - q_len
        keys = torch.arange(k.shape[0], device=q.device)
        s = s.masked_fill(keys[None, :] > past + torch.arange(q_len, device=q.device)[:, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def make_inputs(case, *, hbm_fraction: float = 0.5):
    q_len, past, num_heads, num_kv_heads, head_dim, dtype, page_size = case
    kv_cpu = random_paged_kv([past], page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                             hbm_fraction=hbm_fraction)
    q = torch.randn(q_len, num_heads, head_dim, device="cuda").to(dtype)
    k_new = torch.randn(q_len, num_kv_heads, head_dim, device="cuda").to(dtype)
    v_new = torch.randn(q_len, num_kv_heads, head_dim, device="cuda").to(dtype)
    return q, k_new, v_new, kv_cpu, to_gpu(kv_cpu)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant,kwargs", RUNS, ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()) or "auto")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_matches_float64_reference(case, variant, kwargs, host_load):
    q, k_new, v_new, kv_cpu, kv = make_inputs(case)
    out = torch.full_like(q, math.nan)
    got, traffic = prefill_attention(q, k_new, v_new, kv, variant=variant, out=out, host_load=host_load, **kwargs)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "unwritten or NaN output elements"
    ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
    assert rel_err(out, ref) < TOL[q.dtype]

    # The closed form must describe the same schedule as the reference backend at the kernel's tiles.
    group = q.shape[1] // k_new.shape[1]
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    tiles = {"tile_q": 64 // group} if variant == "naive" else {"tile_kv": traffic_tile_kv(case, kwargs)}
    _, ref_traffic = reference_prefill(meta(q), meta(k_new), meta(v_new), kv_cpu, variant=variant, compute=False, **tiles)
    assert traffic.link_read_bytes == ref_traffic.link_read_bytes
    assert traffic.flops == ref_traffic.flops


def traffic_tile_kv(case, kwargs) -> int:
    """The stationary chunk the tiled wrapper planned (its Traffic is stated at tile_kv = kv_chunk)."""
    from directkv.kernels.cuda.prefill_attention import _device_limits, plan_tiled

    q_len, past, num_heads, num_kv_heads, head_dim, dtype, _ = case
    sms, smem = _device_limits(torch.cuda.current_device())
    plan = plan_tiled(past + q_len, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=2,
                      part_bytes_per_split=q_len * num_heads * (head_dim + 2) * 4, sms=sms, smem_optin=smem,
                      kv_chunk=kwargs.get("kv_chunk"), num_splits=kwargs.get("num_splits"),
                      double_buffer=kwargs.get("double_buffer", False))
    return plan.kv_chunk


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant", ["naive", "tiled"])
def test_prefill_non_causal_and_scale(variant, host_load):
    case = (65, 1000, 8, 2, 128, BF16, 16)
    q, k_new, v_new, kv_cpu, kv = make_inputs(case)
    out = torch.full_like(q, math.nan)
    prefill_attention(q, k_new, v_new, kv, variant=variant, causal=False, sm_scale=0.05, out=out, host_load=host_load)
    ref = dense_reference(q, k_new, v_new, kv_cpu, causal=False, scale=0.05)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[q.dtype]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
def test_prefill_pinned_cpu_pools_and_all_hbm_pages(host_load):
    """Host pools given as pinned CPU tensors (UVA pointers) and a cache whose pages are all in HBM."""
    for fraction in (0.0, 1.0):
        q, k_new, v_new, kv_cpu, kv = make_inputs((33, 700, 8, 2, 64, FP16, 16), hbm_fraction=fraction)
        pinned = PagedKV(kv.host_k.cpu().pin_memory(), kv.host_v.cpu().pin_memory(), kv.hbm_k, kv.hbm_v,
                         kv_cpu.block_table, kv_cpu.seq_lens)
        ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / 8)
        for variant in ("naive", "tiled"):
            out = torch.full_like(q, math.nan)
            prefill_attention(q, k_new, v_new, pinned, variant=variant, out=out, host_load=host_load)
            assert not out.isnan().any()
            assert rel_err(out, ref) < TOL[q.dtype]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
def test_prefill_sees_host_pages_rewritten_between_launches(host_load):
    """Pages rewritten in place between two calls: the second call must read the new bytes (an L1 line
    cached by the first launch must not survive into the next one)."""
    q, k_new, v_new, kv_cpu, kv = make_inputs((65, 1000, 8, 2, 128, BF16, 16), hbm_fraction=0.0)
    for rewrite in (False, True):
        if rewrite:
            for cpu, view in ((kv_cpu.host_k, kv.host_k), (kv_cpu.host_v, kv.host_v)):
                cpu.copy_(torch.randn(cpu.shape).to(q.dtype))
                view.copy_(cpu)  # into the pinned bytes the kernel reads through the zero-copy view
            torch.cuda.synchronize()
        out = torch.full_like(q, math.nan)
        prefill_attention(q, k_new, v_new, kv, variant="tiled", out=out, host_load=host_load)
        ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
        assert not out.isnan().any()
        assert rel_err(out, ref) < TOL[q.dtype]


def test_prefill_rejects_bad_host_load_before_touching_cuda():
    """Runs without a GPU: host_load is checked first, and a valid value passes on to the device checks."""
    q = torch.randn(7, 4, 64).to(BF16)
    k_new = torch.randn(7, 2, 64).to(BF16)
    kv = random_paged_kv([100], page_size=16, num_kv_heads=2, head_dim=64, dtype=BF16)
    with pytest.raises(ConfigError, match=r"host_load 'lru'; valid: ca, cg"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", host_load="lru")
    with pytest.raises(ConfigError, match="CUDA tensor"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", host_load="ca")


@pytest.mark.gpu
@needs_cuda
def test_prefill_rejects_bad_arguments():
    q, k_new, v_new, _, kv = make_inputs((7, 100, 4, 2, 64, BF16, 16))
    with pytest.raises(ConfigError, match="variant"):
        prefill_attention(q, k_new, v_new, kv, variant="fused")
    with pytest.raises(ConfigError, match="tile_q"):
        prefill_attention(q, k_new, v_new, kv, variant="naive", tile_q=32)
    with pytest.raises(ConfigError, match="kv_chunk"):
        prefill_attention(q, k_new, v_new, kv, variant="tiled", kv_chunk=100)
    with pytest.raises(ConfigError, match="k_new"):
        prefill_attention(q, k_new[:, :1], v_new, kv, variant="tiled")
