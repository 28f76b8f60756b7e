"""Figs. 12 and 13: per kernel variant, link re-read factor (12) and kernel time (13), one panel per op.

Groups on the x axis are context lengths; q_len, batch, model or hardware are added to the group
label only when they vary within an op, so a plain sweep keeps short "16K"-style labels. Drawn: the paper's
variants, plain stream, the anchors (decode's `read_probe`: a plain read of the same bytes), and per point the
fastest stream option as one bar, named under the point (a GPU run measures ~20 stream options and tiled
diagnostics per point; every row stays in results.parquet). Fig. 13 marks each prefill bar at its target where
rows carry `target_ms`, other ops' bars at the link floor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from plots.figures.common import FASTEST, fastest_option_label, fastest_style, finish, with_fastest_option
from plots.load import require_columns
from plots.marks import draw_grouped_bars, label_groups, new_figure, no_data, outside_legend
from plots.style import context_label, op_label, op_rank, variant_rank

COLUMNS = ("op", "variant", "context_len", "time_ms", "link_read_bytes", "kv_bytes")
GROUP_EXTRAS = ("q_len", "batch", "model", "hardware")
# read_probe (decode, measured runs from 2026-12-03): the plain streaming read of the point's own K/V bytes, what
# any zero-copy kernel could reach at that size
SHOWN = ("naive", "tiled", "pipelined", "stream", "separate", "fused", "sdpa_hbm", "sdpa_zero_copy", "swap_sdpa",
         "read_probe")
POINT = ("op", "context_len", *GROUP_EXTRAS)  # a bar group: one fastest stream option each
# column -> (legend label, colour) of the dashed mark drawn across each bar
MARKS = {"floor_ms": ("link floor (bytes / link BW)", "black"),
         "target_ms": ("target: 1.15 × max(link floor, SDPA in HBM)", "#CC3311")}
MAX_ROW_WIDTH_IN = 13.0  # wider than this and a side-by-side figure no longer reads on a page


def _op_panels(
    df: pd.DataFrame,
    value: str,
    ylabel: str,
    logy: bool,
    fmt: Callable[[float], str] | None = None,
    marks: Sequence[str] = (),
    ref: tuple[float, str] | None = None,
) -> Figure:
    """One bar panel per op of `value` per variant per context, one legend on the right.

    `marks`: columns (of MARKS) drawn as a dashed mark per bar, the first one an op's rows have values of;
    `ref` = (y, label) a dotted line per panel.
    """
    df = with_fastest_option(df, SHOWN, POINT)
    ops = sorted(df["op"].astype(str).unique(), key=lambda o: (op_rank(o), o))
    panels = []
    for op in ops:
        rows, _ = label_groups(
            df[df["op"] == op], ["context_len"], lambda d: d["context_len"].map(context_label), GROUP_EXTRAS
        )
        rows["group"] = fastest_option_label(rows, rows["group"])
        groups = list(dict.fromkeys(rows["group"]))
        variants = sorted(rows["variant"].unique(), key=lambda v: (variant_rank(v), v))
        panels.append((op, rows, groups, variants))
    # a group naming its fastest stream option ("8chunks:graph") needs ~1.5 in for its label
    widths = [max(3.4, 0.17 * len(g) * len(v) + 1.2, 1.5 * len(g) * bool((r["variant"] == FASTEST).any()) + 1.2)
              for _, r, g, v in panels]
    if sum(widths) <= MAX_ROW_WIDTH_IN:
        fig, axes = new_figure(1, len(panels), sum(widths) / len(panels), 3.6)
    else:  # too many bars for one row on a page: one op per row instead
        fig, axes = new_figure(len(panels), 1, min(max(widths), MAX_ROW_WIDTH_IN), 3.2)
    drawn: set[str] = set()
    for ax, (op, rows, groups, variants) in zip(axes.flat, panels, strict=True):
        ax.set_title(op_label(op))
        if not rows[value].notna().any():
            no_data(ax, f"{value} values")
            continue
        mark = next((c for c in marks if c in rows.columns
                     and np.isfinite(pd.to_numeric(rows[c], errors="coerce")).any()), None)
        if draw_grouped_bars(ax, rows, "group", groups, variants, value, fastest_style, logy, fmt, mark,
                             MARKS[mark][1] if mark else "black"):
            drawn.add(mark)
        if ref:
            ax.axhline(ref[0], color="#555555", ls=":", lw=1.0, zorder=0, label=ref[1])
        ax.set_xlabel("Context length (tokens)")
        ax.set_ylabel(ylabel)
    handles = [Line2D([], [], color=color, ls="--", lw=1.2, label=label) for c, (label, color) in MARKS.items()
               if c in drawn]
    outside_legend(axes[0, -1], list(axes.flat), handles)
    return fig


def fig12_reread(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Re-read factor = link_read_bytes / kv_bytes per variant and context, one panel per op.

    A factor of 1 means each KV byte crossed the link once; naive zero-copy prefill re-reads KV
    once per query tile. Rows with no kv_bytes have no factor and are left out.
    """
    require_columns(df, COLUMNS, "kernel_ablation")
    rows = df.copy()
    kv = pd.to_numeric(rows["kv_bytes"], errors="coerce")
    rows["reread"] = pd.to_numeric(rows["link_read_bytes"], errors="coerce") / kv.where(kv > 0)
    fig = _op_panels(
        rows,
        "reread",
        "Link bytes read / KV bytes (×)",
        logy=False,
        fmt=lambda v: f"{v:.1f}×",
        ref=(1.0, "each KV byte read once (1×)"),
    )
    return finish(fig, "Fig. 12: KV re-read factor over the CPU-GPU link", df, manifest)


def fig13_kernel_time(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Kernel time per variant and context (log y), one panel per op; a dashed mark on each bar at the op's
    `target_ms` (prefill: 1.15 x max(link floor, SDPA in HBM)) where its rows have one, else at `floor_ms`
    (bytes over the link / link bandwidth) where present."""
    require_columns(df, COLUMNS, "kernel_ablation")
    fig = _op_panels(df, "time_ms", "Kernel time (ms, log scale)", logy=True, marks=("target_ms", "floor_ms"))
    return finish(fig, "Fig. 13: kernel time per variant", df, manifest)
