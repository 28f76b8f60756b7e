"""The measured executor's host time per step (directkv/host_time.py): its formula, its fit from step series, its
calibration file section, and the simulation charging it per system (hbm's for a system not fitted)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from directkv.costmodel import CostModel
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.systems import SystemPolicy
from directkv.host_time import GRAPH_MAX_TOKENS, HostTime, fit, for_system
from directkv.specs import get_hardware, get_model
from workloads.request import Request

H = HostTime(plan_us=1200.0, plan_us_per_decode=40.0, eager_us_per_layer=1500.0)
RATE_RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "rate_sweep" / "20261202-193958"


def test_planning_is_added_and_the_eager_floor_binds_only_above_the_graphs():
    # a graph-sized step: planning (1.2 ms + 10 decodes x 40 us) then its device time, however short
    assert H.step_seconds(5e-3, 10, GRAPH_MAX_TOKENS, 32) == pytest.approx(1.6e-3 + 5e-3)
    # one token more runs eagerly: 32 layers x 1.5 ms of issue bound a 5 ms device time, not a 60 ms one
    assert H.step_seconds(5e-3, 10, GRAPH_MAX_TOKENS + 1, 32) == pytest.approx(1.6e-3 + 48e-3)
    assert H.step_seconds(60e-3, 10, GRAPH_MAX_TOKENS + 1, 32) == pytest.approx(1.6e-3 + 60e-3)
    assert HostTime().step_seconds(5e-3, 10, 4096, 32) == 5e-3  # nothing fitted: nothing charged


def test_a_system_not_fitted_takes_hbms_host_time():
    hbm = HostTime(plan_us=100.0)
    assert for_system({"swap": H, "hbm": hbm}, "swap") == H
    assert for_system({"swap": H, "hbm": hbm}, "cpu_attn") == hbm
    assert for_system({"swap": H}, "cpu_attn") == HostTime()


def test_fit_recovers_planning_and_eager_issue_per_system():
    rng = np.random.default_rng(0)
    frames = []
    for label, h in (("swap", H), ("directkv-stream", HostTime(800.0, 20.0, 900.0))):
        d = rng.integers(0, 64, 400)
        prompt = np.where(rng.random(400) < 0.3, rng.integers(1, 2048, 400), 0)
        prep = (h.plan_us + h.plan_us_per_decode * d) / 1e3
        issue = np.where(d + prompt > GRAPH_MAX_TOKENS, h.eager_us_per_layer * 32 / 1e3, 3.0)
        frames.append(pd.DataFrame(dict(system=label, layers=32, decodes=d, prompt_tokens=prompt,
                                        host_prep_ms=prep, host_queue_ms=prep + issue)))
    got = fit(pd.concat(frames))
    assert set(got) == {"swap", "directkv-stream"}
    for label, h in (("swap", H), ("directkv-stream", HostTime(800.0, 20.0, 900.0))):
        assert got[label].plan_us == pytest.approx(h.plan_us)
        assert got[label].plan_us_per_decode == pytest.approx(h.plan_us_per_decode)
        assert got[label].eager_us_per_layer == pytest.approx(h.eager_us_per_layer)


def _costs(host: dict) -> list:
    """Every simulated step's (decodes, tokens, seconds) of swap serving 4 requests that arrive at once (so the
    schedule does not depend on the step times)."""
    spec = get_model("llama-3.1-8b")
    cm = CostModel(get_hardware("h200-pcie5"), CostModel.for_hardware(get_hardware("h200-pcie5")).eff, host)
    seen = []
    reqs = [Request(i, 600 + 37 * i, 5) for i in range(4)]
    mem = MemoryConfig(hbm_budget_bytes=96e9, host_budget_bytes=100e9, runtime_overhead_bytes=0, page_size=16)
    from directkv.engine.scheduler import SchedulerConfig

    simulate(reqs, SystemPolicy("swap"), spec, cm, mem=mem, sched_cfg=SchedulerConfig(8, 512),
             on_step=lambda s, c: seen.append((len(s.decodes), s.num_tokens, c.time_s)))
    return seen


def test_the_simulation_charges_a_systems_host_time_step_by_step():
    plain, charged = _costs({}), _costs({"swap": H})
    assert [s[:2] for s in plain] == [s[:2] for s in charged] and any(t > GRAPH_MAX_TOKENS for _, t, _ in plain)
    for (d, tokens, t0), (_, _, t1) in zip(plain, charged, strict=True):
        assert t1 == pytest.approx(H.step_seconds(t0, d, tokens, 32))
    assert _costs({"hbm": H}) == charged  # swap without a fit of its own takes hbm's


def test_calibration_fits_and_stores_the_host_times_beside_the_factors(tmp_path, monkeypatch, capsys):
    import directkv.calibration as cal
    from directkv.costmodel import HOST_CALIBRATION

    monkeypatch.setattr(cal, "DATA", tmp_path)
    assert cal.main([str(RATE_RUN), "--only", "host_time", "--write"]) == 0
    stored = json.loads((tmp_path / "h200-pcie5.json").read_text())
    assert set(stored["host_time"]) == {"swap", "directkv-stream"}
    assert stored["sources"]["host_time"]["run"] == [str(RATE_RUN)]
    # the run's own series: swap planned 1-2 ms a step and issued an eager layer in ~1-2 ms on the H200
    swap = HostTime(**stored["host_time"]["swap"])
    assert 500 < swap.plan_us < 2500 and 500 < swap.eager_us_per_layer < 2500
    monkeypatch.setattr(cal, "CALIBRATION", {})
    monkeypatch.setitem(HOST_CALIBRATION, "h200-pcie5", {})
    cal.load_all()
    assert HOST_CALIBRATION["h200-pcie5"]["swap"] == swap
    # refitting another factor keeps the host times
    assert cal.main([str(RATE_RUN.parents[1] / "superseded" / "20261129-113829"), "--only", "link_sm", "--write"]) == 0
    assert json.loads((tmp_path / "h200-pcie5.json").read_text())["host_time"] == stored["host_time"]
