"""Per step class (decodes bucketed, mixed, prompt): measured device ms of the step series of RUN... beside the
cost model's steps for the same requests. Usage from the repository root: python results/h200/floors-20261203/classes.py
results/h200/rate_sweep/20261202-224518 ..."""
import sys, glob
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
import numpy as np, pandas as pd
from directkv.engine import sim_executor
from experiments.resimulate import resimulate
BUCKETS = [0, 1, 2, 4, 8, 16, 32, 64, 1 << 20]
def classes(dec, pt):
    c = pd.cut(dec, BUCKETS).astype(str)
    return np.where(pt > 0, np.where(dec > 0, "mixed", "prompt"), c)
seen = []
orig = sim_executor.CostModelStepper.run_step
def run_step(self, step):
    cost = orig(self, step)
    seen.append((self.policy.name + ("-" + self.policy.variant if self.policy.variant else ""), len(step.decodes), step.num_tokens - len(step.decodes), cost.time_s * 1e3))
    return cost
sim_executor.CostModelStepper.run_step = run_step
for run in sys.argv[1:]:
    seen.clear(); resimulate(run)
    sim = pd.DataFrame(seen, columns=["sys", "decodes", "prompt_tokens", "ms"])
    for f in sorted(glob.glob(f"{run}/steps/*.parquet")):
        name = f.split("/")[-1].split("-sharegpt")[0].split("-alpaca")[0]
        m = pd.read_parquet(f); m["cls"] = classes(m["decodes"], m["prompt_tokens"])
        s = sim[sim.sys == name].copy(); s["cls"] = classes(s["decodes"], s["prompt_tokens"])
        t = pd.DataFrame({"n_meas": m.groupby("cls").size(), "meas_med": m.groupby("cls")["device_ms"].median(), "meas_sum_s": m.groupby("cls")["device_ms"].sum() / 1e3,
                          "n_sim": s.groupby("cls").size(), "sim_med": s.groupby("cls")["ms"].median(), "sim_sum_s": s.groupby("cls")["ms"].sum() / 1e3})
        t["ratio_med"] = t.sim_med / t.meas_med
        print(run, name); print(t.round(3).to_string())
