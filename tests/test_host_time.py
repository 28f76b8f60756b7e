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
from directkv.errors import ConfigError
from directkv.host_time import GRAPH_MAX_TOKENS, HostTime, fit, for_system, load_steps
from directkv.specs import get_hardware, get_model
from workloads.request import Request

H = HostTime(plan_us=1200.0, plan_us_per_decode=40.0, eager_us_per_layer=1500.0, chunk_us_per_layer=300.0)
RATE_RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "rate_sweep" / "20261202-193958"


def test_planning_is_added_and_the_eager_floor_binds_only_above_the_graphs():
    # a graph-sized step: planning (1.2 ms + 10 decodes x 40 us), then its device time or, with prompt tokens, its
    # chunks' issue (32 x 0.3 ms), not the eager issue of its layers
    assert H.step_seconds(5e-3, 10, GRAPH_MAX_TOKENS, 32) == pytest.approx(1.6e-3 + 9.6e-3)
    # one token more runs eagerly: 32 layers x 1.5 ms of issue bound a 5 ms device time, not a 60 ms one
    assert H.step_seconds(5e-3, 10, GRAPH_MAX_TOKENS + 1, 32) == pytest.approx(1.6e-3 + 48e-3)
    assert H.step_seconds(60e-3, 10, GRAPH_MAX_TOKENS + 1, 32) == pytest.approx(1.6e-3 + 60e-3)
    assert HostTime().step_seconds(5e-3, 10, 4096, 32) == 5e-3  # nothing fitted: nothing charged


def test_a_graph_sized_step_with_prompt_tokens_waits_for_its_chunks_issue():
    # 10 decodes and 40 prompt tokens: 32 layers x 0.3 ms of issue bound a 5 ms device time; decodes alone do not
    assert H.step_seconds(5e-3, 10, 50, 32) == pytest.approx(1.6e-3 + 9.6e-3)
    assert H.step_seconds(12e-3, 10, 50, 32) == pytest.approx(1.6e-3 + 12e-3)
    assert H.step_seconds(5e-3, 10, 10, 32) == pytest.approx(1.6e-3 + 5e-3)
    assert H.step_seconds(5e-3, 0, 50, 32) == pytest.approx(1.2e-3 + 9.6e-3)  # a prompt-only step too


def test_a_graph_sized_decode_only_step_waits_for_its_layers_issue():
    """The attention and KV path of a decode-only step run eagerly between the graphs: 32 layers x 0.25 ms of issue
    bound a 5 ms device time (H200, ShareGPT 5 req/s, 2026-12-03: swap's and stream's steps of 1-8 decodes took
    ~17 ms with the host queueing for all but 2-3% of it, where the model without this floor gave ~9)."""
    h = HostTime(plan_us=1200.0, plan_us_per_decode=40.0, decode_us_per_layer=250.0)
    assert h.step_seconds(5e-3, 10, 10, 32) == pytest.approx(1.6e-3 + 8e-3)
    assert h.step_seconds(12e-3, 10, 10, 32) == pytest.approx(1.6e-3 + 12e-3)
    assert h.step_seconds(5e-3, 10, 50, 32) == pytest.approx(1.6e-3 + 5e-3)  # a prompt chunk: chunk_us_per_layer's
    assert h.step_seconds(5e-3, 300, 300, 32) == pytest.approx(13.2e-3 + 5e-3)  # eager: eager_us_per_layer's (0)
    assert h.step_seconds(5e-3, 10, 10, 32, graphs=False) == pytest.approx(1.6e-3 + 5e-3)  # no graphs: eager's (0)


def test_a_system_not_fitted_takes_hbms_host_time():
    hbm = HostTime(plan_us=100.0)
    assert for_system({"swap": H, "hbm": hbm}, "swap") == H
    assert for_system({"swap": H, "hbm": hbm}, "cpu_attn") == hbm
    assert for_system({"swap": H}, "cpu_attn") == HostTime()


def _series(label: str, h: HostTime, n: int = 400, seed: int = 0) -> pd.DataFrame:
    """A step series whose planning is exactly h's and whose eager steps, and graph-sized steps with prompt tokens,
    issue in h's times where the host led; most of those instead show the host waiting on a longer GPU (queue time =
    device time)."""
    rng = np.random.default_rng(seed)
    d = rng.integers(0, 64, n)
    prompt = np.where(rng.random(n) < 0.3, rng.integers(1, 2048, n), 0)
    prep = (h.plan_us + h.plan_us_per_decode * d) / 1e3
    eager = d + prompt > GRAPH_MAX_TOKENS
    chunked = ~eager & (prompt > 0)  # graph-sized with prompt tokens: the host's issue bounds the step
    issue = np.where(eager, h.eager_us_per_layer * 32 / 1e3, np.where(chunked, h.chunk_us_per_layer * 32 / 1e3, 3.0))
    device = np.where(chunked, prep + issue * 1.2, prep + issue * 2)  # chunked: led, if by less than eager steps
    waited = (eager | chunked) & (rng.random(n) < 0.6)
    issue = np.where(waited, device * 1.5, issue)
    device = np.where(waited, prep + issue, device)
    return pd.DataFrame(dict(system=label, layers=32, decodes=d, prompt_tokens=prompt, host_prep_ms=prep,
                             host_queue_ms=prep + issue, device_ms=device))


def test_fit_recovers_planning_and_eager_issue_per_system():
    other = HostTime(800.0, 20.0, 900.0, 450.0)
    got = fit(pd.concat([_series("swap", H), _series("directkv-stream", other, seed=1)]))
    assert set(got) == {"swap", "directkv-stream"}
    for label, h in (("swap", H), ("directkv-stream", other)):
        assert got[label].plan_us == pytest.approx(h.plan_us)
        assert got[label].plan_us_per_decode == pytest.approx(h.plan_us_per_decode)
        assert got[label].eager_us_per_layer == pytest.approx(h.eager_us_per_layer)  # the waiting steps left out
        assert got[label].chunk_us_per_layer == pytest.approx(h.chunk_us_per_layer)
        assert got[label].decode_us_per_layer == pytest.approx(3e3 / 32)  # _series' decode-only steps issue in 3 ms


def test_fit_without_eager_steps_or_with_a_falling_planning_time_clips_at_zero():
    small = _series("hbm", H).query("decodes + prompt_tokens <= @GRAPH_MAX_TOKENS")
    assert fit(small)["hbm"].eager_us_per_layer == 0.0
    assert fit(small.query("prompt_tokens == 0"))["hbm"].chunk_us_per_layer == 0.0  # no step with a prompt chunk
    falling = small.assign(host_prep_ms=5.0 - 0.2 * small["decodes"])  # a negative slope, not a host time
    got = fit(falling)["hbm"]
    assert got.plan_us_per_decode == 0.0 and got.plan_us == pytest.approx(5000.0)


def test_a_series_whose_host_never_led_takes_hbm_s_eager_issue_time():
    """cpu_attn's host waits on the GPU in every layer (queue time = device time in every step, H200 2026-12-02): no
    eager step shows the host's own issue time, and a floor made of the queue time would be the measured step. The
    fit leaves it unset (None), and for_system fills in hbm's: the runner's, which every system shares."""
    s = _series("cpu_attn", H)
    waited = s.assign(device_ms=s["host_queue_ms"])  # every step: the host's queue time is the device's
    got = fit(waited)["cpu_attn"]
    assert got.eager_us_per_layer is None and got.chunk_us_per_layer is None and got.decode_us_per_layer is None
    assert got.plan_us == pytest.approx(H.plan_us)  # planning is still the host's own
    hbm = HostTime(100.0, 5.0, 700.0, 250.0, 150.0)
    looked_up = for_system({"cpu_attn": got, "hbm": hbm}, "cpu_attn")
    assert looked_up.eager_us_per_layer == 700.0 and looked_up.chunk_us_per_layer == 250.0
    assert looked_up.decode_us_per_layer == 150.0
    assert looked_up.plan_us == got.plan_us
    assert for_system({"cpu_attn": got}, "cpu_attn").step_seconds(0.0, 0, 1024, 32) == pytest.approx(H.plan_us * 1e-6)


def test_the_eager_cut_is_the_graphs_largest_bucket_and_graphs_off_makes_every_step_eager():
    from directkv.model.graphs import BUCKETS

    assert GRAPH_MAX_TOKENS == max(BUCKETS)
    assert H.step_seconds(5e-3, 10, 8, 32, graphs=False) == pytest.approx(1.6e-3 + 48e-3)


def test_step_files_are_named_by_system_and_point(tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    row = pd.DataFrame(dict(decodes=[1], prompt_tokens=[0], host_prep_ms=[1.0], host_queue_ms=[2.0], device_ms=[3.0]))
    for name in ("directkv-stream-sharegpt-rate10", "swap-alpaca-rate0.5", "hbm-context16384"):
        row.to_parquet(steps / f"{name}.parquet")
    assert sorted(load_steps(tmp_path, 32)["system"]) == ["directkv-stream", "hbm", "swap"]
    row.to_parquet(steps / "swap.parquet")
    with pytest.raises(ConfigError, match=r"swap.parquet: not a step series name <system>-<dataset>-rate<r> or "):
        load_steps(tmp_path, 32)


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
    kept = {"plan_us": 98.0, "plan_us_per_decode": 7.0, "eager_us_per_layer": 800.0, "a_later_field": 1.0}
    (tmp_path / "h200-pcie5.json").write_text(json.dumps({"factors": {}, "host_time": {"hbm": kept},
                                                          "sources": {"host_time": {"hbm": {"run": ["x"]}}}}))
    assert cal.main([str(RATE_RUN), "--write"]) == 0  # a plain fit of a run with step series fits host_time too
    stored = json.loads((tmp_path / "h200-pcie5.json").read_text())
    # the run's two systems join; hbm, which no run here has, keeps its stored fit and source
    assert set(stored["host_time"]) == {"swap", "directkv-stream", "hbm"} and stored["host_time"]["hbm"] == kept
    assert stored["sources"]["host_time"]["swap"]["run"] == [str(RATE_RUN)]
    assert stored["sources"]["host_time"]["hbm"] == {"run": ["x"]}
    # the run's own series: swap planned 1-2 ms a step and issued an eager layer in ~1-2 ms on the H200
    swap = HostTime(**stored["host_time"]["swap"])
    assert 500 < swap.plan_us < 2500 and 500 < swap.eager_us_per_layer < 2500
    monkeypatch.setattr(cal, "CALIBRATION", {})
    monkeypatch.setitem(HOST_CALIBRATION, "h200-pcie5", {})
    cal.load_all()  # a field this version does not know is left out, as for the factors
    assert HOST_CALIBRATION["h200-pcie5"]["swap"] == swap and HOST_CALIBRATION["h200-pcie5"]["hbm"] == HostTime(98, 7, 800)
    # refitting another factor keeps the host times
    kernel_run = RATE_RUN.parents[1] / "superseded" / "20261129-113829"
    assert cal.main([str(kernel_run), "--only", "link_sm", "--write"]) == 0
    assert json.loads((tmp_path / "h200-pcie5.json").read_text())["host_time"] == stored["host_time"]
    capsys.readouterr()
    assert cal.main([str(kernel_run), "--only", "host_time"]) == 2
    assert "no step series of a measured rate sweep with CUDA graphs (steps/) to fit host_time from" in capsys.readouterr().err


def test_only_rate_sweeps_with_graphs_give_step_series():
    from directkv.calibration import serving_steps

    rows = pd.read_parquet(RATE_RUN / "results.parquet")
    assert set(serving_steps(rows, RATE_RUN)["system"]) == {"swap", "directkv-stream"}
    assert serving_steps(rows.assign(cuda_graphs=False), RATE_RUN).empty
    assert serving_steps(rows.assign(exp="context_sweep"), RATE_RUN).empty


def test_the_configs_graphs_setting_reaches_the_simulation(tmp_path):
    """executor.cuda_graphs is modelled on a CPU too: without graphs every step takes the eager floor, so the same
    small context sweep simulates slower (on the CPU Setup.cuda_graphs, the measured executor's, stays False)."""
    from test_experiments import _compose

    from experiments.common import setup
    from experiments.run import run_experiment

    tpot = {}
    for graphs in (True, False):
        args = ["+exp=context_sweep", f"run_id=g{graphs}", "device=cpu", "progress=false", "render=false",
                "contexts=[512]", "batch_size=2", "output_len=4", "system.names=[hbm]", f"executor.cuda_graphs={graphs}"]
        cfg = _compose(args)
        assert setup(cfg).sim_graphs is graphs and setup(cfg).cuda_graphs is False
        rows = pd.read_parquet(run_experiment(cfg, tmp_path / str(graphs)))
        tpot[graphs] = float(rows["tpot_ms"].iloc[0])
    assert tpot[False] > tpot[True]
