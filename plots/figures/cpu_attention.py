"""cpu_attn's CPU decode attention: time and K/V read rate per kernel, per (decodes x cached tokens) point."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from plots.figures.common import bar_style, finish
from plots.load import require_columns
from plots.marks import draw_grouped_bars, label_groups, new_figure, outside_legend
from plots.style import context_label, variant_rank

COLUMNS = ("batch_size", "context_len", "variant", "time_ms", "gbps")


def _point(rows: pd.DataFrame) -> pd.Series:
    """Point label per row, e.g. "64 × 256" (decodes × cached tokens each)."""
    return rows["batch_size"].astype(int).astype(str) + " × " + rows["context_len"].map(context_label)


def fig_cpu_attention(df: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Per point, each kernel's time per layer (log axis, ms labels) and the K/V bytes it read per second.

    Parameters
    ----------
    df : cpu_attention rows (batch_size, context_len, variant, time_ms, gbps, status, mode; page_order, one
        row of panels each; hardware names the CPU, threads how many of its threads ran).
    manifest : run manifest.
    """
    require_columns(df, COLUMNS, "cpu_attention")
    orders = sorted(df["page_order"].dropna().unique()) if "page_order" in df.columns else [None]
    variants = sorted(df["variant"].unique(), key=lambda v: (variant_rank(v), v))
    n_points = df.groupby(["batch_size", "context_len"]).ngroups
    fig, axes = new_figure(len(orders), 2, max(3.6, 0.35 * n_points * len(variants) + 1.2), 3.4)
    ms = lambda v: f"{v:.2f}" if v < 10 else f"{v:.0f}"  # noqa: E731
    for r, order in enumerate(orders):
        sub = df if order is None else df[df["page_order"] == order]
        rows, groups = label_groups(sub, ["context_len", "batch_size"], _point, ["threads", "dtype", "hardware"])
        where = "" if order is None else f", {order} pages"
        draw_grouped_bars(axes[r, 0], rows, "group", groups, variants, "time_ms", bar_style, logy=True, fmt=ms)
        axes[r, 0].set(title=f"({chr(97 + 2 * r)}) Time per layer{where}", ylabel="Time (ms, log scale)",
                       xlabel="decodes × cached tokens each")
        draw_grouped_bars(axes[r, 1], rows, "group", groups, variants, "gbps", bar_style, fmt=lambda v: f"{v:.1f}")
        axes[r, 1].set(title=f"({chr(98 + 2 * r)}) K/V read rate{where}", ylabel="GB/s of K/V",
                       xlabel="decodes × cached tokens each")
    outside_legend(axes[0, -1], list(axes.flat))
    hw = df["hardware"].iloc[0] if "hardware" in df.columns and df["hardware"].nunique() == 1 else "CPU"
    threads = f", {int(df['threads'].iloc[0])} threads" if "threads" in df.columns and df["threads"].nunique() == 1 else ""
    # measured on the CPU the title names: not "on <GPU>", which the manifest records wherever a GPU was present
    return finish(fig, f"CPU decode attention (cpu_attn), {hw}{threads}", df, {**manifest, "gpu": "none"})
