"""The decode benchmark's rows: every variant checked against the reference, stream's chunk cuts real."""

from __future__ import annotations

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.bench_decode import ANCHORS, VARIANTS, ZERO_COPY_OPTIONS, bench_decode

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CEILINGS = {"sm_read_gbps": 50.0, "ce_h2d_gbps": 54.0, "hbm_copy_gbps": 3000.0}


def test_an_unknown_variant_is_one_line_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown decode variant\(s\) \['stream:3chunks'\]; valid: naive, tiled, "):
        bench_decode([64], [1], variants=("tiled", "stream:3chunks"), ceilings=CEILINGS)


def test_a_zero_copy_option_row_names_a_kernel_variant_and_its_options():
    import inspect

    from directkv.kernels.cuda.decode_attention import VARIANTS as KERNEL_VARIANTS
    from directkv.kernels.cuda.decode_attention import decode_attention

    params = inspect.signature(decode_attention).parameters
    for name, (base, options) in ZERO_COPY_OPTIONS.items():
        assert name.startswith(f"{base}:") and base in KERNEL_VARIANTS and name not in VARIANTS
        assert set(options) <= set(params), (name, options)


def test_an_unknown_anchor_is_one_line_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown decode anchor\(s\) \['sdpa'\]; valid: sdpa_hbm, .*read_probe"):
        bench_decode([64], [1], variants=("tiled",), anchors=("sdpa",), ceilings=CEILINGS)


@pytest.mark.gpu
@needs_gpu
def test_read_probe_streams_exactly_the_points_k_and_v():
    # the probe's per-thread sums of the bytes read as fp32 add up to the sum over copy i's K and V (K_i then V_i)
    # and to nothing more: it reads those bytes, each once
    from directkv.kernels.cuda.bench_decode import _calls, _Point
    from directkv.kernels.cuda.zero_copy import pinned_empty

    gen = torch.Generator(device="cuda").manual_seed(2)
    nbytes = 2 * 64 * 16 * 8 * 128 * 2  # one copy: K and V of 1017 tokens in 64 pages of 16, bf16
    arena = pinned_empty((2 * nbytes,), torch.uint8)
    point = _Point(arena, 1017, 1, 2, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                   page_size=16, page_order="random", gen=gen)
    call, link_bytes, _ = _calls(point, "read_probe", {})
    assert link_bytes == nbytes == point.flat[1].numel()
    for i in range(2):  # the expected bytes from the HBM copies of K_i and V_i, not from the view the probe reads
        k, v = (point.hbm[2 * i + j].contiguous().view(-1).view(torch.uint8) for j in (0, 1))
        want = torch.cat([k, v]).view(torch.float32).double().cpu()
        got = call(i, 2).double().sum().cpu()
        assert abs(float(got - want.sum())) <= 1e-5 * float(want.abs().sum()), i


@pytest.mark.gpu
@needs_gpu
def test_rows_of_every_variant_are_checked_and_ok():
    # 4093 tokens (not a multiple of the page or tile) x 2 sequences: 16 MiB of K, one 16 MiB ring slot, so
    # min_chunks 4 / 8 cut it into 4 MiB / 2 MiB chunks
    variants = (*VARIANTS, *ZERO_COPY_OPTIONS)
    rows = bench_decode([4093], [2], variants=variants, repeats=1, target_ms=1.0, ceilings=CEILINGS)
    assert [r["variant"] for r in rows] == [*variants, *ANCHORS]
    assert {r["variant"]: r.get("stream_chunks") for r in rows if r["variant"].startswith("stream")} == {
        "stream": 1, "stream:4chunks": 4, "stream:8chunks": 8, "stream:layers": 1}
    for r in rows:
        assert r["status"] == "ok" and r["time_ms"] > 0 and r["link_gbps"] > 0, r
        if r["variant"] in variants:
            assert r["rel_err"] < 1e-2, r
            assert r["link_read_bytes"] >= r["kv_bytes"] * (4 if r["variant"] == "naive" else 1) * 0.99, r


@pytest.mark.gpu
@needs_gpu
def test_min_chunks_cuts_a_one_slot_cache_into_overlapping_chunks():
    from directkv.kernels.cuda.stream_plan import plan_stream
    from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
    from directkv.kernels.paged import PagedKV

    pages, shape = 256, (16, 8, 128)  # 4096 tokens of Llama-3.1-8B K: 8 MiB, one 16 MiB ring slot
    host = pinned_empty((pages, *shape), torch.bfloat16)
    view = device_view(host)
    empty = torch.empty((0, *shape), dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages, device="cuda", dtype=torch.int64).to(torch.int32).view(1, pages)
    kv = PagedKV(view, view, empty, empty, table, torch.tensor([4093], dtype=torch.int32, device="cuda"))
    assert len(plan_stream(kv).copies) == 1
    assert len(plan_stream(kv, **VARIANTS["stream:4chunks"]).copies) == 4
    assert len(plan_stream(kv, **VARIANTS["stream:8chunks"]).copies) == 4  # not below 2 MiB a chunk


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name, queues", [("stream", [1] * 5), ("stream:layers", [5])])
def test_stream_layers_rows_queue_a_repeats_calls_and_the_others_do_not(name, queues, monkeypatch):
    # a repeat of 5 calls: stream:layers queues them once, up front (so call i + 1's copies go behind call i's
    # kernel, not after it); plain stream starts a queue of its own in every call
    from directkv.kernels.cuda import decode_attention as dec
    from directkv.kernels.cuda.bench_decode import _calls, _Point
    from directkv.kernels.cuda.zero_copy import pinned_empty

    made = []
    real = dec._set_queue
    monkeypatch.setattr(dec, "_set_queue", lambda plan, queue: (made.append(len(queue)), real(plan, queue))[1])
    gen = torch.Generator(device="cuda").manual_seed(1)
    arena = pinned_empty((2 * 256 * 16 * 8 * 128 * 2,), torch.uint8)
    point = _Point(arena, 4093, 1, 1, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                   page_size=16, page_order="random", gen=gen)
    call, _, _ = _calls(point, name, {"tile_kv": 64, "num_splits": None})
    outs = []
    for i in range(5):
        point.q.normal_()  # fresh inputs per call: an output left from the call before would fail
        ref = point.reference()
        outs.append((call(i, 5).float().clone(), ref))
    for out, ref in outs:
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert made == queues
