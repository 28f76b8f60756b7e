"""Figs. 2 and 5: GEMM with an operand in pinned CPU memory: time per variant per size, and L2 hit rate.

A GPU run measures ~25 variants per size (every option of the stream variant, diagnostics such as raster and
B in HBM); drawn side by side they do not read. The figure keeps the paper's variants, ring, the plain stream variant,
the cuBLAS anchors, and per size the fastest stream option as one bar, its option named under the size. Every
row stays in results.parquet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from plots.figures.common import fastest_option_label, fastest_style, finish, with_fastest_option
from plots.load import require_columns
from plots.marks import draw_grouped_bars, label_groups, new_figure, outside_legend
from plots.style import variant_rank

COLUMNS = ("m", "n", "k", "variant", "time_ms")
SHOWN = ("naive", "tiled", "pipelined", "ring", "stream", "cublas_hbm", "cublas_zero_copy")  # drawn as they are
TARGET_LABEL = "target: 1.15 × max(B bytes / H2D, cuBLAS in HBM)"


def _ms(v: float) -> str:
    return f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms" if v >= 1 else f"{v:.2f} ms"


def _size(rows: pd.DataFrame) -> pd.Series:
    """Size label per row, e.g. "10240×10240×10240"."""
    return rows[["m", "n", "k"]].astype(int).astype(str).agg("×".join, axis=1)


def figure_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows drawn: those of SHOWN, plus per size (and hardware, model) the rows of the fastest ok
    "stream:<option>" as variant FASTEST, its option kept in "option". Other variants are left out."""
    return with_fastest_option(df, SHOWN, ("m", "n", "k", "hardware", "model"))


def fig2_5_gemm(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Time per variant per (m, n, k) on a log axis with ms labels, each bar marked at the size's target where
    rows carry `target_ms`; a second panel of L2 hit rate (%) per variant when `l2_hit_pct` has values. Drawn:
    figure_rows (the paper's variants, plain stream, the anchors, the fastest stream option per size).

    Parameters
    ----------
    df : gemm_case_study rows (m, n, k, variant, time_ms, status, mode; optional target_ms, l2_hit_pct,
        hardware).
    manifest : run manifest (gpu name for the title).
    """
    require_columns(df, COLUMNS, "gemm_case_study")
    rows, _ = label_groups(figure_rows(df), ["m", "n", "k"], _size, ["hardware", "model"])
    rows["group"] = fastest_option_label(rows, rows["group"])
    groups = list(dict.fromkeys(rows["group"]))
    variants = sorted(rows["variant"].unique(), key=lambda v: (variant_rank(v), v))
    has_l2 = (
        "l2_hit_pct" in rows.columns and np.isfinite(pd.to_numeric(rows["l2_hit_pct"], errors="coerce")).any()
    )
    # a size's label runs to ~2.4 in ("10240×10240×10240"); the target's legend entry to ~4 in
    panel_w = max(3.6, 0.3 * len(groups) * len(variants) + 1.2, 2.6 * len(groups))
    fig, axes = new_figure(1, 2 if has_l2 else 1, panel_w, 3.8, legend_w=4.4)
    time_ax = axes[0, 0]
    has_target = "target_ms" in rows.columns and np.isfinite(pd.to_numeric(rows["target_ms"], errors="coerce")).any()
    marked = draw_grouped_bars(time_ax, rows, "group", groups, variants, "time_ms", fastest_style, logy=True, fmt=_ms,
                               floor="target_ms" if has_target else None)
    time_ax.set_title("(a) GEMM time" if has_l2 else "GEMM time")  # (b), the L2 hit rate, needs ncu counters
    time_ax.set_ylabel("Time (ms, log scale)")
    time_ax.set_xlabel("GEMM size (m×n×k)")
    if has_l2:
        l2_ax = axes[0, 1]
        draw_grouped_bars(
            l2_ax, rows, "group", groups, variants, "l2_hit_pct", fastest_style, fmt=lambda v: f"{v:.0f}%"
        )
        l2_ax.set_title("(b) L2 hit rate")
        l2_ax.set_ylabel("L2 hit rate (%)")
        l2_ax.set_xlabel("GEMM size (m×n×k)")
    target = Line2D([], [], color="black", ls="--", lw=1.2, label=TARGET_LABEL)
    outside_legend(axes[0, -1], list(axes.flat), [target] if marked else [])
    return finish(fig, "Figs. 2/5: GEMM with B in pinned CPU memory", df, manifest)
