"""Fig. 14: attention latency vs context on PCIe vs NVLink-C2C, with the PCIe/C2C ratio written
at each context. Colour = kernel variant, line style = interconnect."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from plots.figures.common import finish
from plots.load import require_columns
from plots.marks import (
    Series,
    context_axis,
    draw_lines,
    failure_handles,
    new_figure,
    outside_legend,
    reserve_bottom,
)
from plots.style import hardware_label, op_label, op_rank, variant_colour, variant_label, variant_rank

COLUMNS = ("op", "variant", "hardware", "context_len", "q_len", "time_ms")


def _is_c2c(hardware: str) -> bool:
    return "c2c" in hardware


def _series(rows: pd.DataFrame) -> list[Series]:
    keys = sorted(
        rows.groupby(["variant", "hardware"]).groups,
        key=lambda vh: (variant_rank(vh[0]), vh[0], _is_c2c(vh[1]), vh[1]),
    )
    # each line names its mode: a run mixes a simulated machine and a projected one
    mode = {h: "/".join(sorted(set(g["mode"]))) for h, g in rows.groupby("hardware")} if "mode" in rows else {}
    return [
        Series(
            f"{variant_label(v)}, {hardware_label(h)}" + (f" ({mode[h]})" if h in mode else ""),
            rows[(rows["variant"] == v) & (rows["hardware"] == h)],
            {
                "color": variant_colour(v),
                "ls": "--" if _is_c2c(h) else "-",
                "marker": "s" if _is_c2c(h) else "o",
            },
        )
        for v, h in keys
    ]


def _annotate_ratios(ax: Axes, rows: pd.DataFrame) -> None:
    """Write PCIe time / C2C time per variant at each context, one row of labels per variant in a
    band kept free at the bottom of the axes (next to the points they would cross other lines)."""
    ok = rows[(rows["status"] == "ok") & rows["time_ms"].notna()]
    hw = sorted(ok["hardware"].astype(str).unique())
    pcie = next((h for h in hw if "pcie" in h), None)
    c2c = next((h for h in hw if _is_c2c(h)), None)
    if pcie is None or c2c is None:
        return
    times = ok.groupby(["variant", "hardware", "context_len"])["time_ms"].mean()
    variants = sorted(ok["variant"].unique(), key=lambda v: (variant_rank(v), v))
    reserve_bottom(ax, 0.03 + 0.07 * len(variants))
    trans = ax.get_xaxis_transform()
    for row, variant in enumerate(reversed(variants)):
        for ctx in sorted(ok["context_len"].unique()):
            slow, fast = times.get((variant, pcie, ctx), np.nan), times.get((variant, c2c, ctx), np.nan)
            if np.isfinite(slow) and np.isfinite(fast) and fast > 0:
                ax.text(
                    ctx,
                    0.03 + 0.07 * row,
                    f"{slow / fast:.1f}×",
                    transform=trans,
                    ha="center",
                    va="bottom",
                    fontsize=7.5,
                    color=variant_colour(variant),
                    fontweight="bold",
                )


def fig14_interconnect(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Attention latency (log y) vs context length, one panel per (op, q_len), one line per
    (hardware, variant); "4.2×" labels give the PCIe/C2C ratio.

    Parameters
    ----------
    df : interconnect_sweep rows (op, variant, hardware, context_len, q_len, time_ms, status, mode).
    manifest : run manifest (gpu name for the title).
    """
    require_columns(df, COLUMNS, "interconnect_sweep")
    keys = sorted(df.groupby(["op", "q_len"], dropna=False).groups, key=lambda oq: (op_rank(oq[0]), oq))
    fig, axes = new_figure(1, len(keys), 4.6, 3.6, legend_w=3.2)
    failures: set[str] = set()
    for ax, (op, q_len) in zip(axes[0], keys, strict=True):
        rows = df[(df["op"] == op) & ((df["q_len"] == q_len) | (pd.isna(q_len) & df["q_len"].isna()))]
        failures |= draw_lines(ax, _series(rows), "context_len", "time_ms", yscale="log")
        _annotate_ratios(ax, rows)
        context_axis(ax, rows["context_len"])
        ax.set_ylabel("Attention latency (ms, log scale)")
        ax.set_title(op_label(op) + ("" if pd.isna(q_len) else f", q_len={int(q_len)}"))
    ratio_note = Line2D([], [], ls="none", label="n.n× (bottom) = PCIe time / C2C time")
    outside_legend(axes[0, -1], list(axes.flat), [*failure_handles(failures), ratio_note])
    return finish(fig, "Fig. 14: attention latency, PCIe vs NVLink-C2C", df, manifest)
