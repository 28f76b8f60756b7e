"""executor.warmup_pass: before each system's first measured point of a process, that point's requests are served
once, unmeasured, by the system; its later points are not; a failing pass does not stop the point; measured rows
say whether the process was warm for the system (process_warm); the simulation never serves anything."""

import dataclasses

import pytest
from test_experiments import _compose
from test_gpu_executor import SCHED, _requests

import directkv.engine.gpu.executor as executor
import experiments.serving as serving
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import SystemPolicy
from directkv.errors import ConfigError
from experiments.common import setup
from experiments.serving import serve_point

MEM = MemoryConfig(hbm_budget_bytes=2e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)


@pytest.fixture
def calls(monkeypatch):
    """A fresh process (nothing served yet) whose run_gpu runs on the CPU and logs (system, steps_path, n)."""
    log = []

    def on_cpu(requests, policy, *args, **kwargs):
        log.append((policy.name, kwargs.get("steps_path"), len(requests)))
        return run_gpu(requests, policy, *args, **(kwargs | {"device": "cpu", "cuda_graphs": False}))

    monkeypatch.setattr(executor, "run_gpu", on_cpu)
    monkeypatch.setattr(serving, "_served", set())
    return log


def measuring(*overrides):
    s = setup(_compose(["+exp=context_sweep", "run_id=t", "device=cpu", "model=tiny", *overrides]))
    return dataclasses.replace(s, device="cuda", mem=MEM, sched=SCHED)


def measured_row(rows):
    (row,) = [r for r in rows if r.get("mode") == "measured"]
    return row


def test_each_systems_first_point_is_served_once_unmeasured_before_it_is_measured(calls, tmp_path, capsys):
    s, requests = measuring(), _requests()
    first = serve_point(SystemPolicy("swap"), s, requests, {}, whole_batch=False, steps_path=tmp_path / "a.parquet")
    second = serve_point(SystemPolicy("hbm"), s, requests, {}, whole_batch=False, steps_path=tmp_path / "b.parquet")
    again = serve_point(SystemPolicy("swap"), s, requests, {}, whole_batch=False, steps_path=tmp_path / "c.parquet")
    # a pass per system (its first point's requests, no step series), then each point measured once
    assert calls == [("swap", None, 5), ("swap", tmp_path / "a.parquet", 5), ("hbm", None, 5),
                     ("hbm", tmp_path / "b.parquet", 5), ("swap", tmp_path / "c.parquet", 5)]
    assert all(measured_row(r)["process_warm"] for r in (first, second, again))
    assert measured_row(first)["status"] == "ok" and measured_row(first)["completed"] == 5
    out = capsys.readouterr().out
    assert "warm-up pass: swap, 5 requests" in out and "warm-up pass: hbm, 5 requests" in out


def test_without_the_pass_each_systems_first_row_says_it_was_cold(calls):
    s = measuring("executor.warmup_pass=false")
    assert not s.warmup_pass
    rows = [serve_point(SystemPolicy(name), s, _requests(), {}, whole_batch=False) for name in ("swap", "hbm", "swap")]
    assert [c[0] for c in calls] == ["swap", "hbm", "swap"]
    assert [measured_row(r)["process_warm"] for r in rows] == [False, False, True]


def test_a_failing_pass_is_reported_and_the_point_measured_cold(calls, monkeypatch, capsys, tmp_path):
    def failing(*args, **kwargs):
        raise RuntimeError("warm-up cut")

    real = serving._serve_gpu
    monkeypatch.setattr(serving, "_serve_gpu", lambda p, s, r, w, path: (failing if path is None else real)(p, s, r, w, path))
    row = measured_row(serve_point(SystemPolicy("swap"), measuring(), _requests(), {}, whole_batch=False,
                                   steps_path=tmp_path / "a.parquet"))
    assert row["status"] == "ok" and not row["process_warm"]
    assert "warm-up pass with swap failed (RuntimeError: warm-up cut); measuring cold" in capsys.readouterr().out


def test_a_point_that_cannot_fit_gets_no_pass(calls):
    s = dataclasses.replace(measuring(), mem=dataclasses.replace(MEM, host_budget_bytes=1e3))
    rows = serve_point(SystemPolicy("swap"), s, _requests(), {}, whole_batch=True)
    assert calls == [] and {r["status"] for r in rows} == {"oom"}


def test_the_simulation_serves_nothing(calls):
    s = setup(_compose(["+exp=context_sweep", "run_id=t", "device=cpu", "model=tiny"]))
    rows = serve_point(SystemPolicy("swap"), dataclasses.replace(s, mem=MEM, sched=SCHED), _requests(), {},
                       whole_batch=False)
    assert calls == [] and [r.get("mode") for r in rows] == [None] and "process_warm" not in rows[0]


def test_warmup_pass_must_be_a_bool():
    with pytest.raises(ConfigError, match="executor.warmup_pass must be true or false; got 'maybe'"):
        setup(_compose(["+exp=context_sweep", "run_id=t", "device=cpu", "model=tiny", "executor.warmup_pass=maybe"]))


def test_a_point_that_fails_leaves_the_process_cold_for_the_next(calls, monkeypatch, tmp_path):
    """A measured point that raises (an OOM while pinning, say) may have served nothing: the next point gets the
    pass, and the pass is retried after a pass that failed."""
    real = serving._serve_gpu
    failing = {"hbm"}

    def serve(p, s, r, w, path):
        if p.name in failing:
            raise RuntimeError("CUDA out of memory")
        return real(p, s, r, w, path)

    monkeypatch.setattr(serving, "_serve_gpu", serve)
    s = measuring()
    bad = serve_point(SystemPolicy("hbm"), s, _requests(), {}, whole_batch=False, steps_path=tmp_path / "a.parquet")
    assert measured_row(bad)["status"] == "error" and not serving._served
    good = serve_point(SystemPolicy("swap"), s, _requests(), {}, whole_batch=False, steps_path=tmp_path / "b.parquet")
    # hbm's pass and its point failed (no run_gpu call); swap got its own pass, then its measurement
    assert calls == [("swap", None, 5), ("swap", tmp_path / "b.parquet", 5)]
    assert measured_row(good)["process_warm"] and serving._served == {"swap"}
    # hbm's next point, now able to serve, gets the pass its failed one could not give it
    failing.clear()
    calls.clear()
    again = serve_point(SystemPolicy("hbm"), s, _requests(), {}, whole_batch=False, steps_path=tmp_path / "c.parquet")
    assert calls == [("hbm", None, 5), ("hbm", tmp_path / "c.parquet", 5)] and measured_row(again)["process_warm"]


def test_two_variants_of_a_system_are_two_systems(calls, tmp_path):
    """The pass is per label: directkv tiled and directkv stream run different kernels."""
    s = measuring()
    for i, variant in enumerate(("tiled", "naive", "tiled")):
        serve_point(SystemPolicy("directkv", variant), s, _requests(), {}, whole_batch=False,
                    steps_path=tmp_path / f"{i}.parquet")
    assert [(name, path is None) for name, path, _ in calls] == [("directkv", True), ("directkv", False),
                                                                 ("directkv", True), ("directkv", False),
                                                                 ("directkv", False)]
    assert serving._served == {"directkv-tiled", "directkv-naive"}


def test_a_rerun_serves_again_a_point_whose_measurement_failed(tmp_path):
    """On a GPU a point is done when its measured row is ok or oom; its simulated twin alone does not count. A
    point served again loses its earlier rows first. When simulating, any ok row makes it done."""
    from directkv.results import ResultsWriter
    from experiments.serving import point_done

    row = dict(exp="rate_sweep", system="swap", variant="", model="tiny", hardware="h200-pcie5", dataset="sharegpt",
               rate=10.0)
    w = ResultsWriter(tmp_path / "run", exp="rate_sweep", config={})
    w.add(row | {"mode": "measured", "status": "error", "error": "RuntimeError: cut"})
    w.add(row | {"mode": "simulated", "status": "ok"})
    w.add(row | {"rate": 5.0, "mode": "measured", "status": "oom", "error": "too big"})
    gpu, cpu = measuring(), measuring()
    cpu = dataclasses.replace(cpu, device="cpu")
    key = dict(system="swap", variant="", dataset="sharegpt")
    assert point_done(w, cpu, **key, rate=10.0)  # simulating: the ok simulated row is the point
    assert point_done(w, gpu, **key, rate=5.0)  # an oom measurement is an answer
    assert not point_done(w, gpu, **key, rate=10.0)  # a failed measurement is not
    assert [(r["rate"], r["mode"]) for r in w.rows] == [(5.0, "measured")]  # its rows went
