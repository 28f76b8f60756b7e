"""The measured executor's host time per step, which the roofline cannot see, and its fit from step series.

A measured step's time (GPUStepper.run_step: a CUDA event before the host plans the step, another after its
tokens are read back) holds four pieces of host work beside the GPU's:

* planning: plan_step and the path's begin (swap's staging plan, stream's copy schedules) run before the step's
  first kernel, with the GPU idle; a + b x decodes.
* issuing a step too large for the CUDA graphs of the dense parts (more tokens than the largest bucket,
  directkv/model/graphs.py), or any step where graphs are off: every layer's kernels are launched from Python,
  and where the GPU's work is shorter than that the step waits for the host; a floor of layers x
  eager_us_per_layer under its device time.
* issuing the prompt chunks of a graph-sized step: their attention (and its staging) runs eagerly between the
  dense parts' graphs, so such a step's layers wait for the host as well; a floor of layers x chunk_us_per_layer.
  H200, 2026-12-03, hbm at ShareGPT 10 req/s: its decode-only steps took 7.7 ms (host 5.6), its graph-sized
  steps with a prompt chunk (median 53 tokens) 11.7 ms with the host queueing for 11.1, where the cost model, which
  charged no host issue there, gave 7.9 (results/h200/floors-20261203/).
* issuing a graph-sized decode-only step: the decodes' attention and the system's KV path (swap's staging copies,
  stream's ring chunks) run eagerly between the graphs; a floor of layers x decode_us_per_layer. H200, 2026-12-03,
  ShareGPT 5 req/s: swap's and stream's steps of 1-8 decodes took 17.2 / 16.4 ms with the host queueing for 16.9 /
  16.0, where the model gave 8.7 / 9.1 (results/h200/host-decode-floor-20261203/).

The simulation charges all four (sim_executor.CostModelStepper), per system as fitted from its measured step series
(`python -m directkv.calibration RUN_DIR ... --only host_time --write` with rate-sweep runs that hold steps/); a
system without a fit takes hbm's, the engine and runner every system shares, and with no fit at all (hardware
without a calibration file's host_time) nothing is charged. Fitted on rate sweeps (short contexts): stream's
planning grows with the past, which the fit does not follow (H200, 2026-12-02: its median planning time in the
stored context sweeps' series went from 1.6 ms at 1K to 3.9 ms at 32K).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from directkv.errors import ConfigError

# a step of more tokens runs its dense parts eagerly: max(directkv.model.graphs.BUCKETS), kept here without the
# torch import that module needs (a test holds them equal)
GRAPH_MAX_TOKENS = 256
BASE = "hbm"  # the system whose host time stands in for a system not fitted
# steps/<label>-<point>.parquet, the point "<dataset>-rate<r>" or "context<n>" (experiments.serving.steps_file)
STEP_FILE = re.compile(r"^(?P<label>.+?)-(?:[a-z0-9_]+-rate[\d.]+|context\d+)$")
# an eager step whose host queue took less than this share of its device time: the host led, so its queue time
# is its issue time; above it the host may have waited on the GPU (a full launch queue)
HOST_LED = 0.9


def eager(tokens: int, graphs: bool = True) -> bool:
    """Whether the executor issues a step of `tokens` tokens eagerly: above the graphs' largest bucket, or with
    graphs off."""
    return tokens > GRAPH_MAX_TOKENS or not graphs


@dataclass(frozen=True)
class HostTime:
    plan_us: float = 0.0  # host planning per step, GPU idle
    plan_us_per_decode: float = 0.0
    # host time to issue one layer of a step too large for the graphs; None: the series showed none (the host never
    # led), so for_system takes hbm's, the runner every system shares
    eager_us_per_layer: float | None = 0.0
    # host time to issue one layer of a graph-sized step with prompt tokens; None: the series cannot show it (the
    # host waits on the GPU within its steps), so for_system takes hbm's
    chunk_us_per_layer: float | None = 0.0
    # host time to issue one layer of a graph-sized decode-only step: its attention and the system's KV path run
    # eagerly between the graphs; None as above
    decode_us_per_layer: float | None = 0.0

    def step_seconds(self, device_s: float, decodes: int, tokens: int, layers: int, graphs: bool = True) -> float:
        """A step's time: its planning, then the longer of its modelled device time and the host's issue of its
        layers: eager_us_per_layer each for a step of more than GRAPH_MAX_TOKENS tokens or any step without graphs,
        chunk_us_per_layer each for a graph-sized step with prompt tokens (more tokens than decodes),
        decode_us_per_layer each for a graph-sized decode-only step."""
        if eager(tokens, graphs):
            per_layer = self.eager_us_per_layer
        else:
            per_layer = self.chunk_us_per_layer if tokens > decodes else self.decode_us_per_layer
        per_layer = per_layer or 0.0
        return (self.plan_us + self.plan_us_per_decode * decodes) * 1e-6 + max(device_s, per_layer * layers * 1e-6)


ISSUE_FIELDS = ("eager_us_per_layer", "chunk_us_per_layer", "decode_us_per_layer")  # fitted from host-led steps


def for_system(host: Mapping[str, HostTime], label: str) -> HostTime:
    """`label`'s host time (SystemPolicy.label, e.g. "directkv-stream"), else hbm's, else none; an issue time
    (ISSUE_FIELDS) the label's series did not show (None) is hbm's."""
    own, base = host.get(label), host.get(BASE) or HostTime()
    if own is None:
        return base
    unset = {f: getattr(base, f) for f in ISSUE_FIELDS if getattr(own, f) is None}
    return replace(own, **unset) if unset else own


def load_steps(run_dir: Path, layers: int) -> pd.DataFrame:
    """A measured run's step series (steps/<label>-<point>.parquet) with columns system (the label) and layers;
    a ConfigError for a file whose name is not of that form."""
    frames = []
    for f in sorted((Path(run_dir) / "steps").glob("*.parquet")):
        if not (m := STEP_FILE.match(f.stem)):
            raise ConfigError(f"{f}: not a step series name <system>-<dataset>-rate<r> or <system>-context<n>")
        frames.append(pd.read_parquet(f).assign(system=m["label"], layers=layers))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def fit(steps: pd.DataFrame) -> dict[str, HostTime]:
    """Per system: planning by least squares of host_prep_ms on decodes, each term then clipped at 0;
    eager_us_per_layer the median, per layer, of the host's time to queue a step beyond its planning, over the
    steps of more than GRAPH_MAX_TOKENS tokens where the host led (HOST_LED); 0 where the series has no such step;
    None where it has some but the host led in none: their queue time is the device's (cpu_attn and FlexGen, whose
    host waits on the GPU in every layer, 2026-12-02), and a floor made of it would stand the measured step for the
    model's, so for_system takes hbm's. chunk_us_per_layer the same over the graph-sized steps with prompt tokens:
    the median, per layer, of the queue time beyond planning where the host led; 0 without such steps, None where
    the host led in none (cpu_attn, FlexGen: hbm's then). decode_us_per_layer the same over the graph-sized
    decode-only steps."""
    out = {}
    for label, g in steps.groupby("system"):
        a = np.vstack([np.ones(len(g)), g["decodes"].to_numpy(float)]).T
        (plan, per_decode), *_ = np.linalg.lstsq(a, g["host_prep_ms"].to_numpy(float), rcond=None)
        tokens = g["decodes"] + g["prompt_tokens"]
        floor = _led_issue_us(g[tokens > GRAPH_MAX_TOKENS])
        graphed = g[tokens <= GRAPH_MAX_TOKENS]
        out[str(label)] = HostTime(max(0.0, plan * 1e3), max(0.0, per_decode * 1e3), floor,
                                   _led_issue_us(graphed[graphed["prompt_tokens"] > 0]),
                                   _led_issue_us(graphed[graphed["prompt_tokens"] == 0]))
    return out


def _led_issue_us(steps: pd.DataFrame) -> float | None:
    """Median host issue time per layer (us: queue time beyond planning) over the steps where the host led
    (HOST_LED); 0.0 for no steps, None where the host led in none (its queue time was the device's)."""
    led = steps[steps["host_queue_ms"] < HOST_LED * steps["device_ms"]]
    if not len(led):
        return None if len(steps) else 0.0
    return statistics.median((led["host_queue_ms"] - led["host_prep_ms"]) / led["layers"]) * 1e3
