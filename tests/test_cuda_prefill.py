"""CUDA prefill attention (naive, tiled, stream) against a float64 dense reference on the GPU.

Fresh random inputs every run, output poisoned with NaN, lengths that are not tile multiples, GQA 1/4/8,
bf16 and fp16, head_dim 64 and 128, host and HBM pages mixed in random order (spare pages unused), both
host-load forms (cp.async.cg and .ca). The GPU tests skip without CUDA; the argument checks, the stream
variant's planning (chunk size, passes, ring positions: emulated in float64 on the CPU) and its closed-form
traffic run anywhere.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.prefill_attention import HOST_LOADS, PASS_KERNELS, prefill_attention, traffic
from directkv.kernels.cuda.prefill_stream import (
    STREAM_CHUNK_BYTES,
    STREAM_MIN_CHUNK_BYTES,
    STREAM_SLOTS,
    PrefillStreamPlan,
    plan_prefill_stream,
    prefetch_prefill_stream,
    prefill_ring,
    stream_chunk_pages,
    stream_passes,
)
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.paged import PagedKV
from directkv.kernels.reference import prefill_attention as reference_prefill
from directkv.kernels.reference.fixtures import random_paged_kv
from directkv.kernels.traffic_model import STREAM_RING_BYTES

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
# stream: one ring chunk (these caches are small), then ring chunks of 2 or 3 pages so many chunks cycle
# through the 2-slot ring (chunk_pages is turned into chunk_bytes per case), the last with its passes
# forced to several tiled chunks per split; each with flash passes (the default) and tiled ones. tiled with
# new_pass "flash" attends the new tokens by FlashAttention-2 and the past by the kernel. state_dtype
# "input" keeps the partial O in q's dtype between chunks (forced round trips included). Every case mixes host and HBM pages; the first has past_len 0.
RUNS = [
    ("naive", {}),
    ("tiled", {}),
    ("tiled", {"kv_chunk": 128, "num_splits": 3, "double_buffer": False}),
    ("tiled", {"kv_chunk": 64, "num_splits": 2, "double_buffer": True}),
    ("tiled", {"kv_chunk": 128, "num_splits": 3, "state_dtype": "input"}),
    ("tiled", {"state_dtype": "input"}),
    ("tiled", {"new_pass": "flash"}),
    ("tiled", {"new_pass": "flash", "kv_chunk": 128, "num_splits": 3}),
    ("tiled", {"new_pass": "flash", "kv_chunk": 128, "num_splits": 3, "state_dtype": "input"}),
    ("stream", {}),
    ("stream", {"chunk_pages": 2}),
    ("stream", {"chunk_pages": 3, "kv_chunk": 64, "num_splits": 2, "pass_kernel": "tiled"}),
    ("stream", {"pass_kernel": "tiled"}),
    ("stream", {"chunk_pages": 2, "pass_kernel": "tiled"}),
    ("stream", {"chunk_pages": 2, "pass_kernel": "tiled", "kv_chunk": 64, "num_splits": 2, "state_dtype": "input"}),
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
    k = torch.cat([k_past.to(q.device), k_new]).double()
    v = torch.cat([v_past.to(q.device), v_new]).double()
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


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element written (the output was NaN-poisoned) and within the dtype's tolerance of the reference."""
    assert not out.isnan().any(), "unwritten or NaN output elements"
    assert rel_err(out, ref) < TOL[out.dtype]


def page_bytes_of(kv: PagedKV) -> int:
    return kv.page_size * kv.num_kv_heads * kv.head_dim * kv.host_k.element_size()


def with_chunk_bytes(kwargs: dict, kv: PagedKV) -> dict:
    """RUNS' chunk_pages (a test-only spelling) as the chunk_bytes prefill_attention takes."""
    kwargs = dict(kwargs)
    if "chunk_pages" in kwargs:
        kwargs["chunk_bytes"] = kwargs.pop("chunk_pages") * page_bytes_of(kv)
    return kwargs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant,kwargs", RUNS, ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()) or "auto")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_matches_float64_reference(case, variant, kwargs, host_load):
    q, k_new, v_new, kv_cpu, kv = make_inputs(case)
    out = torch.full_like(q, math.nan)
    got, traffic = prefill_attention(q, k_new, v_new, kv, variant=variant, out=out, host_load=host_load,
                                     **with_chunk_bytes(kwargs, kv_cpu))
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
    assert_matches(out, ref)

    # The closed form must describe the same schedule as the reference backend at the kernel's tiles.
    group = q.shape[1] // k_new.shape[1]
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    tiles = {"tile_q": 64 // group} if variant == "naive" else {"tile_kv": traffic_tile_kv(case, kwargs)}
    ref_variant = "tiled" if variant == "stream" else variant  # stream states tiled's schedule plus the ring
    _, ref_traffic = reference_prefill(meta(q), meta(k_new), meta(v_new), kv_cpu, variant=ref_variant, compute=False,
                                       **tiles)
    assert traffic.link_read_bytes == ref_traffic.link_read_bytes
    assert traffic.flops == ref_traffic.flops
    if variant == "stream":
        assert traffic.hbm_read_bytes == ref_traffic.hbm_read_bytes + ref_traffic.link_read_bytes
        assert traffic.hbm_write_bytes == ref_traffic.hbm_write_bytes + ref_traffic.link_read_bytes


def traffic_tile_kv(case, kwargs) -> int:
    """The stationary chunk the tiled wrapper planned (its Traffic is stated at tile_kv = kv_chunk)."""
    from directkv.kernels.cuda.prefill_attention import device_limits, plan_tiled

    q_len, past, num_heads, num_kv_heads, head_dim, dtype, _ = case
    sms, smem = device_limits(torch.cuda.current_device())
    plan = plan_tiled(past + q_len, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=2,
                      part_bytes_per_split=q_len * num_heads * (head_dim + 2) * 4, sms=sms, smem_optin=smem,
                      kv_chunk=kwargs.get("kv_chunk"), num_splits=kwargs.get("num_splits"),
                      double_buffer=kwargs.get("double_buffer", False))
    return plan.kv_chunk


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant", ["naive", "tiled", "stream"])
def test_prefill_non_causal_and_scale(variant, host_load):
    case = (65, 1000, 8, 2, 128, BF16, 16)
    q, k_new, v_new, kv_cpu, kv = make_inputs(case)
    out = torch.full_like(q, math.nan)
    prefill_attention(q, k_new, v_new, kv, variant=variant, causal=False, sm_scale=0.05, out=out, host_load=host_load)
    ref = dense_reference(q, k_new, v_new, kv_cpu, causal=False, scale=0.05)
    assert_matches(out, ref)


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
        for variant in ("naive", "tiled", "stream"):
            out = torch.full_like(q, math.nan)
            prefill_attention(q, k_new, v_new, pinned, variant=variant, out=out, host_load=host_load)
            assert_matches(out, ref)


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
        assert_matches(out, ref)


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


# ---- stream variant ----


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hbm_fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("past", [0, 1, 16, 1000])
def test_prefill_stream_tiers_and_short_pasts(past, hbm_fraction):
    """Ring only, ring + HBM pass, HBM pass only; an empty past (new-token pass alone), one token, one full
    page. Chunks of one page, so several of them cycle through the ring wherever there are host pages."""
    q, k_new, v_new, kv_cpu, kv = make_inputs((33, past, 8, 2, 64, BF16, 16), hbm_fraction=hbm_fraction)
    ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / 8)
    for chunk_bytes, pass_kernel in itertools.product((None, page_bytes_of(kv_cpu)), PASS_KERNELS):
        out = torch.full_like(q, math.nan)
        prefill_attention(q, k_new, v_new, kv, variant="stream", out=out, chunk_bytes=chunk_bytes,
                          pass_kernel=pass_kernel)
        assert_matches(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_prefill_stream_back_to_back_calls_reuse_the_ring():
    """Two calls queued without a sync between them (the side stream and its events are shared by calls):
    each must read its own pages, not ring bytes of the other call."""
    a = make_inputs((65, 1000, 8, 2, 128, FP16, 16), hbm_fraction=0.25)
    b = make_inputs((65, 1000, 8, 2, 128, FP16, 16), hbm_fraction=0.25)
    outs = []
    for q, k_new, v_new, kv_cpu, kv in (a, b):
        outs.append(torch.full_like(q, math.nan))
        prefill_attention(q, k_new, v_new, kv, variant="stream", out=outs[-1], chunk_bytes=4 * page_bytes_of(kv_cpu))
    for (q, k_new, v_new, kv_cpu, _), out in zip((a, b), outs, strict=True):
        ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
        assert_matches(out, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pass_kernel", PASS_KERNELS)
def test_prefill_stream_plan_reused_across_calls(pass_kernel):
    """One plan_prefill_stream result serves several calls over the same cache (as every layer of a serving
    step does) with fresh queries each time; shuffled pages cut into 3-page chunks, a quarter of them in HBM."""
    q, k_new, v_new, kv_cpu, kv = make_inputs((77, 1001, 8, 2, 128, BF16, 16), hbm_fraction=0.25)
    plan = plan_prefill_stream(kv, chunk_bytes=3 * page_bytes_of(kv_cpu))
    assert plan.past_len == 1001 and plan.chunk_pages == 3 and sum(p.ring for p in plan.passes) >= 2
    for _ in range(3):
        q = torch.randn_like(q)
        ref = dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1]))
        out = torch.full_like(q, math.nan)
        prefill_attention(q, k_new, v_new, kv, variant="stream", out=out, stream_plan=plan, pass_kernel=pass_kernel)
        assert_matches(out, ref)
    other = make_inputs((77, 999, 8, 2, 128, BF16, 16), hbm_fraction=0.25)
    with pytest.raises(ConfigError, match=r"stream_plan was made for past_len 1001; this cache has 999"):
        prefill_attention(*other[:3], other[4], variant="stream", stream_plan=plan)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pass_kernel", PASS_KERNELS)
def test_prefill_stream_ring_kept_across_calls_and_prefetched(pass_kernel):
    """A prefill_ring serves calls over two layers' pools (same table, as in a serving step), each call's first
    chunks copied ahead by prefetch_prefill_stream; a prefetch of the other layer's pools is redone by the call.
    Outputs poisoned, every call against float64."""
    q, k_new, v_new, kv_cpu, kv = make_inputs((77, 1001, 8, 2, 128, BF16, 16), hbm_fraction=0.25)
    other_cpu = PagedKV(torch.randn_like(kv_cpu.host_k.float()).to(BF16), torch.randn_like(kv_cpu.host_v.float()).to(BF16),
                        kv_cpu.hbm_k, kv_cpu.hbm_v, kv_cpu.block_table, kv_cpu.seq_lens)
    layers = {"a": (kv_cpu, kv), "b": (other_cpu, to_gpu(other_cpu))}
    plan = plan_prefill_stream(kv, chunk_bytes=3 * page_bytes_of(kv_cpu))
    ring = prefill_ring(plan, kv.host_k, "cuda")
    assert ring.ring_k.shape[:2] == (2, 3) and ring.nbytes == 4 * 3 * page_bytes_of(kv_cpu)
    for ahead, layer in (("a", "a"), ("b", "b"), ("b", "a"), (None, "b")):
        if ahead is not None:
            assert prefetch_prefill_stream(plan, ring, layers[ahead][1].host_k, layers[ahead][1].host_v) == 2
        cpu, gpu = layers[layer]
        q = torch.randn_like(q)
        out = torch.full_like(q, math.nan)
        prefill_attention(q, k_new, v_new, gpu, variant="stream", out=out, stream_plan=plan, stream_ring=ring,
                          pass_kernel=pass_kernel)
        assert ring.prefetched is None
        assert_matches(out, dense_reference(q, k_new, v_new, cpu, causal=True, scale=1 / math.sqrt(128)))
    two = plan_prefill_stream(kv, chunk_bytes=2 * page_bytes_of(kv_cpu))
    small = prefill_ring(two, kv.host_k, "cuda")
    with pytest.raises(ConfigError, match=r"stream_ring holds 2 pages of \(16, 2, 128\) torch.bfloat16 per slot on "
                                          r"cuda:\d; the plan needs 3 of \(16, 2, 128\) torch.bfloat16"):
        prefill_attention(q, k_new, v_new, kv, variant="stream", stream_plan=plan, stream_ring=small)
    # reuse: a ring with room is kept (and serves a plan of smaller chunks), one without is replaced
    assert prefill_ring(two, kv.host_k, "cuda", reuse=ring) is ring
    out = torch.full_like(q, math.nan)
    prefill_attention(q, k_new, v_new, kv, variant="stream", out=out, stream_plan=two, stream_ring=ring,
                      pass_kernel=pass_kernel)
    assert_matches(out, dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(128)))
    grown = prefill_ring(plan, kv.host_k, "cuda", reuse=small)  # needs 3 > 2: max(3, 2 * 5 // 4)
    assert grown.ring_k.shape[1] == 3 and small.ring_k is None
    eight = prefill_ring(plan_prefill_stream(kv, chunk_bytes=8 * page_bytes_of(kv_cpu)), kv.host_k, "cuda")
    nine = plan_prefill_stream(kv, chunk_bytes=9 * page_bytes_of(kv_cpu))
    assert prefill_ring(nine, kv.host_k, "cuda", reuse=eight).ring_k.shape[1] == 10  # grown by a quarter


def test_prefill_stream_plan_is_refused_with_other_options():
    """Runs without a GPU: a plan belongs to stream and carries the chunking, so the two are not given together."""
    q = torch.randn(7, 4, 64).to(BF16)
    k_new = torch.randn(7, 2, 64).to(BF16)
    kv = random_paged_kv([100], page_size=16, num_kv_heads=2, head_dim=64, dtype=BF16)
    plan = PrefillStreamPlan(past_len=100, chunk_pages=1, page_bytes=1, passes=(), tables=None, runs=())
    with pytest.raises(ConfigError, match=r"stream_plan is an option of variant 'stream' and carries its chunking; "
                                          r"got variant 'tiled' with chunk_bytes=None, min_chunks=1"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", stream_plan=plan)
    with pytest.raises(ConfigError, match=r"got variant 'stream' with chunk_bytes=None, min_chunks=2"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", stream_plan=plan, min_chunks=2)
    with pytest.raises(ConfigError, match=r"stream_ring is an option of variant 'stream' with a stream_plan"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", stream_ring=object())


def test_stream_chunk_pages_caps_the_ring():
    page = 16 * 8 * 128 * 2  # a Llama-3.1-8B page of K: 32 KiB
    assert stream_chunk_pages(10_000, page) == STREAM_CHUNK_BYTES // page  # 16 MiB of K, 16 of V, 2 slots
    for page_bytes in (4096, 7 * 8 * 64 * 2, page, 3 << 20):
        pages = stream_chunk_pages(1 << 20, page_bytes)
        assert pages >= 1 and 2 * STREAM_SLOTS * pages * page_bytes <= STREAM_RING_BYTES
    assert stream_chunk_pages(3, page) == 3  # a small cache: one chunk of just its pages
    assert stream_chunk_pages(0, page) == 1  # no host pages: no chunk, a ring of one page is never used
    assert stream_chunk_pages(10_000, page, chunk_bytes=2 * page + 1) == 2  # whole pages only
    # min_chunks cuts a small cache into that many chunks, not below STREAM_MIN_CHUNK_BYTES
    assert stream_chunk_pages(1024, page, min_chunks=4) == 256
    assert stream_chunk_pages(256, page, min_chunks=4) == STREAM_MIN_CHUNK_BYTES // page
    assert stream_chunk_pages(1024, page, chunk_bytes=8 * page, min_chunks=4) == 8  # chunk_bytes still caps


def test_stream_options_rejected_with_the_allowed_values():
    page = 4096
    with pytest.raises(ConfigError, match=r"chunk_bytes 16777217 must be an int in 1\.\.16777216"):
        stream_chunk_pages(10, page, chunk_bytes=STREAM_CHUNK_BYTES + 1)
    with pytest.raises(ConfigError, match=r"chunk_bytes 4095 holds no KV page of 4096 B; valid: 4096\.\.16777216"):
        stream_chunk_pages(10, page, chunk_bytes=page - 1)
    with pytest.raises(ConfigError, match=r"min_chunks 0 must be an int >= 1"):
        stream_chunk_pages(10, page, min_chunks=0)
    with pytest.raises(ConfigError, match=r"min_chunks 2\.5 must be an int >= 1"):
        stream_chunk_pages(10, page, min_chunks=2.5)


def test_prefill_stream_options_checked_before_touching_cuda():
    """Runs without a GPU: the stream-only options are refused for other variants and checked for stream
    before any tensor is looked at; a valid call passes on to the device checks."""
    q = torch.randn(7, 4, 64).to(BF16)
    k_new = torch.randn(7, 2, 64).to(BF16)
    kv = random_paged_kv([100], page_size=16, num_kv_heads=2, head_dim=64, dtype=BF16)
    with pytest.raises(ConfigError, match=r"options of variant 'stream'; got variant 'tiled' with chunk_bytes=None, "
                       r"min_chunks=4"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", min_chunks=4)
    with pytest.raises(ConfigError, match=r"got variant 'naive' with chunk_bytes=4096"):
        prefill_attention(q, k_new, k_new, kv, variant="naive", chunk_bytes=4096)
    with pytest.raises(ConfigError, match=r"chunk_bytes 67108864 must be an int in 1\.\.16777216"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", chunk_bytes=64 << 20)
    with pytest.raises(ConfigError, match=r"unknown prefill_attention variant 'streaming'; valid: naive, stream, tiled"):
        prefill_attention(q, k_new, k_new, kv, variant="streaming")
    with pytest.raises(ConfigError, match=r"unknown prefill_attention pass_kernel 'sdpa'; valid: flash, tiled"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", pass_kernel="sdpa")
    with pytest.raises(ConfigError, match=r"got variant 'tiled' with pass_kernel='tiled'"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", pass_kernel="tiled")
    with pytest.raises(ConfigError, match=r"unknown prefill_attention state_dtype 'half'; valid: float32, input"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", state_dtype="half")
    with pytest.raises(ConfigError, match=r"got variant 'naive' with state_dtype='input'"):
        prefill_attention(q, k_new, k_new, kv, variant="naive", state_dtype="input")
    with pytest.raises(ConfigError, match=r"unknown prefill_attention new_pass 'sdpa'; valid: flash, kernel"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", new_pass="sdpa")
    with pytest.raises(ConfigError, match=r"new_pass is an option of variant 'tiled'; got variant 'stream'"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", new_pass="flash")
    with pytest.raises(ConfigError, match=r"unknown prefill_attention merge 'sum'; valid: kernel, torch"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", merge="sum")
    with pytest.raises(ConfigError, match=r"merge is an option of variant 'stream'; got variant 'tiled' with "
                       r"merge='torch'"):
        prefill_attention(q, k_new, k_new, kv, variant="tiled", merge="torch")
    with pytest.raises(ConfigError, match="CUDA tensor"):
        prefill_attention(q, k_new, k_new, kv, variant="stream", min_chunks=4)


def _emulated_pass(q, k, v, *, scale, causal_from: int | None):
    """float64 attention of q over keys k / v; returns (O, natural-log LSE) as the kernel's out_f32 / lse_out.
    causal_from: query i sees keys <= i (the new-token pass), None: every key."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal_from is not None:
        keys, rows = torch.arange(k.shape[0]), torch.arange(q.shape[0])
        s = s.masked_fill(keys[None, :] > rows[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)  # [h, q]
    o = torch.einsum("hqk,khd->qhd", (s - lse[..., None]).exp(), v)
    return o, lse.transpose(0, 1)


@pytest.mark.parametrize("hbm_fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_pages", [1, 3, 64])
@pytest.mark.parametrize("past,page_size", [(0, 16), (1, 16), (1000, 16), (999, 7)])
def test_stream_passes_emulated_match_dense_attention(past, page_size, chunk_pages, hbm_fraction):
    """The stream variant's plan run on the CPU: copy each chunk's page runs into a 2-slot ring, gather every
    pass's keys the way the kernel addresses them (entry e < 0: page -(e + 1) of the pass's HBM pool), attend,
    merge the passes by a softmax over their LSEs. Equal to dense attention in float64, with every past token
    in exactly one pass."""
    torch.manual_seed(past + chunk_pages)
    q_len, num_heads, num_kv_heads, head_dim = 9, 4, 2, 8
    kv = random_paged_kv([past], page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         dtype=torch.float64, hbm_fraction=hbm_fraction)
    q = torch.randn(q_len, num_heads, head_dim, dtype=torch.float64)
    k_new = torch.randn(q_len, num_kv_heads, head_dim, dtype=torch.float64)
    v_new = torch.randn(q_len, num_kv_heads, head_dim, dtype=torch.float64)
    passes = stream_passes(kv.block_table, past, page_size, chunk_pages)
    assert sum(p.past_len for p in passes) == past
    host_pages = {int(e) for e in kv.block_table[0, : -(-past // page_size)] if e >= 0}
    ring_passes = [p for p in passes if p.ring]
    assert passes[: len(ring_passes)] == ring_passes  # ring chunks first: the index counts ring slots
    assert len(ring_passes) == -(-len(host_pages) // chunk_pages)
    assert sorted(s + i for p in ring_passes for s, _, n in p.copies.tolist() for i in range(n)) == sorted(host_pages)
    ring_k = torch.full((STREAM_SLOTS, chunk_pages, *kv.host_k.shape[1:]), math.nan, dtype=torch.float64)
    ring_v = ring_k.clone()
    parts = []
    for c, ps in enumerate(passes):
        if ps.ring:
            slot = c % STREAM_SLOTS
            for src, dst, n in ps.copies.tolist():
                assert 0 <= dst and dst + n <= chunk_pages
                ring_k[slot, dst : dst + n] = kv.host_k[src : src + n]
                ring_v[slot, dst : dst + n] = kv.host_v[src : src + n]
            pool_k, pool_v = ring_k[slot], ring_v[slot]
        else:
            pool_k, pool_v = kv.hbm_k, kv.hbm_v
        rows = []
        for j in range(ps.past_len):  # the kernel's kv_rows: every entry of a pass is an HBM-style entry
            e = int(ps.table[j // page_size])
            assert e < 0
            rows.append((pool_k[-(e + 1), j % page_size], pool_v[-(e + 1), j % page_size]))
        k = torch.stack([r[0] for r in rows])
        v = torch.stack([r[1] for r in rows])
        parts.append(_emulated_pass(q, k, v, scale=0.3, causal_from=None))
    parts.append(_emulated_pass(q, k_new, v_new, scale=0.3, causal_from=0))
    o_parts = torch.stack([p[0] for p in parts])
    weights = torch.softmax(torch.stack([p[1] for p in parts]), dim=0)
    got = (o_parts * weights.unsqueeze(-1)).sum(0)
    ref = dense_reference(q, k_new, v_new, kv, causal=True, scale=0.3)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kv_chunk", [64, 128])
@pytest.mark.parametrize("past", [0, 1000])
def test_stream_traffic_is_tiled_plus_the_ring(past, kv_chunk):
    """Link bytes and FLOPs are tiled's (= the reference schedule's); HBM adds each host byte written into
    the ring and read back from it."""
    q_len, num_heads = 65, 8
    kv = random_paged_kv([past], page_size=16, num_kv_heads=2, head_dim=64, dtype=BF16)
    meta = lambda *shape: torch.empty(shape, dtype=BF16, device="meta")  # noqa: E731
    _, ref = reference_prefill(meta(q_len, num_heads, 64), meta(q_len, 2, 64), meta(q_len, 2, 64), kv,
                               variant="tiled", compute=False, tile_kv=kv_chunk)
    got = traffic(q_len, past, kv, num_heads=num_heads, variant="stream", causal=True, kv_chunk=kv_chunk)
    host_tokens = sum(min(16, past - 16 * i) for i, e in enumerate(kv.block_table[0, : -(-past // 16)].tolist())
                      if e >= 0)
    assert got.link_read_bytes == ref.link_read_bytes == host_tokens * 2 * 2 * 64 * 2
    assert got.flops == ref.flops
    assert got.hbm_read_bytes == ref.hbm_read_bytes + ref.link_read_bytes
    assert got.hbm_write_bytes == ref.hbm_write_bytes + ref.link_read_bytes


def test_per_table_memo_follows_the_table_and_its_version():
    """The wrappers' per-table memo computes once per (table, in-place version, key) and again after the table
    is written in place or replaced."""
    from directkv.kernels.paged import per_table

    memo, calls = {}, []
    table = torch.zeros(1, 4, dtype=torch.int32)

    def get(t, key=()):
        return per_table(memo, t, key, lambda: calls.append(1) or len(calls))

    assert get(table) == get(table) == 1
    assert get(table, ("other",)) == 2
    table[0, 1] = 3  # written in place: its version moves
    assert get(table) == 3
    assert get(table.clone()) == 4 and len(calls) == 4


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", ["tiled", "stream"])
def test_prefill_host_table_spares_the_device_sync_and_changes_no_result(variant):
    """As decode's: with a CPU copy of the block table the call's Traffic is read from it, with no
    synchronising operation (torch's sync debug mode raises on one); without it a fresh table is read back
    and the control must raise."""
    q, k_new, v_new, kv_cpu, kv = make_inputs((65, 1000, 8, 2, 128, BF16, 16))
    plan = plan_prefill_stream(kv) if variant == "stream" else None
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, t = prefill_attention(q, k_new, v_new, kv, variant=variant, out=out, stream_plan=plan,
                                 host_table=kv_cpu.block_table)
        fresh = PagedKV(kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table.clone(), kv.seq_lens)
        with pytest.raises(RuntimeError, match="synchroniz"):
            prefill_attention(q, k_new, v_new, fresh, variant=variant, stream_plan=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches(out, dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(128)))
    fresh = PagedKV(kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v, kv.block_table.clone(), kv.seq_lens)
    assert t == prefill_attention(q, k_new, v_new, fresh, variant=variant, stream_plan=plan)[1]
