"""Figs. 2 and 5: GEMM with an operand in pinned CPU memory: time per variant per size, and L2 hit rate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from plots.figures.common import bar_style, finish
from plots.load import require_columns
from plots.marks import draw_grouped_bars, label_groups, new_figure, outside_legend
from plots.style import variant_rank

COLUMNS = ("m", "n", "k", "variant", "time_ms")


def _ms(v: float) -> str:
    return f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms" if v >= 1 else f"{v:.2f} ms"


def _size(rows: pd.DataFrame) -> pd.Series:
    """Size label per row, e.g. "10240×10240×10240"."""
    return rows[["m", "n", "k"]].astype(int).astype(str).agg("×".join, axis=1)


def fig2_5_gemm(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Time per variant per (m, n, k) on a log axis with ms labels; a second panel of L2 hit rate
    (%) per variant when `l2_hit_pct` has values.

    Parameters
    ----------
    df : gemm_case_study rows (m, n, k, variant, time_ms, status, mode; optional l2_hit_pct, hardware).
    manifest : run manifest (gpu name for the title).
    """
    require_columns(df, COLUMNS, "gemm_case_study")
    rows, groups = label_groups(df, ["m", "n", "k"], _size, ["hardware", "model"])
    variants = sorted(rows["variant"].unique(), key=lambda v: (variant_rank(v), v))
    has_l2 = (
        "l2_hit_pct" in rows.columns and np.isfinite(pd.to_numeric(rows["l2_hit_pct"], errors="coerce")).any()
    )
    panel_w = max(3.6, 0.3 * len(groups) * len(variants) + 1.2)
    fig, axes = new_figure(1, 2 if has_l2 else 1, panel_w, 3.8)
    time_ax = axes[0, 0]
    draw_grouped_bars(time_ax, rows, "group", groups, variants, "time_ms", bar_style, logy=True, fmt=_ms)
    time_ax.set_title("(a) GEMM time")
    time_ax.set_ylabel("Time (ms, log scale)")
    time_ax.set_xlabel("GEMM size (m×n×k)")
    if has_l2:
        l2_ax = axes[0, 1]
        draw_grouped_bars(
            l2_ax, rows, "group", groups, variants, "l2_hit_pct", bar_style, fmt=lambda v: f"{v:.0f}%"
        )
        l2_ax.set_title("(b) L2 hit rate")
        l2_ax.set_ylabel("L2 hit rate (%)")
        l2_ax.set_xlabel("GEMM size (m×n×k)")
    outside_legend(axes[0, -1], list(axes.flat))
    return finish(fig, "Figs. 2/5: GEMM with B in pinned CPU memory", df, manifest)
