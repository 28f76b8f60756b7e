"""Measured beside simulated, one table per serving run: `python -m plots.compare RESULTS_DIR [--metric M]`.

On a GPU every serving point is written twice, `mode=measured` and `mode=simulated` (the cost model on the
same requests). This prints, per point and system, both values and their ratio as a Markdown table, so the
gap between the model and the machine is read off rather than worked out. Points where either side is not
`status=ok` show the status instead of a number. `--resimulate` replaces the stored simulated rows with ones
made now by today's cost model (experiments/resimulate.py: the run's config on the CPU, the same requests), to
see a calibration's effect on the gap.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from directkv.errors import ConfigError, check
from experiments.resimulate import VALUE_BEFORE_THE_KEY
from plots.figures.common import EXECUTOR_OPTIONS, executor_tags
from plots.load import find_run_dirs, load_run

# experiment -> the columns that name a point (besides system / variant)
POINT_KEYS = {"context_sweep": ("model", "context_len", "batch_size"), "rate_sweep": ("model", "dataset", "rate")}
METRICS = ("tpot_ms", "ttft_ms", "gpu_mem_gb", "mean_e2el_ms", "output_throughput")


def _fmt(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def compare_table(df: pd.DataFrame, exp: str, metric: str = "tpot_ms") -> str:
    """Markdown table of `metric` measured / simulated / ratio per point and system of a serving run `df`."""
    check(exp in POINT_KEYS, f"plots.compare reads serving runs; got exp {exp!r}; valid: {', '.join(POINT_KEYS)}")
    check(metric in df.columns, f"metric {metric!r} is not a column of this run; valid: "
          f"{', '.join(m for m in METRICS if m in df.columns)}")
    keys = [k for k in POINT_KEYS[exp] if k in df.columns]
    df = df.assign(label=df["system"] + df["variant"].map(lambda v: f" ({v})" if v else ""))
    lines = ["| " + " | ".join([*keys, "system", f"measured {metric}", f"simulated {metric}", "measured / simulated"])
             + " |", "| " + " | ".join(["---"] * (len(keys) + 4)) + " |"]
    tags = executor_tags(df)  # measured rows of one point that differ in an executor option: one line each
    show = lambda c: "-" if c is None else (c if isinstance(c, str) else _fmt(c))  # noqa: E731
    for point, group in df.groupby([*keys, "label"], sort=True, dropna=False):
        sims = group[group["mode"] == "simulated"]
        measured = group[group["mode"] == "measured"]
        names = [_fmt(v) if isinstance(v, float) else str(v) for v in point]
        for tag in sorted(tags[measured.index].unique()) or [""]:
            rows = measured[tags[measured.index] == tag]
            sim = _cell(_twin(sims, rows.iloc[0] if len(rows) else None), metric)
            m = _cell(rows, metric)
            ratio = m / sim if isinstance(m, float) and isinstance(sim, float) and sim else float("nan")
            label = names[-1] + (f" [{tag}]" if tag else "")
            lines.append("| " + " | ".join([*names[:-1], label, show(m), show(sim), _fmt(ratio)]) + " |")
    return "\n".join(lines)


# Options the simulation modelled at one value before its rows carried them (the value runs from before the option
# ran with, VALUE_BEFORE_THE_KEY), and the systems they change: a simulated row without the column modelled that
# value (until 2026-12-02 it charged every HBM prompt chunk as our tiled kernel), so it is no twin of a measured row
# of those systems run with another.
MODELLED_BEFORE = {key: (VALUE_BEFORE_THE_KEY[key], systems) for key, systems in (
    ("hbm_prefill", ("hbm", "swap", "cpu_attn", "flexgen")),
    ("directkv_stream_chunk_mib", ("directkv",)),  # 12 x 16 MiB decode slots until 2026-12-02
    ("directkv_no_past_prefill", ("directkv",)))}


def _twin(sims: pd.DataFrame, measured: pd.Series | None) -> pd.DataFrame:
    """The simulated row of a point that ran the measured row's options: of those whose executor options (the
    ones a simulated row carries, e.g. directkv's pipelining; never graphs) all equal the measured row's, the
    one carrying the most; rows from before the simulation knew an option carry none and match anything, except
    an option it modelled at one value then (MODELLED_BEFORE)."""
    if measured is None or sims.empty:
        return sims.iloc[:1]
    cols = [c for c in EXECUTOR_OPTIONS if c in sims.columns]
    best, best_n = sims.iloc[:0], -1
    for i in range(len(sims)):
        row = sims.iloc[i]
        carried = [c for c in cols if not pd.isna(row[c])]
        implied = [c for c, (v, systems) in MODELLED_BEFORE.items() if c not in carried and c in measured.index
                   and measured.get("system") in systems and not pd.isna(measured[c]) and measured[c] != v]
        if (all(c in measured.index and measured[c] == row[c] for c in carried) and not implied
                and len(carried) > best_n):
            best, best_n = sims.iloc[i : i + 1], len(carried)
    return best


def _cell(rows: pd.DataFrame, metric: str) -> float | str | None:
    """The metric of the one row in `rows`, its status when not ok, None when there is none."""
    if rows.empty:
        return None
    if (rows["status"] != "ok").any():
        return str(rows["status"].iloc[0])
    return float(rows[metric].iloc[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", help="a serving run directory, or a directory above several")
    ap.add_argument("--metric", default="tpot_ms", help=f"column to compare (e.g. {', '.join(METRICS)})")
    ap.add_argument("--resimulate", action="store_true",
                    help="simulate each run again with today's cost model instead of its stored simulated rows")
    args = ap.parse_args(argv)
    try:
        runs = find_run_dirs(Path(args.results_dir))
        for run in runs:
            df, manifest = load_run(run)
            exp = str(df["exp"].iloc[0])
            if exp not in POINT_KEYS:
                continue
            note = ""
            if args.resimulate and manifest.get("derived_from") and len(runs) > 1:
                print(f"## {run}: derived from {', '.join(manifest['derived_from'])}; resimulate those runs\n")
                continue
            if args.resimulate:
                from experiments.resimulate import resimulate

                again = resimulate(run, manifest)
                df = pd.concat([df[df["mode"] == "measured"], again[again["mode"] == "simulated"]], ignore_index=True)
                note = " (simulated again with today's cost model)"
            print(f"## {run}{note}\n\n{compare_table(df, exp, args.metric)}\n")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
