"""Resimulate stored serving runs; write each measured row's TPOT beside today's simulated one.
Usage, from the repository root: python results/h200/cost-model-store-20261202/eval_sim.py OUT.csv RUN...
(RUN relative to results/h200, e.g. context_sweep/20261202-161554-1)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import pandas as pd  # noqa: E402

from experiments.resimulate import resimulate  # noqa: E402

R = Path(__file__).resolve().parents[1]
RUNS = sys.argv[2:]
out = []
for run in RUNS:
    d = R / run
    meas = pd.read_parquet(d / "results.parquet"); meas = meas[(meas["mode"] == "measured") & (meas["status"] == "ok")]
    t0 = time.time(); sim = resimulate(d); sim = sim[sim["mode"] == "simulated"]
    key = ["system", "context_len", "rate"] + (["dataset"] if "dataset" in meas and meas["dataset"].notna().any() else [])
    meas, sim = meas.fillna({"context_len": -1, "rate": -1}), sim.fillna({"context_len": -1, "rate": -1})
    m = meas.groupby(key, dropna=False)["tpot_ms"].first(); s = sim.groupby(key, dropna=False)["tpot_ms"].first()
    for k, v in m.items():
        if k in s.index:
            out.append(dict(run=run, key=str(k), measured=v, simulated=s[k]))
    print(run, f"{time.time()-t0:.0f}s", file=sys.stderr)
df = pd.DataFrame(out); df["ratio"] = df["simulated"] / df["measured"]
df.to_csv(sys.argv[1], index=False)
print(df.to_string())
