import sys, json, time
sys.path.insert(0, "/work/main")
import pandas as pd
from pathlib import Path
from experiments.resimulate import resimulate
R = Path("/work/main/results/h200")
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
