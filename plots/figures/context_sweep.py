"""Fig. 11: per-token latency (a) and GPU memory (b) vs context length, one line per system."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from plots.figures.common import finish, panel_groups, system_series
from plots.load import config_get, require_columns
from plots.marks import context_axis, draw_lines, failure_handles, new_figure, outside_legend

COLUMNS = ("context_len", "tpot_ms", "gpu_mem_gb")


def hbm_budget_gb(rows: pd.DataFrame, manifest: Mapping[str, Any]) -> float | None:
    """HBM budget for the memory panel: the rows' `hbm_budget_gb` column, else the manifest's
    config hardware.hbm_budget_gb; None when neither gives a positive number."""
    if "hbm_budget_gb" in rows.columns:
        col = pd.to_numeric(rows["hbm_budget_gb"], errors="coerce").dropna()
        if len(col):
            return float(col.iloc[0]) if col.iloc[0] > 0 else None
    value = config_get(manifest, "hardware.hbm_budget_gb")
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if np.isfinite(value) and value > 0 else None


def fig11_context_sweep(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Two panels per model (row): per-token latency and GPU memory vs context length.

    Parameters
    ----------
    df : context_sweep rows (system, variant, model, hardware, status, mode, context_len, tpot_ms,
        gpu_mem_gb; optional hbm_budget_gb).
    manifest : run manifest (gpu name, config hardware.hbm_budget_gb).
    """
    require_columns(df, COLUMNS, "context_sweep")
    panels = panel_groups(df, ["model", "hardware"])
    fig, axes = new_figure(len(panels), 2, 4.4, 3.3)
    failures: set[str] = set()
    letters = iter(string.ascii_lowercase)
    for row, (caption, rows) in enumerate(panels):
        series = system_series(rows)
        budget = hbm_budget_gb(rows, manifest)
        refs = [(budget, f"HBM budget ({budget:g} GB)")] if budget else []
        lat, mem = axes[row]
        failures |= draw_lines(lat, series, "context_len", "tpot_ms", yscale="auto")
        failures |= draw_lines(mem, series, "context_len", "gpu_mem_gb", ref_lines=refs)
        lat.set_ylabel("Per-token latency (ms)")
        mem.set_ylabel("GPU memory (GB)")
        for ax, what in ((lat, "Per-token latency"), (mem, "GPU memory")):
            context_axis(ax, rows["context_len"])
            ax.set_title(f"({next(letters)}) {what}" + (f": {caption}" if caption else ""))
    outside_legend(axes[0, -1], list(axes.flat), failure_handles(failures))
    return finish(fig, "Fig. 11: per-token latency and GPU memory vs context length", df, manifest)
