"""A measured run's per-step times, written beside its results (write_step_series, steps_file): one row per
step of the serve call, in order, whose means are the row's; a sweep's measured points write them, a failed
attempt leaves none behind, and a failed write leaves the measurement."""

import dataclasses

import pandas as pd
import pytest
from test_experiments import _compose
from test_gpu_executor import SCHED, SPEC, _requests

import directkv.engine.gpu.executor as executor
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import SystemPolicy
from experiments.common import setup
from experiments.serving import serve_point, steps_file

MEM = MemoryConfig(hbm_budget_bytes=2e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)


def test_a_measured_run_writes_one_row_per_step(tmp_path):
    requests = _requests()
    path = tmp_path / "steps" / "directkv-tiled-toy.parquet"
    res, extra = run_gpu(requests, SystemPolicy("directkv", "tiled"), SPEC, mem=MEM, sched_cfg=SCHED, device="cpu",
                         steps_path=path)
    steps = pd.read_parquet(path)
    assert list(steps.columns) == ["step", "start_s", "decodes", "prompt_tokens", "device_ms", "host_queue_ms",
                                   "host_prep_ms"]
    assert len(steps) == res.steps and list(steps["step"]) == list(range(res.steps))
    assert steps["start_s"].iloc[0] == 0 and steps["start_s"].is_monotonic_increasing
    # every prompt token was prefilled once, every output token but each request's first came from a decode
    assert steps["prompt_tokens"].sum() == sum(r.prompt_len for r in requests)
    assert steps["decodes"].sum() == sum(r.output_len - 1 for r in requests)
    for col in ("device_ms", "host_queue_ms", "host_prep_ms"):
        assert steps[col].mean() == pytest.approx(extra[{"device_ms": "step_ms_mean"}.get(col, f"{col}_mean")])
    assert "steps_file_error" not in extra and not list(path.parent.glob("*.tmp"))


def test_a_failed_write_keeps_the_measurement(tmp_path):
    (tmp_path / "steps").write_text("a file where the folder would go")
    res, extra = run_gpu(_requests(), SystemPolicy("hbm"), SPEC, mem=MEM, sched_cfg=SCHED, device="cpu",
                         steps_path=tmp_path / "steps" / "hbm-toy.parquet")
    assert res.metrics["completed"] == 5 and extra["steps_file_error"].startswith(("FileExistsError", "NotADirectory"))


def _measured(monkeypatch, fail: bool = False):
    """A Setup that measures, with run_gpu on the CPU (or failing), and the tiny model's toy requests."""
    def on_cpu(*args, **kwargs):
        if fail:
            raise RuntimeError("cut")
        return run_gpu(*args, **(kwargs | {"device": "cpu", "cuda_graphs": False}))

    monkeypatch.setattr(executor, "run_gpu", on_cpu)
    s = setup(_compose(["+exp=context_sweep", "run_id=t", "device=cpu", "model=tiny"]))
    return dataclasses.replace(s, device="cuda", mem=MEM, sched=SCHED)


def test_a_measured_point_writes_its_series_where_steps_file_says(monkeypatch, tmp_path):
    s, policy = _measured(monkeypatch), SystemPolicy("directkv", "tiled")
    path = steps_file(tmp_path, policy, "toy")
    assert path == tmp_path / "steps" / "directkv-tiled-toy.parquet"
    rows = serve_point(policy, s, _requests(), {"system": "directkv"}, whole_batch=False, steps_path=path)
    measured = [r for r in rows if r.get("mode") == "measured"]
    assert len(measured) == 1 and measured[0]["status"] == "ok" and measured[0]["completed"] == 5
    assert len(pd.read_parquet(path)) == measured[0]["steps"]


def test_a_failed_attempt_leaves_no_earlier_series(monkeypatch, tmp_path):
    s, policy = _measured(monkeypatch, fail=True), SystemPolicy("hbm")
    path = steps_file(tmp_path, policy, "toy")
    path.parent.mkdir()
    path.write_text("an earlier, cut attempt's")
    rows = serve_point(policy, s, _requests(), {"system": "hbm"}, whole_batch=False, steps_path=path)
    assert [r["status"] for r in rows if r.get("mode") == "measured"] == ["error"] and not path.exists()
