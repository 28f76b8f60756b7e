"""plots.compare: measured beside simulated serving rows, with their ratio."""

import json

import pandas as pd
import pytest

from directkv.errors import ConfigError
from plots.compare import compare_table, main


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
