"""Closed-form traffic against the counted loops (every field, random shapes, mixed tiers) and the
headline relations of the paper's tiling claims."""

from __future__ import annotations

import math
import random

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.reference import decode_attention, gemm, prefill_attention, proj_attention
from directkv.kernels.reference.fixtures import hbm_token_count, random_paged_kv
from directkv.kernels.traffic_model import (
    decode_traffic,
    floor_sum,
    gemm_traffic,
    prefill_traffic,
    proj_attention_traffic,
    stream_prefill_traffic,
)

DT = torch.bfloat16
E = 2


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=DT, device="meta")


def random_heads(rng: random.Random) -> dict:
    kv_heads = rng.choice([1, 2, 8])
    return dict(
        num_kv_heads=kv_heads, num_heads=kv_heads * rng.choice([1, 4, 8]), head_dim=rng.choice([8, 64, 128])
    )


def test_floor_sum_matches_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        n, m, a, b = rng.randint(0, 60), rng.randint(1, 40), rng.randint(0, 90), rng.randint(0, 90)
        assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


def test_decode_closed_form_equals_counted():
    rng = random.Random(1)
    for trial in range(40):
        h = random_heads(rng)
        lens = [rng.randint(1, 700) for _ in range(rng.randint(1, 5))]
        kv = random_paged_kv(
            lens, page_size=rng.choice([16, 64]), num_kv_heads=h["num_kv_heads"], head_dim=h["head_dim"],
            dtype=DT, hbm_fraction=rng.random(), device="meta", generator=torch.Generator().manual_seed(trial),
        )  # fmt: skip
        hbm = [hbm_token_count(kv, b, 0, n) for b, n in enumerate(lens)]
        for variant in ("naive", "tiled"):
            _, counted = decode_attention(
                meta(len(lens), h["num_heads"], h["head_dim"]), kv, variant=variant,
                tile_kv=rng.randint(1, 100), compute=False,
            )  # fmt: skip
            assert counted == decode_traffic(lens, **h, dtype_bytes=E, variant=variant, hbm_tokens=hbm)


def random_attention_case(rng: random.Random, trial: int):
    h = random_heads(rng)
    q_len = rng.choice([1, rng.randint(1, 70), rng.randint(1, 400)])
    past = rng.choice([0, rng.randint(1, 400)])
    kv = random_paged_kv(
        [past + q_len], page_size=rng.choice([16, 64]), num_kv_heads=h["num_kv_heads"], head_dim=h["head_dim"],
        dtype=DT, hbm_fraction=rng.choice([0.0, rng.random()]), seq_lens=[past], device="meta",
        generator=torch.Generator().manual_seed(trial),
    )  # fmt: skip
    tiles = dict(causal=rng.random() < 0.6, tile_q=rng.randint(1, 80), tile_kv=rng.randint(1, 80))
    return h, q_len, past, kv, tiles


def test_prefill_closed_form_equals_counted():
    rng = random.Random(2)
    for trial in range(60):
        h, q_len, past, kv, tiles = random_attention_case(rng, trial)
        q, k_new = meta(q_len, h["num_heads"], h["head_dim"]), meta(q_len, h["num_kv_heads"], h["head_dim"])
        for variant in ("naive", "tiled"):
            _, counted = prefill_attention(q, k_new, k_new, kv, variant=variant, compute=False, **tiles)
            model = prefill_traffic(
                q_len, past, **h, dtype_bytes=E, variant=variant, past_hbm_tokens=hbm_token_count(kv, 0, 0, past),
                **tiles,
            )  # fmt: skip
            assert counted == model, (variant, q_len, past, tiles)


def test_proj_attention_closed_form_equals_counted():
    rng = random.Random(3)
    for trial in range(60):
        h, q_len, past, kv, tiles = random_attention_case(rng, trial)
        hidden = rng.randint(1, 300)
        x = meta(q_len, hidden)
        ws = [meta(hidden, h["num_heads"] * h["head_dim"])] + [
            meta(hidden, h["num_kv_heads"] * h["head_dim"])
        ] * 2
        for variant in ("fused", "separate"):
            _, counted = proj_attention(x, *ws, kv, variant=variant, rope_theta=1e4, compute=False, **tiles)
            model = proj_attention_traffic(
                q_len, past, hidden=hidden, **h, dtype_bytes=E, variant=variant,
                past_hbm_tokens=hbm_token_count(kv, 0, 0, past),
                new_hbm_tokens=hbm_token_count(kv, 0, past, past + q_len), **tiles,
            )  # fmt: skip
            assert counted == model, (variant, q_len, past, tiles)


def test_gemm_closed_form_equals_counted():
    rng = random.Random(4)
    for _ in range(60):
        m, n, k = (rng.randint(1, 300) for _ in range(3))
        tiles = dict(tile_m=rng.randint(1, 130), tile_n=rng.randint(1, 130), tile_k=rng.randint(1, 70))
        for variant in ("naive", "tiled", "pipelined"):
            b_tier = rng.choice(["host", "hbm"])
            _, counted = gemm(meta(m, k), meta(k, n), variant=variant, b_tier=b_tier, compute=False, **tiles)
            assert counted == gemm_traffic(m, n, k, dtype_bytes=E, variant=variant, b_tier=b_tier, **tiles)


# ---- headline relations (counted loops, all past pages on the host) ------------------------------------


def host_cache(past: int, q_len: int, kv_heads: int, head_dim: int):
    return random_paged_kv(
        [past + q_len], page_size=16, num_kv_heads=kv_heads, head_dim=head_dim, dtype=DT, hbm_fraction=0.0,
        seq_lens=[past], device="meta",
    )  # fmt: skip


@pytest.mark.parametrize("q_len,past,tile_q", [(1, 100, 64), (200, 333, 64), (257, 1000, 32)])
def test_prefill_link_reads_tiled_once_naive_per_q_tile(q_len, past, tile_q):
    kv = host_cache(past, 0, 2, 64)
    q, k_new = meta(q_len, 8, 64), meta(q_len, 2, 64)
    past_kv_bytes = past * 2 * 2 * 64 * E
    link = {
        v: prefill_attention(q, k_new, k_new, kv, variant=v, tile_q=tile_q, compute=False)[1].link_read_bytes
        for v in ("naive", "tiled")
    }
    assert link["tiled"] == past_kv_bytes
    assert link["naive"] == past_kv_bytes * math.ceil(q_len / tile_q)


def test_decode_naive_reads_gqa_ratio_times_tiled():
    lens = [1, 100, 4097]
    kv = random_paged_kv(
        lens, page_size=64, num_kv_heads=8, head_dim=128, dtype=DT, hbm_fraction=0.0, device="meta"
    )
    q = meta(3, 32, 128)
    naive, tiled = (decode_attention(q, kv, variant=v, compute=False)[1] for v in ("naive", "tiled"))
    assert tiled.link_read_bytes == sum(lens) * 2 * 8 * 128 * E
    assert naive.link_read_bytes == 4 * tiled.link_read_bytes
    assert naive.flops == tiled.flops


@pytest.mark.parametrize("q_len,past", [(1, 500), (130, 0), (300, 77)])
def test_fused_reads_no_new_kv_back(q_len, past):
    kv = host_cache(past, q_len, 2, 64)
    x, ws = meta(q_len, 256), [meta(256, 512), meta(256, 128), meta(256, 128)]
    fused, separate = (proj_attention(x, *ws, kv, variant=v, compute=False)[1] for v in ("fused", "separate"))
    new_kv_bytes = q_len * 2 * 2 * 64 * E
    assert fused.link_read_bytes == past * 2 * 2 * 64 * E
    assert fused.link_read_bytes == separate.link_read_bytes - new_kv_bytes
    assert fused.link_write_bytes == separate.link_write_bytes == new_kv_bytes


@pytest.mark.parametrize("m,n,k", [(1000, 300, 257), (129, 1, 65), (10240, 10240, 10240)])
def test_gemm_b_crosses_link_once_when_stationary(m, n, k):
    naive = gemm_traffic(m, n, k, dtype_bytes=E, variant="naive")
    tiled = gemm_traffic(m, n, k, dtype_bytes=E, variant="tiled")
    assert naive.link_read_bytes == k * n * E * math.ceil(m / 128)
    assert tiled.link_read_bytes == k * n * E
    if m <= 1000:  # the counted loops agree (the 10240^3 case is closed form only: 1M tile steps)
        for variant, model in (("naive", naive), ("tiled", tiled)):
            assert gemm(meta(m, k), meta(k, n), variant=variant, compute=False)[1] == model


def test_gemm_stream_closed_form_by_hand():
    """m=3, n=10, k=4, 2-byte elements, panels of 4 columns (3 panels: 4, 4, 2); B is 4 * 10 * 2 = 80 bytes."""
    t = gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", panel_cols=4)
    assert t.link_read_bytes == 80  # B once, by the copy engine
    assert t.hbm_read_bytes == 80 + 3 * (3 * 4 * 2)  # B back from the ring + A once per panel
    assert t.hbm_write_bytes == 80 + 3 * 10 * 2  # the ring + C
    assert t.flops == 2 * 3 * 10 * 4
    assert t.link_write_bytes == 0
    hbm = gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", b_tier="hbm", panel_cols=4)
    assert hbm.link_read_bytes == 0 and hbm.hbm_read_bytes == 80 + 80 + 72 and hbm.hbm_write_bytes == 140
    # one panel: A once; 10240^3 at 1408 columns: 8 panels, B (200 MiB) crosses the link once
    assert gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", panel_cols=64).hbm_read_bytes == 80 + 24
    big = gemm_traffic(10240, 10240, 10240, dtype_bytes=2, variant="stream", panel_cols=1408)
    assert big.link_read_bytes == 200 << 20
    assert big.hbm_read_bytes == (200 << 20) * 9 and big.hbm_write_bytes == (200 << 20) * 2
    wide = gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", panel_cols=4, c_bytes=4)  # fp32 C
    assert wide.hbm_write_bytes == 80 + 3 * 10 * 4 and wide.hbm_read_bytes == t.hbm_read_bytes


def test_gemm_stream_row_panels_by_hand():
    """m=3, n=10, k=4 in row panels of 3 rows (2 panels: 3, 1): A once, C written twice and read back once."""
    t = gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", panel_rows=3)
    assert t.link_read_bytes == 80
    assert t.hbm_read_bytes == 80 + 3 * 4 * 2 + 1 * 3 * 10 * 2
    assert t.hbm_write_bytes == 80 + 2 * 3 * 10 * 2
    wide = gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", panel_rows=3, c_bytes=4)
    assert wide.hbm_read_bytes == 80 + 24 + 120 and wide.hbm_write_bytes == 80 + 240
    one = gemm_traffic(3, 10, 4, dtype_bytes=2, variant="stream", panel_rows=4)  # one panel: C once
    assert one.hbm_write_bytes == 80 + 60 and one.hbm_read_bytes == 80 + 24


def test_gemm_stream_is_cuda_only_and_its_options_are_checked():
    with pytest.raises(ConfigError, match="unknown gemm variant 'stream'; valid: naive, pipelined, tiled"):
        gemm(meta(4, 4), meta(4, 4), variant="stream", compute=False)  # the reference has no stream loop
    with pytest.raises(ConfigError, match="gemm variant 'stream' needs exactly one of panel_cols / panel_rows, a "
                                          "positive int; got None / None"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="stream")
    with pytest.raises(ConfigError, match="a positive int; got 0 / None"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="stream", panel_cols=0)
    with pytest.raises(ConfigError, match="a positive int; got 4 / 4"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="stream", panel_cols=4, panel_rows=4)
    with pytest.raises(ConfigError, match="panel_cols / panel_rows are options of gemm variant 'stream'; got 64 / "
                                          "None for 'tiled'"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="tiled", panel_cols=64)
    with pytest.raises(ConfigError, match="c_bytes must be a positive int; got 0"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="tiled", c_bytes=0)
    with pytest.raises(ConfigError, match="valid: naive, pipelined, ring, stream, tiled"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="raster")


def test_gemm_ring_traffic_by_hand():
    # m 300, n 200, k 64, fp16: 2 strips of 128 columns, 2 row tiles of 256; A 38,400 B, B 25,600 B, C 120,000 B;
    # the ring holds 2 whole units of 64 x 128 (32,768 B: zeros past n = 200)
    t = gemm_traffic(300, 200, 64, dtype_bytes=2, variant="ring")
    assert t.link_read_bytes == 25_600  # B once across the link
    assert t.hbm_read_bytes == 2 * 38_400 + 2 * 32_768  # A once a strip, the ring's units once a row tile
    assert t.hbm_write_bytes == 32_768 + 120_000  # the units into the ring, C once
    hbm = gemm_traffic(300, 200, 64, dtype_bytes=2, variant="ring", b_tier="hbm", c_bytes=4)
    assert hbm.link_read_bytes == 0 and hbm.hbm_read_bytes == 2 * 38_400 + 2 * 32_768 + 25_600
    assert hbm.hbm_write_bytes == 32_768 + 240_000


def test_closed_form_bad_inputs():
    h = dict(num_heads=8, num_kv_heads=2, head_dim=64, dtype_bytes=2)
    with pytest.raises(ConfigError, match="valid: naive, tiled"):
        prefill_traffic(10, 0, **h, variant="fused")
    with pytest.raises(ConfigError, match="past_hbm_tokens must be in 0..5"):
        prefill_traffic(10, 5, **h, variant="tiled", past_hbm_tokens=6)
    with pytest.raises(ConfigError, match="num_heads % num_kv_heads"):
        decode_traffic([4], num_heads=6, num_kv_heads=4, head_dim=64, dtype_bytes=2, variant="tiled")
    with pytest.raises(ConfigError, match="valid: hbm, host"):
        gemm_traffic(4, 4, 4, dtype_bytes=2, variant="tiled", b_tier="disk")


def test_closed_forms_are_fast_at_real_shapes():
    import time

    start = time.perf_counter()
    for past in range(0, 32768, 64):
        prefill_traffic(32768 - past, past, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                        variant="tiled", tile_q=64, tile_kv=48)  # fmt: skip
    decode_traffic([32768] * 256, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, variant="naive")
    assert time.perf_counter() - start < 0.5


def test_stream_prefill_is_flash_passes_over_ring_chunks_by_hand():
    # Llama-3.1-8B heads, 1000 new tokens over a 10,000-token past, chunks of 2 MiB of K (1024 tokens of
    # 8 x 128 x 2 B): 10 past passes + the new tokens' pass, each reading Q and writing its O; the merge reads them
    row, kv_tok = 32 * 128 * 2, 2 * 8 * 128 * 2
    t = stream_prefill_traffic(1000, 10_000, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                                  chunk_bytes=2 << 20)
    # 11 passes, 8 held at most: one fold, whose fp32 running O (2 x row per query) is written once and read once
    passes, running = 11, 1000 * 2 * row
    assert t.link_read_bytes == 10_000 * kv_tok and t.link_write_bytes == 0
    assert t.hbm_read_bytes == passes * 1000 * row + 10_000 * kv_tok + 1000 * kv_tok + passes * 1000 * row + running
    assert t.hbm_write_bytes == 10_000 * kv_tok + passes * 1000 * row + 1000 * row + running
    few = stream_prefill_traffic(1000, 7168, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                                 chunk_bytes=2 << 20)  # 7 past passes + the new tokens': held whole, no fold
    assert few.hbm_write_bytes == 7168 * kv_tok + 8 * 1000 * row + 1000 * row
    assert few.hbm_read_bytes == 8 * 1000 * row + 7168 * kv_tok + 1000 * kv_tok + 8 * 1000 * row
    tiled = prefill_traffic(1000, 10_000, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, variant="tiled")
    assert t.flops == tiled.flops and t.link_read_bytes == tiled.link_read_bytes
    assert t.hbm_read_bytes + t.hbm_write_bytes < tiled.hbm_read_bytes + tiled.hbm_write_bytes  # no partial state
    alone = stream_prefill_traffic(7, 0, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert alone.link_read_bytes == 0 and alone.hbm_write_bytes == 7 * row  # one pass: its O is the output


def test_serving_attention_stores_a_chunks_new_kv_and_reads_them_from_hbm():
    # as the GPU executor runs them: every variant stores the chunk's new K/V to the host tier once and attends
    # them from the projection's output, so the link reads only the past (the measured rows' link bytes)
    from directkv.engine import step_traffic as st
    from directkv.engine.state import PrefillChunk, ReqState, Step
    from directkv.engine.systems import SystemPolicy
    from directkv.specs import get_model
    from workloads.request import Request

    model = get_model("llama-3.1-8b")
    kvl = model.kv_bytes_per_token_per_layer()
    step = Step((), (PrefillChunk(ReqState(Request(0, 6000, 8), prefilled=4000), 2000, 4000),))
    for variant in ("naive", "tiled", "fused", "stream"):
        t = st.attention_traffic(step, model, variant, SystemPolicy("directkv", variant))
        assert t.link_write_bytes == 2000 * kvl, variant
        if variant == "naive":  # the past once per Q tile, and nothing for the new tokens
            assert t.link_read_bytes % (4000 * kvl) == 0 and t.link_read_bytes > 4000 * kvl
        else:
            assert t.link_read_bytes == 4000 * kvl, variant
