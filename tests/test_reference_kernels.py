"""Reference kernels: outputs against a dense float64 reference, cache writes, validation, and the counting
mode (compute=False on meta tensors counts the same traffic as the real run, fast enough for the engine)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.reference import (
    decode_attention,
    dense_attention,
    gemm,
    prefill_attention,
    proj_attention,
)
from directkv.kernels.reference.fixtures import random_paged_kv

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def check_out(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == dtype
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype]


def complex_rope(x: torch.Tensor, pos0: int, theta: float) -> torch.Tensor:
    """RoPE written independently of the kernel's rotate-half: dims (i, i + d/2) as one complex number."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = torch.arange(pos0, pos0 + x.shape[0], dtype=torch.float64)[:, None] * freq
    z = (
        torch.complex(x[..., :half].double(), x[..., half:].double())
        * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    )
    return torch.cat([z.real, z.imag], dim=-1)


# ---- decode -------------------------------------------------------------------------------------------

DECODE_CASES = [  # seq_lens, page_size, num_kv_heads, gqa, head_dim, dtype, tile_kv
    ([1, 63, 65, 257], 16, 2, 4, 64, torch.float32, 64),
    ([1000, 5], 64, 1, 8, 128, torch.bfloat16, 64),
    ([129, 64, 1], 16, 4, 1, 128, torch.float16, 48),
    ([300], 64, 2, 4, 64, torch.bfloat16, 17),
]


@pytest.mark.parametrize("variant", ["naive", "tiled"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-ps{c[1]}-g{c[3]}-d{c[4]}-{c[5]}")
def test_decode_matches_dense(case, variant):
    lens, page_size, kv_heads, gqa, head_dim, dtype, tile_kv = case
    gen = torch.Generator().manual_seed(1)
    kv = random_paged_kv(
        lens, page_size=page_size, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, generator=gen
    )
    q = torch.randn(len(lens), kv_heads * gqa, head_dim, generator=gen).to(dtype)
    out, _ = decode_attention(q, kv, variant=variant, tile_kv=tile_kv)
    ref = torch.cat(
        [dense_attention(q[b : b + 1], *kv.gather(b), q_pos0=n - 1, causal=True) for b, n in enumerate(lens)]
    )
    check_out(out, ref, dtype)


# ---- prefill ------------------------------------------------------------------------------------------

PREFILL_CASES = [  # q_len, past_len, page_size, num_kv_heads, gqa, head_dim, dtype, causal, tile_q, tile_kv
    (1, 0, 16, 2, 4, 64, torch.float32, True, 64, 64),
    (63, 0, 16, 2, 4, 64, torch.float32, True, 64, 64),
    (65, 257, 64, 1, 8, 128, torch.bfloat16, True, 64, 64),
    (257, 65, 16, 4, 1, 64, torch.float16, False, 32, 48),
    (1000, 300, 64, 2, 4, 128, torch.bfloat16, True, 64, 64),
    (1, 1000, 16, 1, 8, 64, torch.float32, True, 64, 64),
    (130, 63, 16, 2, 4, 128, torch.float32, False, 48, 32),
]


@pytest.mark.parametrize("variant", ["naive", "tiled"])
@pytest.mark.parametrize(
    "case", PREFILL_CASES, ids=lambda c: f"q{c[0]}-past{c[1]}-ps{c[2]}-g{c[4]}-{c[6]}-c{c[7]}"
)
def test_prefill_matches_dense(case, variant):
    q_len, past, page_size, kv_heads, gqa, head_dim, dtype, causal, tile_q, tile_kv = case
    gen = torch.Generator().manual_seed(2)
    kv = random_paged_kv(
        [past], page_size=page_size, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, generator=gen
    )
    q = torch.randn(q_len, kv_heads * gqa, head_dim, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(q_len, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    out, _ = prefill_attention(
        q, k_new, v_new, kv, variant=variant, causal=causal, tile_q=tile_q, tile_kv=tile_kv
    )
    k_past, v_past = kv.gather(0)
    ref = dense_attention(
        q, torch.cat([k_past, k_new]), torch.cat([v_past, v_new]), q_pos0=past, causal=causal
    )
    check_out(out, ref, dtype)


def test_prefill_variants_agree_and_sm_scale_is_used():
    gen = torch.Generator().manual_seed(3)
    kv = random_paged_kv([70], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32, generator=gen)
    q = torch.randn(50, 8, 64, generator=gen)
    k_new, v_new = torch.randn(50, 2, 64, generator=gen), torch.randn(50, 2, 64, generator=gen)
    outs = [
        prefill_attention(q, k_new, v_new, kv, variant=v, tile_q=16, tile_kv=24, sm_scale=0.3)[0]
        for v in ("naive", "tiled")
    ]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    k_past, v_past = kv.gather(0)
    ref = dense_attention(
        q, torch.cat([k_past, k_new]), torch.cat([v_past, v_new]), q_pos0=70, causal=True, sm_scale=0.3
    )
    assert rel_err(outs[1], ref) < 1e-5


# ---- fused projection + attention ---------------------------------------------------------------------

PROJ_CASES = [  # q_len, past_len, page_size, num_kv_heads, gqa, head_dim, hidden, dtype, rope_theta, causal
    (1, 0, 16, 2, 4, 64, 96, torch.float32, None, True),
    (63, 0, 16, 2, 4, 64, 128, torch.float32, 10000.0, True),
    (1, 257, 64, 1, 8, 128, 256, torch.bfloat16, 500000.0, True),
    (130, 65, 16, 4, 1, 64, 200, torch.float16, 10000.0, False),
    (65, 100, 64, 2, 4, 128, 160, torch.bfloat16, None, True),
]


@pytest.mark.parametrize(
    "case", PROJ_CASES, ids=lambda c: f"q{c[0]}-past{c[1]}-ps{c[2]}-g{c[4]}-{c[7]}-rope{c[8]}"
)
def test_proj_attention_fused_equals_separate_and_dense(case):
    q_len, past, page_size, kv_heads, gqa, head_dim, hidden, dtype, theta, causal = case
    num_heads = kv_heads * gqa
    gen = torch.Generator().manual_seed(4)
    kv = random_paged_kv(
        [past + q_len], page_size=page_size, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
        seq_lens=[past], generator=gen,
    )  # fmt: skip
    x = torch.randn(q_len, hidden, generator=gen).to(dtype)
    wq, wk, wv = (
        (torch.randn(hidden, cols, generator=gen) / math.sqrt(hidden)).to(dtype)
        for cols in (num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    )
    k_past, v_past = kv.gather(0)
    full = dataclasses.replace(kv, seq_lens=torch.tensor([past + q_len], dtype=torch.int32))
    outs, caches = {}, {}
    for variant in ("separate", "fused"):
        run_kv = dataclasses.replace(  # fresh pools per variant, same contents
            kv,
            host_k=kv.host_k.clone(),
            host_v=kv.host_v.clone(),
            hbm_k=kv.hbm_k.clone(),
            hbm_v=kv.hbm_v.clone(),
        )
        outs[variant], _ = proj_attention(
            x, wq, wk, wv, run_kv, variant=variant, rope_theta=theta, causal=causal, tile_q=32, tile_kv=48
        )
        caches[variant] = dataclasses.replace(run_kv, seq_lens=full.seq_lens).gather(0)
    torch.testing.assert_close(
        outs["fused"], outs["separate"], rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5
    )

    def heads(w: torch.Tensor, n: int) -> torch.Tensor:
        return (x.double() @ w.double()).reshape(q_len, n, head_dim)

    q_ref, k_ref, v_ref = heads(wq, num_heads), heads(wk, kv_heads), heads(wv, kv_heads)
    if theta is not None:
        q_ref, k_ref = complex_rope(q_ref, past, theta), complex_rope(k_ref, past, theta)
    for k_cache, v_cache in caches.values():
        assert torch.equal(k_cache[:past], k_past) and torch.equal(v_cache[:past], v_past)  # past untouched
        assert rel_err(k_cache[past:], k_ref) < TOL[dtype] and rel_err(v_cache[past:], v_ref) < TOL[dtype]
    ref = dense_attention(
        q_ref,
        torch.cat([k_past.double(), k_ref]),
        torch.cat([v_past.double(), v_ref]),
        q_pos0=past,
        causal=causal,
    )
    check_out(outs["fused"], ref, dtype)


# ---- gemm ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["naive", "tiled", "pipelined"])
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 1, 1), torch.float32),
        ((130, 77, 201), torch.float32),
        ((257, 65, 63), torch.bfloat16),
        ((33, 129, 7), torch.float16),
    ],  # fmt: skip
)
def test_gemm_matches_matmul(shape, dtype, variant):
    m, k, n = shape
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    c, _ = gemm(a, b, variant=variant, tile_m=32, tile_n=64, tile_k=16)
    check_out(c, a.double() @ b.double(), dtype)


# ---- validation ---------------------------------------------------------------------------------------


def small_problem():
    gen = torch.Generator().manual_seed(6)
    kv = random_paged_kv([40], page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32, generator=gen)
    q = torch.randn(8, 8, 64, generator=gen)
    k_new = torch.randn(8, 2, 64, generator=gen)
    return kv, q, k_new


@pytest.mark.parametrize(
    "call,valid",
    [
        (lambda kv, q, kn: decode_attention(q[:1], kv, variant="tiledd"), "naive, tiled"),
        (lambda kv, q, kn: prefill_attention(q, kn, kn, kv, variant="fused"), "naive, tiled"),
        (
            lambda kv, q, kn: proj_attention(q[:, 0], q[0].T, kn[0].T, kn[0].T, kv, variant="tiled"),
            "fused, separate",
        ),
        (lambda kv, q, kn: gemm(q[0], q[0], variant="Tiled"), "naive, pipelined, tiled"),
    ],
)
def test_unknown_variant_lists_valid_ones(call, valid):
    with pytest.raises(ConfigError, match=f"valid: {valid}$"):
        call(*small_problem())


def test_bad_inputs_raise_config_error():
    kv, q, k_new = small_problem()
    with pytest.raises(ConfigError, match="k_new must be"):
        prefill_attention(q, k_new[:, :1], k_new, kv, variant="tiled")
    with pytest.raises(ConfigError, match="not a multiple of num_kv_heads"):
        prefill_attention(q[:, :3], k_new, k_new, kv, variant="tiled")
    with pytest.raises(ConfigError, match="dtype"):
        prefill_attention(q.double(), k_new, k_new, kv, variant="tiled")
    with pytest.raises(ConfigError, match="q batch 2 != kv batch 1"):
        decode_attention(q[:2], kv, variant="naive")
    with pytest.raises(ConfigError, match="tile_q must be a positive int"):
        prefill_attention(q, k_new, k_new, kv, variant="naive", tile_q=0)
    with pytest.raises(ConfigError, match="inner dimensions differ"):
        gemm(q[0], q[0, :5], variant="naive")
    with pytest.raises(ConfigError, match="b_tier"):
        gemm(q[0], q[0].T, variant="naive", b_tier="disk")
    # The op writes past_len + q_len = 40 + 30 tokens: the table reserves only 3 pages of 16.
    x = torch.randn(30, 16)
    with pytest.raises(ConfigError, match="needs 5 pages for 70 tokens"):
        proj_attention(
            x, torch.randn(16, 8 * 64), torch.randn(16, 128), torch.randn(16, 128), kv, variant="fused"
        )
    broken = dataclasses.replace(kv, block_table=torch.full_like(kv.block_table, 999))
    with pytest.raises(ConfigError, match=r"block_table\[0, 0\] = 999 names no page"):
        decode_attention(q[:1], broken, variant="tiled")
    on_meta = dataclasses.replace(kv, block_table=kv.block_table.to("meta"))
    with pytest.raises(ConfigError, match="not meta"):
        decode_attention(q[:1], on_meta, variant="tiled")


# ---- counting mode ------------------------------------------------------------------------------------


def to_meta(kv):
    return dataclasses.replace(
        kv, **{f: getattr(kv, f).to("meta") for f in ("host_k", "host_v", "hbm_k", "hbm_v")}
    )


def test_meta_counting_equals_real_run():
    gen = torch.Generator().manual_seed(7)
    dt = torch.bfloat16
    kv = random_paged_kv([65, 1, 130], page_size=16, num_kv_heads=2, head_dim=64, dtype=dt, generator=gen)
    q = torch.randn(3, 8, 64, generator=gen).to(dt)
    for variant in ("naive", "tiled"):
        out, real = decode_attention(q, kv, variant=variant, tile_kv=24)
        none, counted = decode_attention(
            q.to("meta"), to_meta(kv), variant=variant, tile_kv=24, compute=False
        )
        assert none is None and counted == real and out is not None

    kv1 = random_paged_kv(
        [100 + 37], page_size=16, num_kv_heads=2, head_dim=64, dtype=dt, seq_lens=[100], generator=gen
    )
    q = torch.randn(37, 8, 64, generator=gen).to(dt)
    k_new = torch.randn(37, 2, 64, generator=gen).to(dt)
    for variant in ("naive", "tiled"):
        kw = dict(variant=variant, tile_q=16, tile_kv=32)
        _, real = prefill_attention(q, k_new, k_new, kv1, **kw)
        none, counted = prefill_attention(
            q.to("meta"), *[k_new.to("meta")] * 2, to_meta(kv1), compute=False, **kw
        )
        assert none is None and counted == real

    x = torch.randn(37, 48, generator=gen).to(dt)
    ws = [torch.randn(48, c, generator=gen).to(dt) for c in (512, 128, 128)]
    for variant in ("fused", "separate"):
        kw = dict(variant=variant, rope_theta=1e4, tile_q=16, tile_kv=32)
        _, real = proj_attention(x, *ws, kv1, **kw)
        none, counted = proj_attention(
            x.to("meta"), *[w.to("meta") for w in ws], to_meta(kv1), compute=False, **kw
        )
        assert none is None and counted == real

    a, b = torch.randn(70, 40, generator=gen).to(dt), torch.randn(40, 90, generator=gen).to(dt)
    for variant in ("naive", "tiled", "pipelined"):
        _, real = gemm(a, b, variant=variant, tile_m=32, tile_n=32, tile_k=16)
        none, counted = gemm(
            a.to("meta"), b.to("meta"), variant=variant, tile_m=32, tile_n=32, tile_k=16, compute=False
        )
        assert none is None and counted == real


def test_counter_accumulates_and_return_is_per_call():
    from directkv.kernels.traffic import TrafficCounter

    kv, q, _ = small_problem()
    counter = TrafficCounter()
    _, first = decode_attention(q[:1], kv, variant="tiled", counter=counter)
    _, second = decode_attention(q[:1], kv, variant="naive", counter=counter)
    assert counter.traffic == first + second and first != second


def test_counting_32k_decode_batch_64_is_fast():
    kv = random_paged_kv(
        [32768] * 64, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="meta"
    )
    q = torch.empty(64, 32, 128, dtype=torch.bfloat16, device="meta")
    start = time.perf_counter()
    _, traffic = decode_attention(q, kv, variant="tiled", compute=False)
    elapsed = time.perf_counter() - start
    assert (
        traffic.link_read_bytes + traffic.hbm_read_bytes == 64 * 32768 * 2 * 8 * 128 * 2 + 64 * 32 * 128 * 2
    )
    assert elapsed < 1.0, f"counting took {elapsed:.2f} s"
