"""The measured executor's host time per step, which the roofline cannot see, and its fit from step series.

A measured step's time (GPUStepper.run_step: a CUDA event before the host plans the step, another after its
tokens are read back) holds two pieces of host work beside the GPU's:

* planning: plan_step and the path's begin (swap's staging plan, stream's copy schedules) run before the step's
  first kernel, with the GPU idle; a + b x decodes.
* issuing a step too large for the CUDA graphs of the dense parts (more tokens than the largest bucket,
  directkv/model/graphs.py): every layer's kernels are launched from Python, and where the GPU's work is
  shorter than that the step waits for the host; a floor of layers x eager_us_per_layer under its device time.

The simulation charges both (sim_executor.CostModelStepper), per system as fitted from its measured step series
(`python -m directkv.calibration RUN_DIR ... --write` with rate-sweep runs that hold steps/); a system without a
fit takes hbm's, the engine and runner every system shares, and with no fit at all nothing is charged. Both are
fitted on rate sweeps (short contexts): at long contexts stream's planning grows with the past, which the fit does
not follow (H200, 2026-12-02: 1.9 + 0.18 x decodes ms in the context sweeps against 1.5 + 0.035 in rate sweeps).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from directkv.model.graphs import BUCKETS

GRAPH_MAX_TOKENS = max(BUCKETS)  # a step of more tokens runs its dense parts eagerly (the executor's default graphs)
BASE = "hbm"  # the system whose host time stands in for a system not fitted


@dataclass(frozen=True)
class HostTime:
    plan_us: float = 0.0  # host planning per step, GPU idle
    plan_us_per_decode: float = 0.0
    eager_us_per_layer: float = 0.0  # host time to issue one layer of a step too large for the graphs

    def step_seconds(self, device_s: float, decodes: int, tokens: int, layers: int) -> float:
        """A step's time: its planning, then the longer of its modelled device time and, for a step of more
        than GRAPH_MAX_TOKENS tokens, the host's issue of its layers."""
        floor = self.eager_us_per_layer * layers * 1e-6 if tokens > GRAPH_MAX_TOKENS else 0.0
        return (self.plan_us + self.plan_us_per_decode * decodes) * 1e-6 + max(device_s, floor)


def for_system(host: Mapping[str, HostTime], label: str) -> HostTime:
    """`label`'s host time (SystemPolicy.label, e.g. "directkv-stream"), else hbm's, else none."""
    return host.get(label) or host.get(BASE) or HostTime()


def load_steps(run_dir: Path, layers: int) -> pd.DataFrame:
    """A measured run's step series (steps/<label>-<point>.parquet) with columns system (the label) and layers."""
    frames = []
    for f in sorted((Path(run_dir) / "steps").glob("*.parquet")):
        label = f.stem.split("-sharegpt")[0].split("-alpaca")[0].split("-context")[0]
        frames.append(pd.read_parquet(f).assign(system=label, layers=layers))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def fit(steps: pd.DataFrame) -> dict[str, HostTime]:
    """Per system: planning by least squares of host_prep_ms on decodes (both terms >= 0); eager_us_per_layer the
    median over steps of more than GRAPH_MAX_TOKENS tokens of their host time to queue the step beyond planning,
    per layer (0 where the series has no such step)."""
    out = {}
    for label, g in steps.groupby("system"):
        a = np.vstack([np.ones(len(g)), g["decodes"].to_numpy(float)]).T
        (plan, per_decode), *_ = np.linalg.lstsq(a, g["host_prep_ms"].to_numpy(float), rcond=None)
        eager = g[g["decodes"] + g["prompt_tokens"] > GRAPH_MAX_TOKENS]
        issue = ((eager["host_queue_ms"] - eager["host_prep_ms"]) / eager["layers"]).tolist()
        out[str(label)] = HostTime(max(0.0, plan * 1e3), max(0.0, per_decode * 1e3),
                                   statistics.median(issue) * 1e3 if issue else 0.0)
    return out
