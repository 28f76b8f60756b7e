import json

import pandas as pd
import pytest

from directkv.errors import ConfigError
from directkv.results import ResultsWriter, load_results

ROW = dict(exp="x", system="hbm", variant="", model="tiny", hardware="h200-pcie5", mode="simulated", status="ok")


def test_rows_manifest_and_resume(tmp_path):
    w = ResultsWriter(tmp_path / "run", exp="x", config={"a": 1})
    w.add(ROW | {"context_len": 1024.0, "tpot_ms": 3.0})
    w.add(ROW | {"context_len": 2048.0, "status": "oom", "error": "too big"})
    w.finish()
    df, man = load_results(tmp_path / "run")
    assert len(df) == 2 and set(df["status"]) == {"ok", "oom"}
    assert {"link_read_bytes", "gpu_mem_gb", "kv_bytes", "error"} <= set(df.columns)
    for key in ("git_sha", "hostname", "gpu", "driver", "torch", "cuda", "command", "config", "mode"):
        assert key in man, key
    assert man["mode"] == "simulated" and man["rows"] == 2
    # a rerun into the same directory, with the same config, sees what is done and keeps the run's start
    man["started_at"] = "2000-01-01T00:00:00+0000"  # a start no rerun could stamp
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(man))
    w2 = ResultsWriter(tmp_path / "run", exp="x", config={"a": 1, "progress": False})
    assert w2.done(system="hbm", context_len=1024.0) and not w2.done(system="hbm", context_len=4096.0)
    again = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert again["started_at"] == man["started_at"] and "resumed_at" in again


def test_a_rerun_under_another_config_is_refused_and_leaves_the_run_as_it_was(tmp_path):
    w = ResultsWriter(tmp_path / "run", exp="x", config={"model": {"name": "llama-3.1-8b"}, "batch_size": 4})
    w.add(ROW | {"context_len": 1024.0})
    w.finish()
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(ConfigError, match=r"holds 1 row of another configuration \(batch_size, model.name differ\)"):
        ResultsWriter(tmp_path / "run", exp="x", config={"model": {"name": "opt-13b"}, "batch_size": 0})
    with pytest.raises(ConfigError, match=r"\(it predates executor\); resume it with the overrides and code"):
        ResultsWriter(tmp_path / "run", exp="x", config={"model": {"name": "llama-3.1-8b"}, "batch_size": 4,
                                                        "executor": {"graphs": True}})
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before


@pytest.mark.parametrize("bad", [{"mode": "guessed"}, {"status": "fine"}])
def test_labels_are_checked(tmp_path, bad):
    w = ResultsWriter(tmp_path, exp="x", config={})
    with pytest.raises(ValueError):
        w.add(ROW | bad)
    missing = dict(ROW)
    del missing["mode"]
    with pytest.raises(ValueError, match="mode"):
        w.add(missing)


def test_rows_survive_each_add(tmp_path):
    w = ResultsWriter(tmp_path, exp="x", config={})
    w.add(ROW)
    assert len(pd.read_parquet(tmp_path / "results.parquet")) == 1  # on disk before finish()
    assert json.loads((tmp_path / "manifest.json").read_text())["finished_at"] is None


def test_forget_drops_a_points_rows_and_rewrites_the_file(tmp_path):
    w = ResultsWriter(tmp_path / "run", exp="x", config={})
    w.add(ROW | {"context_len": 1024.0, "mode": "measured", "status": "error", "error": "cut"})
    w.add(ROW | {"context_len": 1024.0})
    w.add(ROW | {"context_len": 2048.0})
    assert w.forget(system="hbm", context_len=1024.0) == 2 and w.forget(system="hbm", context_len=4096.0) == 0
    assert list(pd.read_parquet(tmp_path / "run" / "results.parquet")["context_len"]) == [2048.0]
