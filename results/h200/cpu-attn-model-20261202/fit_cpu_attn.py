"""Fit cpu_attn's two fixed times (Efficiency.cpu_attn_us_per_layer, the handoffs per part and layer, and
cpu_attn_us_per_decode, the CPU's work per decode and layer beyond its K/V reads) to a measured step series.

    python results/h200/cpu-attn-model-20261202/fit_cpu_attn.py RUN [--write]

RUN: a measured rate sweep with cpu_attn's step series (steps/cpu_attn-*.parquet). The run is simulated again
(experiments.resimulate) for every pair of a grid; its steps are grouped into classes (decode-only steps by
their number of decodes, and steps that mix decodes and prompt chunks), and the pair kept is the one whose
simulated class medians are closest to the measured ones (squared log error, each class weighted by its share
of the measured time; a class the simulation has no step of counts as a log error of 1). --write stores the pair
in directkv/specs/calibration/h200-pcie5.json with the run, the fitting commit and the stored values the fit
depended on as its source. The fit rests on the file's other values (host times, dense floor, CPU memory
factors): refit after any of them is refitted. Run from the repository root.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path.cwd()))
from directkv import calibration, costmodel  # noqa: E402
from directkv.engine import sim_executor  # noqa: E402
from directkv.engine.systems import DEFAULT_CPU_ATTN_KERNEL  # noqa: E402
from experiments.resimulate import resimulate  # noqa: E402

HARDWARE = "h200-pcie5"
PER_LAYER = np.arange(300, 801, 25)  # us
PER_DECODE = np.arange(0, 25, 2)  # us
BUCKETS = [0, 1, 2, 4, 8, 16, 32, 64, 1 << 20]


def classes(decodes: pd.Series, prompt_tokens: pd.Series) -> pd.Series:
    bucket = pd.cut(decodes, BUCKETS).astype(str)
    return bucket.where(prompt_tokens == 0, np.where(decodes > 0, "mixed", "prompt"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    run = Path(a.run)
    files = sorted((run / "steps").glob("cpu_attn-*.parquet"))
    if not files:
        sys.exit(f"error: {run} has no cpu_attn step series (steps/cpu_attn-*.parquet); give a measured rate sweep "
                 "with cpu_attn")
    rows = pd.read_parquet(run / "results.parquet")
    rows = rows[(rows["mode"] == "measured") & (rows["system"] == "cpu_attn")]
    for col, want in (("cpu_attn_kernel", DEFAULT_CPU_ATTN_KERNEL), ("cuda_graphs", True)):
        got = set(rows[col].dropna()) if col in rows else set()
        if got != {want}:
            sys.exit(f"error: {run}'s cpu_attn rows have {col} {sorted(map(str, got)) or 'unrecorded'}; the fit "
                     f"wants {want!r} (what the model charges)")
    measured = pd.concat(pd.read_parquet(f) for f in files)
    measured["cls"] = classes(measured["decodes"], measured["prompt_tokens"])
    meas = measured.groupby("cls")["device_ms"].agg(["size", "median", "sum"])
    meas = meas[(meas["size"] >= 10) & (meas.index != "prompt")]
    calibration.load_all()
    base = costmodel.CALIBRATION[HARDWARE]
    seen: list[tuple[int, int, float]] = []
    orig = sim_executor.CostModelStepper.run_step

    def run_step(self, step):
        cost = orig(self, step)
        if self.policy.name == "cpu_attn":
            seen.append((len(step.decodes), step.num_tokens - len(step.decodes), cost.time_s * 1e3))
        return cost

    sim_executor.CostModelStepper.run_step = run_step
    results = []
    for h, k in itertools.product(PER_LAYER, PER_DECODE):
        costmodel.CALIBRATION[HARDWARE] = replace(base, cpu_attn_us_per_layer=float(h), cpu_attn_us_per_decode=float(k))
        seen.clear()
        sim_rows = resimulate(run)
        sim = pd.DataFrame(seen, columns=["decodes", "prompt_tokens", "ms"])
        med = sim.groupby(classes(sim["decodes"], sim["prompt_tokens"]))["ms"].median().reindex(meas.index)
        err = np.log(med / meas["median"])
        loss = float((meas["sum"] / meas["sum"].sum() * err.fillna(1.0) ** 2).sum())
        tpot = sim_rows[(sim_rows["mode"] == "simulated") & (sim_rows["system"] == "cpu_attn")]["tpot_ms"].iloc[0]
        results.append((float(h), float(k), loss, tpot))
    costmodel.CALIBRATION[HARDWARE] = base
    df = pd.DataFrame(results, columns=["cpu_attn_us_per_layer", "cpu_attn_us_per_decode", "loss", "sim_tpot_ms"])
    best = df.loc[df["loss"].idxmin()]
    print(df.sort_values("loss").head(8).round(4).to_string(index=False))
    print("measured class medians (ms):", meas["median"].round(2).to_dict())
    print("best:", best.round(4).to_dict())
    if a.write:
        manifest = json.loads((run / "manifest.json").read_text())
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        host = costmodel.HOST_CALIBRATION.get(HARDWARE, {})
        source = {"run": str(run), "git_sha": manifest.get("code_commit") or manifest.get("git_sha"),
                  "gpu": manifest.get("gpu"), "method": "results/h200/cpu-attn-model-20261202/fit_cpu_attn.py",
                  "fit_commit": commit,
                  "depends_on": {"dense_us_per_layer": base.dense_us_per_layer, "cpu_mem": base.cpu_mem,
                                 "cpu_ns_per_head_token": base.cpu_ns_per_head_token,
                                 "host_time": {k: vars(host[k]) for k in ("cpu_attn", "hbm") if k in host}}}
        fitted = {"cpu_attn_us_per_layer": float(best["cpu_attn_us_per_layer"]),
                  "cpu_attn_us_per_decode": float(best["cpu_attn_us_per_decode"])}
        calibration.write(HARDWARE, fitted, {name: source for name in fitted})
        print("wrote", calibration.path_for(HARDWARE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
