"""executor.directkv_no_past_prefill=sdpa (the default): a directkv prompt chunk with no past (a request's first
chunk) attended by one SDPA call over its own K/V, which are the projection's output in HBM, instead of directkv's
kernel (=kernel). Checked on the CPU: read, validated and recorded (setup, simulate, run_gpu before any work); in
serving only chunks with no past take SDPA and the outputs match the kernel path; simulated as one FlashAttention
call plus the chunk's store to the host tier. The GPU tests passed on the H200 (2c1bb69, 2026-12-02)."""

import pandas as pd
import pytest
import torch
from test_experiments import _compose
from test_gpu_executor import SCHED, SPEC, _requests, _serve, runner  # noqa: F401 - runner is a fixture
from test_hbm_prefill_sim import CM, LLAMA, _step

import directkv.engine.gpu.paths as paths
import directkv.engine.gpu.stepper as stepper
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.systems import Pipelining, SystemPolicy, step_cost
from directkv.errors import ConfigError
from directkv.specs import get_model
from experiments.common import setup
from experiments.run import run_experiment

MEM = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
BAD = r"unknown executor.directkv_no_past_prefill 'flash'; valid: kernel, sdpa"


def test_setup_reads_and_checks_the_option():
    assert setup(_compose(["run_id=t", "device=cpu"])).no_past_prefill == "sdpa"
    on = ["run_id=t", "device=cpu", "executor.directkv_no_past_prefill=sdpa"]
    assert setup(_compose(on)).no_past_prefill == "sdpa"
    with pytest.raises(ConfigError, match=BAD):
        setup(_compose(["run_id=t", "device=cpu", "executor.directkv_no_past_prefill=flash"]))


def test_simulate_and_run_gpu_refuse_a_bad_value_before_any_work(monkeypatch):
    import directkv.engine.gpu.executor as executor

    def no_work(*args, **kwargs):
        raise AssertionError("the model runner was built before the option was checked")

    monkeypatch.setattr(executor, "runner_for", no_work)
    with pytest.raises(ConfigError, match=BAD):
        simulate(_requests(), SystemPolicy("directkv", "tiled"), SPEC, CM, mem=MEM, sched_cfg=SCHED,
                 no_past_prefill="flash")
    with pytest.raises(ConfigError, match=BAD):
        run_gpu(_requests(), SystemPolicy("directkv", "tiled"), SPEC, mem=MEM, sched_cfg=SCHED, device="cpu",
                no_past_prefill="flash")


@pytest.mark.parametrize("variant", ["tiled", "naive"])
def test_serving_sends_only_chunks_with_no_past_to_sdpa_and_matches_the_kernel(runner, variant, monkeypatch):  # noqa: F811
    calls = []
    real_chunk = paths.sdpa_chunk
    monkeypatch.setattr(paths, "sdpa_chunk", lambda *a: calls.append(a[6]) or real_chunk(*a))
    policy, reqs = SystemPolicy("directkv", variant), _requests()
    assert max(r.prompt_len for r in reqs) > SCHED.max_batched_tokens  # so some chunks have a past
    _, ref = _serve(policy, runner, reqs, no_past_prefill="kernel")
    assert not calls
    res, got = _serve(policy, runner, reqs, no_past_prefill="sdpa")
    assert calls and set(calls) == {0}  # every first chunk, and nothing with a past (that is in host memory)
    assert res.metrics["completed"] == len(reqs) and got.outputs == ref.outputs
    for a, b in zip(got.outs, ref.outs, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_pipelined_serving_sends_its_chunk_part_first_chunks_to_sdpa_too(runner, monkeypatch):  # noqa: F811
    calls = []
    real_chunk = paths.sdpa_chunk
    monkeypatch.setattr(paths, "sdpa_chunk", lambda *a: calls.append(a[6]) or real_chunk(*a))
    policy, reqs, pipelining = SystemPolicy("directkv", "tiled"), _requests(), Pipelining(True, None, 0.0, True)
    _, ref = _serve(policy, runner, reqs, pipelining=pipelining, no_past_prefill="kernel")
    assert not calls
    _, got = _serve(policy, runner, reqs, pipelining=pipelining, no_past_prefill="sdpa")
    assert calls and set(calls) == {0} and got.outputs == ref.outputs
    for a, b in zip(got.outs, ref.outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_other_systems_paths_keep_the_kernel_for_it():
    from test_gpu_executor import _kv

    for name in ("hbm", "swap", "cpu_attn", "flexgen"):
        policy = SystemPolicy(name)
        path = stepper.make_path(policy, _kv(policy, _requests()), torch.device("cpu"), directkv_side_ctas=None,
                                 no_past_prefill="sdpa")
        assert path.no_past_prefill == "kernel"  # their chunks' K/V are in HBM: executor.hbm_prefill decides


@pytest.mark.parametrize("variant", ["tiled", "stream"])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "opt-13b"])
def test_a_first_chunk_alone_is_cheaper_by_sdpa_in_the_simulation(variant, model):
    # OPT-13B: an 8K chunk's store to the host (3.2 ms a layer) is as long as its attention; charged before the
    # attention on both paths (sm_store_time), as the executor stores it
    policy, spec = SystemPolicy("directkv", variant), get_model(model)
    step = _step(0, [(8192, 0)])
    kernel, sdpa = (step_cost(policy, step, spec, CM, no_past_prefill=n) for n in ("kernel", "sdpa"))
    assert sdpa.time_s < kernel.time_s


def test_the_pipelined_simulation_takes_the_option():
    # the chunk part of a mixed step cut at its last decode (Pipelining.cut): four 4K decodes, a first 8K chunk
    policy, pipelining = SystemPolicy("directkv", "tiled"), Pipelining(True, None, 0.0, True)
    step = _step(0, [(8192, 0)])
    step = type(step)(tuple(_step(4, []).decodes), step.prefills)
    kernel, sdpa = (step_cost(policy, step, LLAMA, CM, pipelining, no_past_prefill=n) for n in ("kernel", "sdpa"))
    one_batch = step_cost(policy, step, LLAMA, CM, no_past_prefill="sdpa")
    assert sdpa.time_s != kernel.time_s and sdpa.time_s != one_batch.time_s  # pipelined, and with SDPA
    assert sdpa.traffic.link_write_bytes == kernel.traffic.link_write_bytes


@pytest.mark.parametrize("variant", ["tiled", "stream"])
def test_the_simulation_charges_a_first_chunk_as_one_flash_call_and_its_store(variant):
    # Llama-3.1-8B, a first 8K-token chunk alone (OPT-13B's such steps: the kernel 112-117 ms behind swap's SDPA on
    # the H200), and beside two 4K decodes: the same link bytes either way; a chunk with a past costs the same
    policy = SystemPolicy("directkv", variant)
    alone, first, later = _step(0, [(8192, 0)]), _step(2, [(8192, 0)]), _step(2, [(2048, 8192)])
    kernel, sdpa = (step_cost(policy, alone, LLAMA, CM, no_past_prefill=n) for n in ("kernel", "sdpa"))
    assert sdpa.time_s < kernel.time_s
    for step in (alone, first):
        kernel, sdpa = (step_cost(policy, step, LLAMA, CM, no_past_prefill=n) for n in ("kernel", "sdpa"))
        assert sdpa.traffic.link_read_bytes == kernel.traffic.link_read_bytes  # no past: no host reads of it
        assert sdpa.traffic.link_write_bytes == kernel.traffic.link_write_bytes  # the chunk's store stays
    same = [step_cost(policy, later, LLAMA, CM, no_past_prefill=n) for n in ("kernel", "sdpa")]
    assert same[0].time_s == same[1].time_s and same[0].traffic == same[1].traffic


def test_rows_say_what_attended_their_first_chunks(tmp_path):
    cfg = _compose(["+exp=context_sweep", "run_id=np", "progress=false", "render=false", "device=cpu",
                    "contexts=[8192]", "batch_size=2", "output_len=4", "system.names=[directkv,hbm]",
                    "executor.directkv_no_past_prefill=sdpa"])
    rows = pd.read_parquet(run_experiment(cfg, tmp_path / "np")).set_index("system")
    assert rows.loc["directkv", "directkv_no_past_prefill"] == "sdpa"
    assert pd.isna(rows.loc["hbm", "directkv_no_past_prefill"])


def test_resimulate_leaves_the_column_out_for_a_run_from_before_the_key():
    from test_compare import H200

    from experiments.resimulate import resimulate

    rows = resimulate(H200.parent / "context_sweep" / "20261202-150851-1")
    assert "directkv_no_past_prefill" not in rows.columns


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["tiled", "stream"])
def test_directkv_serves_its_first_chunks_with_sdpa_on_the_gpu(variant, monkeypatch):
    calls = []
    real_chunk = paths.sdpa_chunk
    monkeypatch.setattr(paths, "sdpa_chunk", lambda *a: calls.append(a[6]) or real_chunk(*a))
    # stream: every chunk with a past streamed through the prompt ring (the toy pasts are below the in-place limit),
    # so first chunks by SDPA and streamed chunks share steps
    monkeypatch.setattr(paths, "stream_reads_in_place", lambda past, new, ps, page: past == 0)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy("directkv", variant), SPEC, mem=MEM, sched_cfg=SCHED,
                             device="cuda", cuda_graphs=True, no_past_prefill="sdpa")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["directkv_no_past_prefill"] == "sdpa"
    assert calls and set(calls) == {0}
