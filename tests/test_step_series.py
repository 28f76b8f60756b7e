"""A measured run's per-step times, written beside its results (write_step_series): one row per step of the
serve call, in order, whose means are the row's."""

import pandas as pd
import pytest
from test_experiments import _compose
from test_gpu_executor import SCHED, SPEC, _requests

from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import SystemPolicy
from experiments.run import run_experiment


def test_a_measured_run_writes_one_row_per_step(tmp_path):
    mem = MemoryConfig(hbm_budget_bytes=2e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    requests = _requests()
    path = tmp_path / "steps" / "directkv-tiled-toy.parquet"
    res, extra = run_gpu(requests, SystemPolicy("directkv", "tiled"), SPEC, mem=mem, sched_cfg=SCHED, device="cpu",
                         steps_path=path)
    steps = pd.read_parquet(path)
    assert list(steps.columns) == ["step", "decodes", "prompt_tokens", "device_ms", "host_queue_ms", "host_plan_ms"]
    assert len(steps) == res.steps and list(steps["step"]) == list(range(res.steps))
    # every prompt token was prefilled once, every output token but each request's first came from a decode
    assert steps["prompt_tokens"].sum() == sum(r.prompt_len for r in requests)
    assert steps["decodes"].sum() == sum(r.output_len - 1 for r in requests)
    assert steps["device_ms"].mean() == pytest.approx(extra["step_ms_mean"])
    assert steps["host_queue_ms"].mean() == pytest.approx(extra["host_queue_ms_mean"])
    assert (steps["host_plan_ms"] > 0).all()


def test_a_simulated_sweep_writes_no_step_series(tmp_path):
    cfg = _compose(["+exp=context_sweep", "run_id=t", "progress=false", "render=false", "device=cpu",
                    "contexts=[1024]", "batch_size=2", "output_len=4", "system.names=[directkv]"])
    run_experiment(cfg, tmp_path / "t")
    assert not (tmp_path / "t" / "steps").exists()
