"""Simulate a stored serving run again with today's cost model: its config, on the CPU, same requests.

A measured run's simulated rows were made with the cost-model factors of their day (the manifest lists
them). After a calibration changes the factors, `resimulate(run_dir)` runs the run's experiment again with
`device=cpu` and returns the new simulated rows, so `python -m plots.compare RUN --resimulate` shows how far
the model now is from the machine. The requests must be the run's: a rate sweep's regenerated schedules are
checked against the ones stored beside its results, and the token counter of the run is used.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pandas as pd
from omegaconf import OmegaConf

from directkv.errors import ConfigError
from workloads.schedule import load_schedule
from workloads.tokenizer import ENV_VAR

SERVING = ("context_sweep", "rate_sweep")
# The value every run made before an executor option existed ran with: it is simulated so, named rather than left
# to today's default, and the option's column (which the run's own rows lack) is left out of its simulated rows.
VALUE_BEFORE_THE_KEY = {
    "directkv_stream_slots": 2,  # 2 decode ring slots until 6b39e3f (a later default would simulate a larger ring)
    "directkv_stream_chunk_mib": 16,  # the decode ring in 16 MiB slots until 2026-12-02
    "hbm_prefill": "kernel",  # HBM prompt chunks by the kernel
    "directkv_no_past_prefill": "kernel",  # directkv's chunks with no past by its kernel
}


def resimulate(run_dir: Path, manifest: dict | None = None) -> pd.DataFrame:
    """The simulated rows of `run_dir`'s experiment, made now on the CPU with the run's config (`manifest`: the
    run's manifest when the caller has already read it)."""
    from experiments.run import run_experiment

    run_dir = Path(run_dir)
    if manifest is None:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    if manifest.get("derived_from"):
        raise ConfigError(f"{run_dir} is derived from {', '.join(manifest['derived_from'])}: resimulate those runs")
    cfg = OmegaConf.create(manifest["config"])
    if cfg.exp_name not in SERVING:
        raise ConfigError(f"{run_dir} is a {cfg.exp_name} run; resimulate takes {', '.join(SERVING)}")
    missing = [key for key in VALUE_BEFORE_THE_KEY if OmegaConf.select(cfg, f"executor.{key}") is None]
    for key in missing:
        OmegaConf.update(cfg, f"executor.{key}", VALUE_BEFORE_THE_KEY[key])
    # a run whose device copy was edited to do what a later option does says so as overrides (key=value, as on
    # the command line): it is simulated as it ran, though its own rows carry no column for them
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(manifest.get("device_copy_equivalent_overrides", [])))
    with tempfile.TemporaryDirectory() as tmp, _token_counter(manifest, run_dir / "schedules"):
        cfg.device, cfg.render, cfg.progress = "cpu", False, False
        cfg.results_root, cfg.run_id = tmp, "resimulated"
        path = run_experiment(cfg, Path(tmp) / "resimulated")
        _check_same_requests(run_dir / "schedules", Path(tmp) / "resimulated" / "schedules")
        rows = pd.read_parquet(path)
    # plots.compare pairs rows by the options both carry
    return rows.drop(columns=missing, errors="ignore")


@contextmanager
def _token_counter(manifest: dict, schedules: Path):
    """ENV_VAR (DIRECTKV_TOKENIZER) set to the counter the run's workloads were made with: its requests' lengths.
    The manifest names it; an interrupted run's manifest may not, and then its stored schedules do."""
    names = {w.get("tokenizer", "") for w in (manifest.get("workloads") or {}).values()}
    if not names and schedules.is_dir():
        names = {load_schedule(p).tokenizer for p in schedules.glob("*.parquet")}
    modes = {"approx" if n.startswith("approx") else "llama3" if n.startswith("llama-3") else None for n in names}
    mode = modes.pop() if len(modes) == 1 else None
    with mock.patch.dict(os.environ, {ENV_VAR: mode} if mode else {}):  # restored whatever happens
        yield


def _check_same_requests(stored: Path, made: Path) -> None:
    """Every schedule the run stored must come out the same now (same data, seed and token counter)."""
    for path in sorted(stored.glob("*.parquet")) if stored.is_dir() else []:
        again = made / path.name
        if not again.exists() or load_schedule(again).requests != load_schedule(path).requests:
            raise ConfigError(f"the requests of {path.name} come out differently now (data files or token counter "
                              f"changed); a resimulation would not compare the same requests")
