"""executor.directkv_stream_chunk_mib: the K per slot of directkv stream's decode ring, which keeps the HBM
executor.directkv_stream_slots gives it (slots x 32 MiB of K and V). Validated at setup, by the simulation and by
the GPU executor (CPU); carried to the path (the slots and slot size plan_stream gets) and to the rows, measured and
simulated; simulated as the ring's size; on the GPU a decode ring of that cut serves the toy requests."""

import pandas as pd
import pytest
import torch
from test_experiments import _compose
from test_gpu_executor import SCHED, SPEC, _kv, _requests

from directkv.costmodel import CostModel
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.state import ReqState, Step
from directkv.engine.systems import SystemPolicy, step_cost
from directkv.errors import ConfigError
from directkv.kernels.traffic_model import SERVING_STREAM_CHUNK_MIB, decode_ring, stream_ring_bytes
from directkv.specs import get_hardware, get_model
from experiments.common import setup
from experiments.run import run_experiment
from workloads.request import Request

MIB = 1 << 20
MEM = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)


def test_the_default_cuts_twelve_slots_of_hbm_into_three_of_64_mib():
    assert SERVING_STREAM_CHUNK_MIB == 64
    assert decode_ring(12, 64) == (3, 64 * MIB) and decode_ring(12, 16) == (12, 16 * MIB)
    assert decode_ring(12, 50) == (3, 50 * MIB)  # what does not divide leaves the rest of the HBM unused
    assert decode_ring(2, 16) == (2, 16 * MIB) and decode_ring(4, 2) == (32, 2 * MIB)


def test_setup_takes_the_chunk_and_refuses_what_leaves_fewer_than_two_slots():
    assert setup(_compose(["run_id=t", "device=cpu"])).stream_chunk_mib == 64
    cfg = ["run_id=t", "device=cpu", "executor.directkv_stream_slots=4", "executor.directkv_stream_chunk_mib=32"]
    assert setup(_compose(cfg)).stream_chunk_mib == 32
    for slots, bad, high in ((12, "97", 96), (12, "1", 96), (12, "true", 96), (12, "2.5", 96), (12, "null", 96),
                             (12, "four", 96), (4, "64", 32), (2, "17", 16)):
        with pytest.raises(ConfigError, match=rf"executor.directkv_stream_chunk_mib must be an int in 2\.\.{high} "
                                              rf"\(.*\); got "):
            setup(_compose(["run_id=t", "device=cpu", f"executor.directkv_stream_slots={slots}",
                            f"executor.directkv_stream_chunk_mib={bad}"]))


def test_the_simulation_and_the_gpu_executor_refuse_a_bad_chunk_before_any_work(monkeypatch):
    import directkv.engine.gpu.executor as executor

    def no_work(*args, **kwargs):
        raise AssertionError("the model runner was built before the chunk was checked")

    monkeypatch.setattr(executor, "runner_for", no_work)  # the executor's first work: the runner, then pinning
    cm = CostModel.for_hardware(get_hardware("h200-pcie5"))
    with pytest.raises(ConfigError, match=r"stream_chunk_mib must be an int in 2\.\.16 \(.*\); got 64"):
        simulate(_requests(), SystemPolicy("directkv", "stream"), SPEC, cm, mem=MEM, sched_cfg=SCHED, stream_slots=2)
    with pytest.raises(ConfigError, match=r"stream_chunk_mib \(executor.directkv_stream_chunk_mib\) must be an int "
                                          r"in 2\.\.96 \(.*\); got 0"):
        run_gpu(_requests(), SystemPolicy("directkv", "tiled"), SPEC, mem=MEM, sched_cfg=SCHED, device="cpu",
                stream_chunk_mib=0)


def test_make_path_cuts_the_decode_ring_as_asked():
    from directkv.engine.gpu.stepper import make_path

    policy = SystemPolicy("directkv", "tiled")
    kv = _kv(policy, _requests())
    default = make_path(policy, kv, torch.device("cpu"), directkv_side_ctas=None)
    assert (default.stream_slots, default.decode_slots, default.decode_chunk_bytes) == (12, 3, 64 * MIB)
    path = make_path(policy, kv, torch.device("cpu"), directkv_side_ctas=None, stream_slots=8, stream_chunk_mib=16)
    assert (path.stream_slots, path.decode_slots, path.decode_chunk_bytes) == (8, 8, 16 * MIB)


def test_the_simulated_ring_holds_the_cut_slots():
    # Llama-3.1-8B, four decodes: at 256 tokens (2 MiB of K per layer) each slot holds the read, so 3 slots hold a
    # quarter of what 12 did; at 32K (256 MiB of K) every slot is full and both cuts hold the same 384 MiB. The
    # time differs only by the launches of the decodes' kernel per ring chunk: one chunk either way at 256, 5
    # against 17 per layer at 32K (H200, 2026-12-02: stream's step 2.7 ms shorter with 64 MiB slots there)
    model, cm = get_model("llama-3.1-8b"), CostModel.for_hardware(get_hardware("h200-pcie5"))
    kvl = model.kv_bytes_per_token_per_layer()
    policy = SystemPolicy("directkv", "stream")
    for context in (256, 32768):
        step = Step(tuple(ReqState(Request(i, context, 8), prefilled=context, generated=1) for i in range(4)), ())
        three, twelve = (step_cost(policy, step, model, cm, stream_chunk_mib=m) for m in (64, 16))
        read = sum(step.decode_kv_lens) * kvl
        assert three.staging_bytes == stream_ring_bytes(3, read, chunk_bytes=64 * MIB)
        assert twelve.staging_bytes == stream_ring_bytes(12, read)
        launches = 0 if context == 256 else (17 - 5) * model.num_layers * cm.hw.launch_us * 1e-6
        assert twelve.time_s - three.time_s == pytest.approx(launches, abs=1e-12)
        if context == 256:
            assert 4 * three.staging_bytes == twelve.staging_bytes
        else:
            assert three.staging_bytes == twelve.staging_bytes == 384 * MIB


def test_rows_say_how_the_decode_ring_was_cut(tmp_path):
    def rows(chunk: int):
        cfg = _compose(["+exp=context_sweep", f"run_id=c{chunk}", "progress=false", "render=false", "device=cpu",
                        "contexts=[1024]", "batch_size=4", "output_len=4", "system.names=[directkv,hbm]",
                        "system.directkv_variant=stream", f"executor.directkv_stream_chunk_mib={chunk}"])
        return pd.read_parquet(run_experiment(cfg, tmp_path / str(chunk))).set_index("system")

    sixteen, sixty_four = rows(16), rows(64)
    assert sixteen.loc["directkv", "directkv_stream_chunk_mib"] == 16
    assert sixty_four.loc["directkv", "directkv_stream_chunk_mib"] == 64
    assert pd.isna(sixty_four.loc["hbm", "directkv_stream_chunk_mib"])
    # 1K decodes read < 16 MiB of K per layer: slots sized to the read, 12 of them against 3
    assert sixteen.loc["directkv", "gpu_mem_gb"] > sixty_four.loc["directkv", "gpu_mem_gb"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_mib,slots", [(64, 3), (16, 12)])
def test_a_decode_ring_of_the_cut_serves_and_is_recorded(monkeypatch, chunk_mib, slots):
    import directkv.engine.gpu.paths as paths

    plan_stream, rings = paths.plan_stream, []

    def recording(*args, **kwargs):
        plan = plan_stream(*args, **kwargs)
        rings.append((plan.ring_k.shape[0], kwargs["chunk_bytes"]))
        return plan

    monkeypatch.setattr(paths, "plan_stream", recording)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy("directkv", "stream"), SPEC, mem=MEM, sched_cfg=SCHED,
                             device="cuda", cuda_graphs=True, stream_chunk_mib=chunk_mib)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5
    assert extra["directkv_stream_slots"] == 12 and extra["directkv_stream_chunk_mib"] == chunk_mib
    assert rings and set(rings) == {(slots, chunk_mib * MIB)}
