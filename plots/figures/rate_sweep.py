"""Fig. 10: per-token latency vs request rate, one panel per dataset (columns) and model (rows)."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from plots.figures.common import finish, panel_groups, system_series
from plots.load import require_columns
from plots.marks import draw_lines, failure_handles, new_figure, no_data, outside_legend
from plots.style import dataset_label, dataset_rank

COLUMNS = ("dataset", "rate", "tpot_ms")


def fig10_rate_sweep(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Mean per-token latency (TPOT incl. queueing) vs Poisson request rate, one line per system.

    Parameters
    ----------
    df : rate_sweep rows (system, variant, model, hardware, status, mode, dataset, rate, tpot_ms).
    manifest : run manifest (gpu name for the title).
    """
    require_columns(df, COLUMNS, "rate_sweep")
    datasets = sorted(df["dataset"].astype(str).unique(), key=lambda d: (dataset_rank(d), d))
    models = panel_groups(df, ["model", "hardware"])
    fig, axes = new_figure(len(models), len(datasets), 4.4, 3.3)
    failures: set[str] = set()
    letters = iter(string.ascii_lowercase)
    for row, (caption, rows) in enumerate(models):
        for col, dataset in enumerate(datasets):
            ax = axes[row, col]
            sub = rows[rows["dataset"].astype(str) == dataset]
            title = f"({next(letters)}) {dataset_label(dataset)}" + (f": {caption}" if caption else "")
            ax.set_title(title)
            if sub.empty:
                no_data(ax, "rows for this dataset")
                continue
            failures |= draw_lines(ax, system_series(sub), "rate", "tpot_ms", yscale="auto")
            # ticks at the rates served: matplotlib's own put 19.00, 19.25, ... around a run of one rate
            rates = sorted(float(r) for r in pd.to_numeric(sub["rate"], errors="coerce").dropna().unique())
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.set_xlabel("Request rate (req/s)")
            ax.set_ylabel("Per-token latency (ms)")
    outside_legend(axes[0, -1], list(axes.flat), failure_handles(failures))
    return finish(fig, "Fig. 10: per-token latency vs request rate", df, manifest)
