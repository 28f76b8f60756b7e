"""executor.directkv_stream_slots (here with 16 MiB decode ring slots, executor.directkv_stream_chunk_mib=16, so
the decode ring has that many slots): validated at setup and by the simulation (CPU), carried to directkv's path,
simulated (the ring bounds what is copied while the GPU does other work, and is held as staging memory) and recorded on
simulated rows; on the GPU a stream decode ring of that many slots serves the toy requests and is recorded."""

import pandas as pd
import pytest
import torch
from test_experiments import _compose
from test_gpu_executor import SCHED, SPEC, _kv, _requests

from directkv.costmodel import CostModel
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.state import PrefillChunk, ReqState, Step
from directkv.engine.systems import SystemPolicy, step_cost
from directkv.errors import ConfigError
from directkv.kernels.traffic_model import (
    SERVING_STREAM_SLOTS,
    WIDE_KV_BYTES,
    auto_stream_slots,
    prefill_ring_slots,
    stream_ring_bytes,
)
from directkv.specs import get_hardware, get_model
from experiments.common import setup
from experiments.run import run_experiment
from workloads.request import Request


def test_setup_takes_the_slots_and_refuses_fewer_than_two():
    assert setup(_compose(["run_id=t", "device=cpu"])).stream_slots == SERVING_STREAM_SLOTS == 12
    four = ["run_id=t", "device=cpu", "executor.directkv_stream_slots=4", "executor.directkv_stream_chunk_mib=16"]
    assert setup(_compose(four)).stream_slots == 4
    for bad in ("1", "true", "2.5", "four", "AUTO"):
        with pytest.raises(ConfigError, match=r"executor.directkv_stream_slots must be an int >= 2 \(.*\) or 'auto' "
                                              r"\(.*\); got "):
            setup(_compose(["run_id=t", "device=cpu", f"executor.directkv_stream_slots={bad}"]))


@pytest.mark.parametrize("model,slots", [("llama-3.1-8b", 12), ("opt-6.7b", 24), ("opt-13b", 24), ("opt-30b", 24)])
def test_auto_slots_follow_the_models_kv_bytes_per_token(model, slots):
    """auto (the config's default): 12 slots for a GQA model's 4 KiB of K/V per token per layer, 24 for the OPT
    models' 16-28 KiB; an explicit count wins whatever the model."""
    assert setup(_compose(["run_id=t", "device=cpu", f"model={model}"])).stream_slots == slots
    assert setup(_compose(["run_id=t", "device=cpu", f"model={model}", "executor.directkv_stream_slots=auto"])).stream_slots == slots
    assert setup(_compose(["run_id=t", "device=cpu", f"model={model}", "executor.directkv_stream_slots=16"])).stream_slots == 16


def test_auto_slots_switch_at_eight_kib():
    assert auto_stream_slots(WIDE_KV_BYTES) == SERVING_STREAM_SLOTS
    assert auto_stream_slots(WIDE_KV_BYTES + 2) == 2 * SERVING_STREAM_SLOTS
    assert get_model("llama-3.1-8b").kv_bytes_per_token_per_layer() <= WIDE_KV_BYTES < min(
        get_model(m).kv_bytes_per_token_per_layer() for m in ("opt-6.7b", "opt-13b", "opt-30b"))


def test_profile_cli_resolves_auto_and_refuses_a_bad_count(capsys):
    from directkv.engine.gpu import profile

    seen = {}
    def fake(system, **kwargs):
        seen["slots"] = kwargs["stream_slots"]
    orig, profile.profile = profile.profile, fake
    try:
        assert profile.main(["--system", "directkv", "--model", "opt-13b"]) == 0 and seen["slots"] == 24
        assert profile.main(["--system", "directkv", "--stream-slots", "6"]) == 0 and seen["slots"] == 6
        assert profile.main(["--system", "directkv", "--stream-slots", "1"]) == 2
    finally:
        profile.profile = orig
    assert "--stream-slots must be an int >= 2" in capsys.readouterr().err


def test_make_path_gives_directkv_its_slots():
    from directkv.engine.gpu.stepper import make_path

    policy = SystemPolicy("directkv", "tiled")
    path = make_path(policy, _kv(policy, _requests()), torch.device("cpu"), directkv_side_ctas=None, stream_slots=4,
                     stream_chunk_mib=16)
    assert path.stream_slots == path.decode_slots == 4


def test_run_gpu_refuses_bad_slots_before_any_work():
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    with pytest.raises(ConfigError, match=r"stream_slots \(executor.directkv_stream_slots\) must be an int >= 2 \(.*\); got 1"):
        run_gpu(_requests(), SystemPolicy("directkv", "tiled"), SPEC, mem=mem, sched_cfg=SCHED, device="cpu",
                stream_slots=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_four_slot_ring_serves_and_is_recorded(monkeypatch):
    import directkv.engine.gpu.paths as paths

    plan_stream, rings = paths.plan_stream, []

    def recording(*args, **kwargs):
        plan = plan_stream(*args, **kwargs)
        rings.append(plan.ring_k.shape[0])
        return plan

    monkeypatch.setattr(paths, "plan_stream", recording)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy("directkv", "stream"), SPEC, mem=mem, sched_cfg=SCHED,
                             device="cuda", cuda_graphs=True, stream_slots=4, stream_chunk_mib=16)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["directkv_stream_slots"] == 4
    assert rings and set(rings) == {4}


def test_the_simulation_prefetches_as_much_as_the_decode_ring_holds():
    # Llama-3.1-8B, two 16K decodes beside a 2,046-token prompt chunk of a 12K past, the step measured on the
    # H200 (seventeenth session): a layer's decode K/V is 128 MiB, of which 2 slots (64 MiB) can be copied while
    # the GPU does the dense work and the chunk's attention, 8 slots (256 MiB) all. Measured: 1.10-1.36x swap's
    # time with 2 slots, 0.98x with 8.
    model, cm = get_model("llama-3.1-8b"), CostModel.for_hardware(get_hardware("h200-pcie5"))
    decodes = tuple(ReqState(Request(i, 16384, 8), prefilled=16384, generated=1) for i in range(2))
    step = Step(decodes, (PrefillChunk(ReqState(Request(2, 16384, 8), prefilled=12288), 2046, 12288),))
    policy = SystemPolicy("directkv", "stream")
    two, four, eight = (step_cost(policy, step, model, cm, stream_slots=n, stream_chunk_mib=16) for n in (2, 4, 8))
    swap = step_cost(SystemPolicy("swap"), step, model, cm)
    assert eight.time_s <= four.time_s < 0.8 * two.time_s  # 4 slots hold all but the two new tokens' K/V
    assert two.time_s > 1.1 * swap.time_s and eight.time_s < 1.05 * swap.time_s
    assert eight.staging_bytes - two.staging_bytes == 6 * (32 << 20)


@pytest.mark.parametrize("chunk_len", [2048, 8192])
def test_a_chunk_past_beyond_its_ring_is_read_while_its_math_runs(chunk_len):
    # one prompt chunk over a 64K past (256 MiB of K/V per layer, four times its ring): the copy engine streams
    # the rest of it while the chunk's attention computes, as swap's copies overlap compute, so neither is
    # charged the link after the math
    model, cm = get_model("llama-3.1-8b"), CostModel.for_hardware(get_hardware("h200-pcie5"))
    step = Step((), (PrefillChunk(ReqState(Request(0, 65536 + chunk_len, 8), prefilled=65536), chunk_len, 65536),))
    stream, swap = (step_cost(SystemPolicy(*p), step, model, cm) for p in (("directkv", "stream"), ("swap",)))
    assert stream.time_s < 1.05 * swap.time_s


def test_a_prefill_ring_takes_a_slot_per_chunk_between_two_and_the_slots_given():
    assert [prefill_ring_slots(chunks, 8) for chunks in (0, 1, 2, 5, 8, 11)] == [2, 2, 2, 5, 8, 8]
    assert prefill_ring_slots(11, 2) == 2 and prefill_ring_slots(3, 4) == 3


def test_the_simulation_copies_a_long_past_ahead_into_a_deeper_chunk_ring():
    # OPT-13B 3 x 16K, the step measured on the H200 (nineteenth session): a prompt's 3-token tail over a
    # 16,381-token past (1,024 pages of 160 KiB of K per layer, cut into 11 ring chunks of 102 pages) beside the
    # next prompt's 8,189-token first chunk. With 2 slots 2 chunks are copied during the big chunk's dense work and
    # 9 inside the attention; with 8 slots 8 ahead and 3 inside. Measured with 2 slots: ~1,075 ms against swap's ~715.
    model, cm = get_model("opt-13b"), CostModel.for_hardware(get_hardware("h200-pcie5"))
    tail = PrefillChunk(ReqState(Request(0, 16384, 8), prefilled=16381), 3, 16381)
    first = PrefillChunk(ReqState(Request(1, 16384, 8), prefilled=0), 8189, 0)
    step = Step((), (tail, first))
    two, four, eight = (step_cost(SystemPolicy("directkv", "stream"), step, model, cm, stream_slots=n,
                                  stream_chunk_mib=16) for n in (2, 4, 8))
    assert two.time_s > four.time_s > eight.time_s
    # no decodes: the staging is the chunk's ring alone, 16 MiB of K and of V per slot
    assert [c.staging_bytes for c in (two, four, eight)] == [n * 2 * (16 << 20) for n in (2, 4, 8)]


def test_simulated_stream_rows_say_how_many_slots_and_hold_their_ring(tmp_path):
    def row(slots: int):
        cfg = _compose(["+exp=context_sweep", f"run_id=s{slots}", "progress=false", "render=false", "device=cpu",
                        "contexts=[16384]", "batch_size=4", "output_len=4", "system.names=[directkv,hbm]",
                        "system.directkv_variant=stream", f"executor.directkv_stream_slots={slots}",
                        "executor.directkv_stream_chunk_mib=16"])
        return pd.read_parquet(run_experiment(cfg, tmp_path / str(slots))).set_index("system")

    two, eight = row(2), row(8)
    assert two.loc["directkv", "directkv_stream_slots"] == 2 and eight.loc["directkv", "directkv_stream_slots"] == 8
    assert pd.isna(eight.loc["hbm", "directkv_stream_slots"])
    grown = (eight.loc["directkv", "gpu_mem_gb"] - two.loc["directkv", "gpu_mem_gb"]) * 1e9
    assert grown == pytest.approx(6 * (32 << 20), rel=1e-6)


def test_a_ring_is_sized_to_its_read_between_a_floor_and_its_cap():
    mib = 1 << 20
    assert stream_ring_bytes(8) == 256 * mib and stream_ring_bytes(2) == 64 * mib  # the caps
    assert stream_ring_bytes(8, 0) == 0
    assert stream_ring_bytes(8, 2 * mib) == 2 * 8 * 2 * mib  # a 1 MiB K read still gets 2 MiB slots
    assert stream_ring_bytes(2, 2 * mib, floor=0) == 2 * 2 * mib  # a prefill ring has no floor
    assert stream_ring_bytes(8, 20 * mib) == 2 * 8 * 10 * mib
    assert stream_ring_bytes(8, 1 << 40) == 256 * mib


def test_the_simulation_refuses_a_bad_slot_count():
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    cm = CostModel.for_hardware(get_hardware("h200-pcie5"))
    with pytest.raises(ConfigError, match=r"stream_slots must be an int >= 2 \(.*\); got 1"):
        simulate(_requests(), SystemPolicy("directkv", "stream"), SPEC, cm, mem=mem, sched_cfg=SCHED, stream_slots=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pass_kernel", ["flash", "tiled"])
def test_a_prefill_ring_of_more_slots_prefetches_as_many_chunks_and_stays_exact(pass_kernel):
    """A chunk's past of ~16 ring chunks through rings of 5 and 2 slots: the prefetch copies one chunk per slot,
    every call (over two layers' pools, prefetched or not) matches float64 with its output poisoned, and a kept
    ring is reused while it has the slots, replaced by a deeper one (never shallower) when not."""
    import math

    from test_cuda_prefill import BF16, assert_matches, dense_reference, make_inputs, page_bytes_of, to_gpu

    from directkv.kernels.cuda.prefill_attention import prefill_attention
    from directkv.kernels.cuda.prefill_stream import (
        plan_prefill_stream,
        prefetch_prefill_stream,
        prefill_ring,
    )
    from directkv.kernels.paged import PagedKV

    q, k_new, v_new, kv_cpu, kv = make_inputs((77, 1001, 8, 2, 128, BF16, 16), hbm_fraction=0.25)
    other_cpu = PagedKV(torch.randn_like(kv_cpu.host_k.float()).to(BF16), torch.randn_like(kv_cpu.host_v.float()).to(BF16),
                        kv_cpu.hbm_k, kv_cpu.hbm_v, kv_cpu.block_table, kv_cpu.seq_lens)
    layers = {"a": (kv_cpu, kv), "b": (other_cpu, to_gpu(other_cpu))}
    plan = plan_prefill_stream(kv, chunk_bytes=3 * page_bytes_of(kv_cpu))
    chunks = sum(p.ring for p in plan.passes)
    assert chunks > 5
    for slots in (5, 2):
        ring = prefill_ring(plan, kv.host_k, "cuda", slots=slots)
        assert ring.slots == slots and ring.ring_k.shape[:2] == (slots, 3)
        for ahead, layer in (("a", "a"), ("b", "a"), (None, "b"), ("b", "b")):
            if ahead is not None:
                assert prefetch_prefill_stream(plan, ring, *(layers[ahead][1].host_k, layers[ahead][1].host_v)) == slots
            cpu, gpu = layers[layer]
            q = torch.randn_like(q)
            out = torch.full_like(q, math.nan)
            prefill_attention(q, k_new, v_new, gpu, variant="stream", out=out, stream_plan=plan, stream_ring=ring,
                              pass_kernel=pass_kernel)
            assert_matches(out, dense_reference(q, k_new, v_new, cpu, causal=True, scale=1 / math.sqrt(128)))
    five = prefill_ring(plan, kv.host_k, "cuda", slots=5)
    assert prefill_ring(plan, kv.host_k, "cuda", reuse=five, slots=3) is five  # enough slots: kept
    two = prefill_ring(plan, kv.host_k, "cuda")
    deeper = prefill_ring(plan, kv.host_k, "cuda", reuse=two, slots=6)
    assert deeper.slots == 6 and two.ring_k is None
    one_chunk = plan_prefill_stream(kv)  # the whole past in one chunk: two slots, whatever the slots allowed
    assert prefill_ring(one_chunk, kv.host_k, "cuda", slots=8).slots == 2
    # a ring replaced for its pages keeps its slots
    assert prefill_ring(one_chunk, kv.host_k, "cuda", reuse=deeper, slots=8).slots == 6
