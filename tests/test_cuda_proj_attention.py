"""CUDA proj_attention (separate, fused) against float64 references on the GPU.

Fresh random inputs, the output poisoned with NaN, lengths that are not tile multiples (chunks that straddle
the past / new boundary), GQA 1/4/8, bf16 and fp16, head_dim 64 and 128, host and HBM pages mixed in random
order for both the past and the new tokens, with and without RoPE, causal and not. Checked: the attention
output, the new K/V stored in their pages (and the past left alone), and the closed-form traffic against the
reference backend's count of the same schedule. The argument checks run anywhere.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.proj_attention import VARIANTS, plan, proj_attention
from directkv.kernels.reference import proj_attention as reference_proj
from directkv.kernels.reference.fixtures import random_paged_kv
from tests.test_cuda_prefill import rel_err, to_gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1.5e-2, FP16: 5e-3}

# (q_len, past_len, num_heads, num_kv_heads, head_dim, dtype, page_size, hidden, rope_theta, causal)
CASES = [
    (1, 0, 4, 4, 64, BF16, 16, 64, None, True),  # one token, no past, GQA 1
    (7, 1, 8, 2, 128, FP16, 16, 192, 10000.0, True),  # GQA 4
    (65, 1000, 8, 1, 128, BF16, 16, 256, 500000.0, True),  # GQA 8
    (300, 4097, 32, 8, 128, BF16, 16, 512, 500000.0, True),  # Llama-3.1-8B heads
    (130, 65, 4, 4, 64, FP16, 7, 128, 10000.0, False),  # not causal, page size 7
    (97, 333, 16, 2, 64, FP16, 32, 320, None, True),  # GQA 8, no RoPE
]
# the planned schedule, and forced small chunks so a split owns several (partial state through HBM) and the
# new tokens' chunks start mid-chunk
RUNS = [{}, {"kv_chunk": 64, "num_splits": 3}, {"kv_chunk": 128, "num_splits": 2}]


def _case_id(c) -> str:
    q_len, past, h, hkv, d, dtype, ps, hidden, theta, causal = c
    return f"q{q_len}-past{past}-h{h}x{hkv}-d{d}-{str(dtype)[6:]}-ps{ps}-x{hidden}-rope{theta}-{'c' if causal else 'nc'}"


def make_case(case, seed: int = 0):
    """(x, wq, wk, wv, the CPU cache with pages reserved for the new tokens, its GPU copy)."""
    q_len, past, num_heads, num_kv_heads, head_dim, dtype, page_size, hidden, _, _ = case
    kv_cpu = random_paged_kv([past + q_len], page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             dtype=dtype, seq_lens=[past])
    x = torch.randn(q_len, hidden, device="cuda").to(dtype)
    wq, wk, wv = ((torch.randn(hidden, cols, device="cuda") / math.sqrt(hidden)).to(dtype)
                  for cols in (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim))
    return x, wq, wk, wv, kv_cpu, to_gpu(kv_cpu)


def reference(x, wq, wk, wv, k_past, v_past, *, head_dim: int, theta, causal: bool):
    """float64 projections (RoPE as complex rotation, written independently of the kernels) and attention."""
    q_len, past = x.shape[0], k_past.shape[0]

    def heads(w: torch.Tensor, rope: bool) -> torch.Tensor:
        y = (x.double() @ w.double()).reshape(q_len, -1, head_dim)
        if not rope or theta is None:
            return y
        half = head_dim // 2
        freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / head_dim)
        angle = torch.arange(past, past + q_len, dtype=torch.float64, device=x.device)[:, None] * freq
        z = torch.complex(y[..., :half], y[..., half:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    q, k_new, v_new = heads(wq, True), heads(wk, True), heads(wv, False)
    k = torch.cat([k_past.to(x.device).double(), k_new])
    v = torch.cat([v_past.to(x.device).double(), v_new])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    if causal:
        keys = torch.arange(k.shape[0], device=x.device)
        s = s.masked_fill(keys[None, :] > past + torch.arange(q_len, device=x.device)[:, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v), k_new, v_new


def stored(kv_gpu, kv_cpu, total: int):
    """The cache's first `total` tokens read back from the GPU pools (host pools through their pinned memory)."""
    back = dataclasses.replace(kv_cpu, host_k=kv_gpu.host_k.cpu(), host_v=kv_gpu.host_v.cpu(), hbm_k=kv_gpu.hbm_k.cpu(),
                               hbm_v=kv_gpu.hbm_v.cpu(), seq_lens=torch.tensor([total], dtype=torch.int32))
    return back.gather(0)


def new_slots(kv_cpu, past: int, q_len: int, *, host: bool) -> torch.Tensor:
    """`[pages, page_size]` mask of one tier's pool: the slots of tokens past..past + q_len - 1."""
    pool = kv_cpu.host_k if host else kv_cpu.hbm_k
    mask = torch.zeros(pool.shape[:2], dtype=torch.bool)
    for pos in range(past, past + q_len):
        e = int(kv_cpu.block_table[0, pos // kv_cpu.page_size])
        if (e >= 0) == host:
            mask[e if host else -(e + 1), pos % kv_cpu.page_size] = True
    return mask


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_block_tables_are_refused_before_any_write(variant):
    """Entries outside the pools or a page listed twice, among the past's pages (entry 3) or the new tokens'
    (entry 8 of 11: tokens 128..143), are refused, and no pool was written."""
    case = (65, 100, 8, 2, 64, BF16, 16, 128, None, True)
    x, wq, wk, wv, kv_cpu, kv = make_case(case)
    for i in (3, 8):
        for e, match in ((kv.host_k.shape[0], "outside the pools"), (-kv.hbm_k.shape[0] - 1, "outside the pools"),
                         (int(kv_cpu.block_table[0, 0]), "lists a page twice")):
            table = kv_cpu.block_table.clone()
            table[0, i] = e
            with pytest.raises(ConfigError, match=match):
                proj_attention(x, wq, wk, wv, dataclasses.replace(kv, block_table=table.cuda()), variant=variant)
    torch.cuda.synchronize()
    for before, after in ((kv_cpu.host_k, kv.host_k), (kv_cpu.host_v, kv.host_v), (kv_cpu.hbm_k, kv.hbm_k),
                          (kv_cpu.hbm_v, kv.hbm_v)):
        assert torch.equal(after.cpu(), before)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kwargs", RUNS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()) or "auto")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_proj_attention_matches_float64_reference(case, variant, kwargs):
    q_len, past, num_heads, num_kv_heads, head_dim, dtype, _, hidden, theta, causal = case
    x, wq, wk, wv, kv_cpu, kv = make_case(case)
    k_past, v_past = kv_cpu.gather(0)
    out = torch.full((q_len, num_heads, head_dim), math.nan, dtype=dtype, device="cuda")
    got, traffic = proj_attention(x, wq, wk, wv, kv, variant=variant, rope_theta=theta, causal=causal, out=out, **kwargs)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    ref, k_ref, v_ref = reference(x, wq, wk, wv, k_past, v_past, head_dim=head_dim, theta=theta, causal=causal)
    assert not out.isnan().any(), "unwritten or NaN output elements"
    assert rel_err(out, ref) < TOL[dtype]

    k_all, v_all = stored(kv, kv_cpu, past + q_len)
    assert torch.equal(k_all[:past], k_past) and torch.equal(v_all[:past], v_past), "the past was overwritten"
    assert rel_err(k_all[past:].cuda(), k_ref) < TOL[dtype] and rel_err(v_all[past:].cuda(), v_ref) < TOL[dtype]
    # and nothing but the new tokens' slots changed anywhere in the pools (rest of the last page, spare pages)
    for before, after in ((kv_cpu.host_k, kv.host_k), (kv_cpu.host_v, kv.host_v), (kv_cpu.hbm_k, kv.hbm_k),
                          (kv_cpu.hbm_v, kv.hbm_v)):
        keep = ~new_slots(kv_cpu, past, q_len, host=before is kv_cpu.host_k or before is kv_cpu.host_v)
        assert torch.equal(after.cpu()[keep], before[keep]), "a slot outside the new tokens' was written"

    # the closed form states the reference schedule at the planned chunk
    chunk = plan(x, num_heads, kv, past, variant, **kwargs).kv_chunk
    meta = lambda t: t.to("meta")  # noqa: E731
    meta_kv = dataclasses.replace(kv_cpu, host_k=meta(kv_cpu.host_k), host_v=meta(kv_cpu.host_v),
                                  hbm_k=meta(kv_cpu.hbm_k), hbm_v=meta(kv_cpu.hbm_v))
    _, counted = reference_proj(meta(x), meta(wq), meta(wk), meta(wv), meta_kv, variant=variant, rope_theta=theta,
                                causal=causal, tile_q=64, tile_kv=chunk, compute=False)
    assert traffic == counted


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", ["cg", "ca"])
def test_fused_equals_separate_and_pinned_cpu_pools(host_load):
    """Both variants store the same K/V and give the same output (host pools as pinned CPU tensors here); the
    fused kernel rounds once, so they agree to the dtype's precision, not bit for bit."""
    case = (200, 700, 8, 2, 128, BF16, 16, 256, 10000.0, True)
    x, wq, wk, wv, kv_cpu, _ = make_case(case)
    outs, caches = {}, {}
    for variant in VARIANTS:
        kv = to_gpu(kv_cpu)
        pinned = dataclasses.replace(kv, host_k=kv.host_k.cpu().pin_memory(), host_v=kv.host_v.cpu().pin_memory())
        outs[variant], _ = proj_attention(x, wq, wk, wv, pinned, variant=variant, rope_theta=10000.0,
                                          host_load=host_load)
        torch.cuda.synchronize()
        caches[variant] = stored(pinned, kv_cpu, 900)
    assert rel_err(outs["fused"], outs["separate"].double()) < TOL[BF16]
    for i in range(2):
        assert rel_err(caches["fused"][i][700:], caches["separate"][i][700:].double()) < TOL[BF16]


def _cpu_inputs(hidden: int = 128):
    kv = random_paged_kv([40], page_size=16, num_kv_heads=2, head_dim=64, dtype=BF16, seq_lens=[30])
    x = torch.randn(10, hidden).to(BF16)
    return x, torch.zeros(hidden, 256, dtype=BF16), *[torch.zeros(hidden, 128, dtype=BF16)] * 2, kv


@pytest.mark.parametrize("kwargs,match", [
    ({"variant": "fusd"}, r"'fusd'.*fused, separate|'fusd'.*separate, fused"),
    ({"variant": "fused", "tile_kv": 32}, "tile_kv 32"),
    ({"variant": "fused", "host_load": "l1"}, "'l1'"),
])
def test_bad_options_name_the_value_and_the_valid_ones(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        proj_attention(*_cpu_inputs(), **kwargs)


def test_bad_inputs_raise_config_error():
    x, wq, wk, wv, kv = _cpu_inputs(hidden=96)
    with pytest.raises(ConfigError, match="hidden 96 must be a multiple of 64"):
        proj_attention(x, wq, wk, wv, kv, variant="fused")
    with pytest.raises(ConfigError, match="wk must be"):
        proj_attention(x, wq, wq, wv, kv, variant="separate")
    with pytest.raises(ConfigError, match="x must be a CUDA tensor; got cpu"):
        proj_attention(x, wq, wk, wv, kv, variant="separate")


@pytest.mark.gpu
@needs_cuda
def test_bench_rows_are_checked_and_count_the_link():
    from directkv.kernels.cuda.bench_proj import bench_proj

    rows = bench_proj(q_lens=(1, 65), past_len=300, hidden=128, num_heads=8, num_kv_heads=2, head_dim=64,
                      warmup=0, repeats=1, ceilings={"ce_h2d_gbps": 50.0})
    assert {r["variant"] for r in rows} == {"separate", "fused", "sdpa_hbm", "swap_sdpa"}
    for r in rows:
        assert r["status"] == "ok" and r["rel_err"] < 2e-2 and r["time_ms"] > 0, r
        kv_tok = 2 * 2 * 64 * 2  # K + V, 2 KV heads, head_dim 64, bf16
        if r["variant"] in ("separate", "fused"):  # past read once; new written once (+ read back: separate)
            assert r["link_write_bytes"] == r["q_len"] * kv_tok
            assert r["link_read_bytes"] == (300 + r["q_len"] * (r["variant"] == "separate")) * kv_tok


def test_fused_plan_fits_the_weight_stages_beside_its_chunks():
    """The fused kernel's chunks are sized with its weight stages in the same shared memory, and two of its
    CTAs share an SM only if both fit with their stages (H200 limits: 132 SMs, 227 KiB per CTA)."""
    from directkv.kernels.cuda.prefill_attention import SMEM_PAD, plan_tiled
    from directkv.kernels.cuda.proj_attention import stage_bytes

    smem, stages, row = 232448, stage_bytes(128, 2), 2 * (128 + SMEM_PAD) * 2
    shape = dict(num_kv_heads=8, head_dim=128, dtype_bytes=2, part_bytes_per_split=1 << 20, sms=132, smem_optin=smem)
    auto = plan_tiled(18432, **shape, extra_smem=stages)
    assert auto.kv_chunk == 256 and auto.kv_chunk * row + stages <= smem  # 320 keys would not fit beside them
    assert plan_tiled(18432, **shape, kv_chunk=128).threads == 128  # 2 x 68 KiB of chunks: two CTAs per SM
    assert plan_tiled(18432, **shape, kv_chunk=128, extra_smem=stages).threads == 256  # 2 x 136 KiB do not fit
