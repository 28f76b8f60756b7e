"""plots.compare: measured beside simulated serving rows, with their ratio."""

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from directkv.errors import ConfigError
from plots.compare import compare_table, main
from workloads.datafiles import find_sample


def _rows() -> pd.DataFrame:
    base = dict(exp="context_sweep", model="tiny", hardware="h200-pcie5", batch_size=2, error="")
    rows = [
        dict(base, system="directkv", variant="tiled", context_len=1024.0, mode="measured", status="ok", tpot_ms=30.0),
        dict(base, system="directkv", variant="tiled", context_len=1024.0, mode="simulated", status="ok", tpot_ms=20.0),
        dict(base, system="hbm", variant="", context_len=1024.0, mode="measured", status="oom", tpot_ms=float("nan")),
        dict(base, system="hbm", variant="", context_len=1024.0, mode="simulated", status="oom", tpot_ms=float("nan")),
        dict(base, system="swap", variant="", context_len=1024.0, mode="simulated", status="ok", tpot_ms=10.0),
    ]
    return pd.DataFrame(rows)


def test_table_pairs_modes_and_divides():
    lines = compare_table(_rows(), "context_sweep").splitlines()
    assert lines[0].startswith("| model | context_len | batch_size | system | measured tpot_ms")
    body = {line.split(" | ")[3]: line for line in lines[2:]}
    assert body["directkv (tiled)"].endswith("| 30 | 20 | 1.5 |")
    assert body["hbm"].endswith("| oom | oom | - |")
    assert body["swap"].endswith("| - | 10 | - |")  # no measured twin (a CPU-only run)


def test_bad_metric_and_exp_are_one_line_errors():
    with pytest.raises(ConfigError, match="metric 'latency' is not a column"):
        compare_table(_rows(), "context_sweep", "latency")
    with pytest.raises(ConfigError, match="valid: context_sweep, rate_sweep"):
        compare_table(_rows(), "kernel_ablation")


def test_cli_prints_a_run_and_exits_2_on_bad_input(tmp_path, capsys):
    _rows().to_parquet(tmp_path / "results.parquet")
    (tmp_path / "manifest.json").write_text(json.dumps({"exp": "context_sweep"}))
    assert main([str(tmp_path)]) == 0
    assert "| tiny | 1024 | 2 | directkv (tiled) | 30 | 20 | 1.5 |" in capsys.readouterr().out
    assert main([str(tmp_path), "--metric", "nope"]) == 2
    assert "error: metric 'nope'" in capsys.readouterr().err


def test_measured_rows_differing_in_graphs_get_one_line_each():
    """Graphs on and off measured at one point share the point's simulated value; neither is dropped."""
    df = pd.DataFrame({"model": ["m"] * 3, "context_len": [1024] * 3, "batch_size": [4] * 3, "system": ["hbm"] * 3,
                       "variant": [""] * 3, "mode": ["measured", "measured", "simulated"],
                       "cuda_graphs": [False, True, None], "status": ["ok"] * 3, "tpot_ms": [37.7, 15.5, 5.8]})
    lines = compare_table(df, "context_sweep").splitlines()[2:]
    assert lines == ["| m | 1024 | 4 | hbm [eager] | 37.7 | 5.8 | 6.5 |", "| m | 1024 | 4 | hbm [graphs] | 15.5 | 5.8 | 2.67 |"]


def test_pipelined_measured_rows_pair_with_the_pipelined_simulation():
    """A combined table holds one batch (measured, and simulated before the simulation knew pipelining: no
    column) and pipelined (measured and simulated pipelined): each measured row meets its own simulation."""
    df = pd.DataFrame({"model": ["m"] * 4, "context_len": [4096] * 4, "batch_size": [4] * 4, "system": ["directkv"] * 4,
                       "variant": ["tiled"] * 4, "mode": ["measured", "simulated", "measured", "simulated"],
                       "directkv_pipelined": [False, None, True, True], "status": ["ok"] * 4,
                       "tpot_ms": [56.0, 50.0, 51.0, 40.0]})
    lines = compare_table(df, "context_sweep").splitlines()[2:]
    assert lines == ["| m | 4096 | 4 | directkv (tiled) [one batch] | 56 | 50 | 1.12 |",
                     "| m | 4096 | 4 | directkv (tiled) [pipelined] | 51 | 40 | 1.27 |"]
    # graphs on and off measured too: simulated rows never carry cuda_graphs, and still find their twin
    both = pd.concat([df.assign(cuda_graphs=[True, None, True, None]),
                      df[df["mode"] == "measured"].assign(cuda_graphs=False, tpot_ms=[70.0, 65.0])], ignore_index=True)
    lines = compare_table(both, "context_sweep").splitlines()[2:]
    assert [(line.split(" | ")[3], line.split(" | ")[-2]) for line in lines] == [
        ("directkv (tiled) [eager, one batch]", "50"), ("directkv (tiled) [eager, pipelined]", "40"),
        ("directkv (tiled) [graphs, one batch]", "50"), ("directkv (tiled) [graphs, pipelined]", "40")], lines


H200 = Path(__file__).resolve().parents[1] / "results" / "h200" / "rate_sweep"


# the kept rate sweeps were made from the ShareGPT / Alpaca samples; resimulating them needs the same files
needs_samples = pytest.mark.skipif(
    find_sample("alpaca", "alpaca_5000.json") is None or find_sample("sharegpt", "sharegpt_sample_2000.json") is None,
    reason="ShareGPT/Alpaca samples (../shared/data or $DIRECTKV_DATA_DIR) not found")


@needs_samples
def test_resimulate_runs_the_stored_config_on_the_cpu_with_the_same_requests(monkeypatch):
    from experiments.resimulate import resimulate

    monkeypatch.delenv("DIRECTKV_TOKENIZER", raising=False)
    stored = pd.read_parquet(H200 / "20261129-155722" / "results.parquet")
    again = resimulate(H200 / "20261129-155722")
    assert set(again["mode"]) == {"simulated"} and len(again) == (stored["mode"] == "simulated").sum()
    assert list(again["num_requests"]) == list(stored[stored["mode"] == "simulated"]["num_requests"])
    # the run's requests were counted with the approximate tokenizer: set for the run, then put back
    assert "DIRECTKV_TOKENIZER" not in os.environ


@needs_samples
def test_resimulate_refuses_changed_requests_and_derived_runs(tmp_path):
    from experiments.resimulate import resimulate
    from workloads.schedule import load_schedule, save_schedule

    run = tmp_path / "run"
    shutil.copytree(H200 / "20261129-155722", run)
    path = run / "schedules" / "alpaca-rate1.parquet"
    wl = load_schedule(path)
    first = wl.requests[0]
    wl.requests[0] = type(first)(first.req_id, first.prompt_len + 1, first.output_len, first.arrival_s)
    save_schedule(wl, path)
    with pytest.raises(ConfigError, match="alpaca-rate1.parquet come out differently now"):
        resimulate(run)
    with pytest.raises(ConfigError, match="is derived from 20261129-160047, .*: resimulate those runs"):
        resimulate(H200 / "combined-20261129e-alpaca")


@needs_samples
def test_cli_resimulate_skips_derived_runs_in_a_listing(tmp_path, capsys):
    for name in ("20261129-155722", "combined-20261129e-sharegpt"):
        shutil.copytree(H200 / name, tmp_path / name)
    assert main([str(tmp_path), "--resimulate"]) == 0
    out = capsys.readouterr().out
    assert "20261129-155722 (simulated again with today's cost model)" in out
    assert "combined-20261129e-sharegpt: derived from 20261129-160238" in out
    assert main([str(tmp_path / "combined-20261129e-sharegpt"), "--resimulate"]) == 2


@needs_samples
def test_resimulate_reads_the_token_counter_from_the_schedules_of_an_interrupted_run(monkeypatch):
    from experiments.resimulate import resimulate

    monkeypatch.setenv("DIRECTKV_TOKENIZER", "auto")  # the real tokenizer where installed: other lengths
    manifest = json.loads((H200 / "20261129-155834" / "manifest.json").read_text())
    assert manifest["interrupted"] and "workloads" not in manifest
    again = resimulate(H200 / "20261129-155834")  # raises if the requests came out differently
    assert set(again["dataset"]) == {"alpaca", "sharegpt"} and os.environ["DIRECTKV_TOKENIZER"] == "auto"


def test_resimulate_gives_a_stream_run_the_ring_it_was_measured_with(monkeypatch, capsys):
    """A run from before executor.directkv_stream_slots served stream with 2 slots: it is simulated so, and its
    rows (which carry no slot count) still pair with the new simulated ones; a later run is simulated with the
    slots its config names (8 here, by override). Both predate executor.directkv_stream_chunk_mib: their decode
    rings are simulated in 16 MiB slots, as they were measured, and no row of theirs carries the column."""
    import experiments.serving as serving
    from experiments.resimulate import resimulate

    simulate, slots = serving.simulate, []

    def recording(*args, **kwargs):
        slots.append((kwargs["stream_slots"], kwargs["stream_chunk_mib"]))
        return simulate(*args, **kwargs)

    monkeypatch.setattr(serving, "simulate", recording)
    runs = H200.parent / "context_sweep"
    old = resimulate(runs / "20261201-213142")
    assert set(slots) == {(2, 16)} and "directkv_stream_slots" not in old.columns
    assert "directkv_stream_chunk_mib" not in old.columns
    slots.clear()
    new = resimulate(runs / "20261201-222311")
    assert set(slots) == {(8, 16)} and new.set_index("system").loc["directkv", "directkv_stream_slots"].tolist() == [8] * 3
    assert "directkv_stream_chunk_mib" not in new.columns
    # a run with the key keeps its value and column; a run whose device copy was edited to the same cut
    # (device_copy_equivalent_overrides) is simulated with it, its rows (like the run's own) without the column
    slots.clear()
    keyed = resimulate(runs / "20261202-150851-1").set_index("system")
    assert set(slots) == {(12, 64)} and keyed.loc["directkv", "directkv_stream_chunk_mib"] == 64
    slots.clear()
    edited = resimulate(runs / "20261202-143151")
    assert set(slots) == {(12, 64)} and "directkv_stream_chunk_mib" not in edited.columns
    assert main([str(runs / "20261201-213142"), "--resimulate"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| llama-3.1-8b") and "directkv" in ln]
    assert len(rows) == 3 and all(ln.split("|")[6].strip() not in ("", "-") for ln in rows)
