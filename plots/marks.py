"""Drawing primitives shared by the figures: lines with OOM/error markers, grouped bars, axes set-up.

Figures are built on `matplotlib.figure.Figure` with an Agg canvas (no pyplot global state), so
rendering many runs in one process leaks nothing and needs no display.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from plots.style import context_label

FAIL_STYLE = {"oom": ("OOM", "#D62728"), "error": ("ERR", "#555555")}  # status -> (text, marker colour)
FAIL_LEGEND = {"oom": "OOM (out of memory)", "error": "ERR (run failed)"}
VALUE_LABEL_GID = "bar-value"  # marks value labels so they can be rotated after layout
_STACK_STEP = 0.065  # axes fraction between stacked failure markers at one x
_AUTO_LOG_RATIO = 30.0  # latency spread beyond which a linear axis hides the fast systems


@dataclass(frozen=True)
class Series:
    """One line: its rows (all statuses), legend label and matplotlib style (color, marker, linestyle)."""

    label: str
    rows: pd.DataFrame
    style: dict = field(default_factory=dict)


def new_figure(
    nrows: int, ncols: int, panel_w: float, panel_h: float, legend_w: float = 2.6
) -> tuple[Figure, np.ndarray]:
    """A Figure on an Agg canvas and its axes as a 2-D array [nrows, ncols]; `legend_w` inches are
    added on the right for the outside legend so the panels keep their width."""
    fig = Figure(figsize=(panel_w * ncols + legend_w, panel_h * nrows + 0.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def context_axis(ax: Axes, contexts: Sequence[float]) -> None:
    """Log2 x axis with one tick per context length, labelled 1K 2K 4K ..."""
    ticks = sorted({float(c) for c in contexts if np.isfinite(c) and c > 0})
    ax.set_xscale("log", base=2)
    if ticks:
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.set_xticklabels([context_label(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("Context length (tokens)")


def reserve_top(ax: Axes, data_max: float, data_min: float, frac: float) -> None:
    """Set y limits so the data fills the bottom (1 - frac) of the axes, in linear or log scale."""
    if not (np.isfinite(data_max) and data_max > 0):
        return
    if ax.get_yscale() == "log":
        lo = math.log10(data_min) - 0.1 * max(math.log10(data_max / data_min), 0.3)
        hi = lo + (math.log10(data_max) - lo) / (1.0 - frac)
        ax.set_ylim(10**lo, 10**hi)
        _plain_log_labels(ax, hi - lo)
    else:
        ax.set_ylim(0.0, data_max / (1.0 - frac))


def reserve_bottom(ax: Axes, frac: float) -> None:
    """Lower the y limit so the bottom `frac` of the axes is free of data (for a row of labels)."""
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log":
        span = math.log10(hi / lo)
        ax.set_ylim(lo / 10 ** (span * frac / (1.0 - frac)), hi)
        _plain_log_labels(ax, span / (1.0 - frac))
    else:
        ax.set_ylim(lo - (hi - lo) * frac / (1.0 - frac), hi)


def _plain_log_labels(ax: Axes, decades: float) -> None:
    """Log y ticks as plain numbers (0.1, 1, 10) rather than 10^k; on a short range also label the
    2x and 5x minor ticks so the axis carries more than one number."""
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if decades < 1.6:
        ax.yaxis.set_minor_formatter(
            FuncFormatter(
                lambda v, _: f"{v:g}" if round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""
            )
        )


def draw_lines(
    ax: Axes,
    series: Sequence[Series],
    x: str,
    y: str,
    yscale: str = "linear",
    ref_lines: Sequence[tuple[float, str]] = (),
) -> set[str]:
    """One line+marker per series through its ok points; oom/error points as markers at the top.

    Parameters
    ----------
    series : rows need columns `x`, `y`, `status`; several ok rows at one x (repeated runs) are averaged
        for the line, and each of them is drawn too, as a small unjoined marker, so the spread shows.
    yscale : "linear", "log", or "auto" (log when ok values span more than 30x).
    ref_lines : (y value, legend label) drawn as grey dashed horizontal lines (e.g. the HBM budget).

    Returns
    -------
    The failure statuses drawn ("oom", "error"), for the legend.
    """
    values: list[float] = [v for v, _ in ref_lines]
    failures: dict[float, list[tuple[str, str]]] = {}  # x -> [(status, series colour)]
    for i, s in enumerate(series):
        ok = s.rows[(s.rows["status"] == "ok") & s.rows[y].notna() & s.rows[x].notna()]
        at_x = ok.groupby(x, sort=True)[y]
        pts = at_x.mean()
        # each line a little thinner and its markers smaller than the one drawn before it, so lines that coincide
        # (e.g. systems holding the same GPU memory) still all show
        lw, ms = max(1.0, 2.2 - 0.25 * i), max(3.0, 7.0 - 0.9 * i)
        if len(pts):
            ax.plot(pts.index.to_numpy(float), pts.to_numpy(float), label=s.label, lw=lw, ms=ms, **s.style)
            values.extend(pts.to_numpy(float))
            repeated = ok[at_x.transform("size") > 1]
            if len(repeated):  # the runs behind an averaged point
                ax.plot(repeated[x].to_numpy(float), repeated[y].to_numpy(float), linestyle="none", ms=3, alpha=0.6,
                        **{k: v for k, v in s.style.items() if k not in ("linestyle", "ls")})
                values.extend(repeated[y].to_numpy(float))
        failed = s.rows[s.rows["status"].isin(list(FAIL_STYLE)) & s.rows[x].notna()]
        # A point that is ok somewhere (e.g. one repeat failed) is drawn as ok, not as a failure.
        for xv, status in sorted(set(zip(failed[x].astype(float), failed["status"], strict=True))):
            if xv not in pts.index:
                failures.setdefault(xv, []).append((status, s.style.get("color", "black")))
        if not len(pts) and len(failed):  # keep the series in the legend even if it never succeeded
            ax.plot([], [], label=s.label, lw=lw, ms=ms, **s.style)
    for value, label in ref_lines:
        ax.axhline(value, color="#555555", ls="--", lw=1.1, label=label)
    positive = [v for v in values if np.isfinite(v) and v > 0]
    if yscale == "auto":
        yscale = "log" if positive and max(positive) / min(positive) > _AUTO_LOG_RATIO else "linear"
    ax.set_yscale(yscale)
    depth = max((len(v) for v in failures.values()), default=0)
    if positive:
        reserve_top(ax, max(positive), min(positive), 0.08 + depth * _STACK_STEP)
    x_right = max((float(v) for s in series for v in s.rows[x].dropna()), default=None)
    _draw_failures(ax, failures, x_right)
    return {status for marks in failures.values() for status, _ in marks}


def _draw_failures(ax: Axes, failures: dict[float, list[tuple[str, str]]], x_right: float | None) -> None:
    """Stacked markers at the top of the axes (x in data, y in axes coordinates); the text takes the
    failing series' colour so one can tell which system failed. At the rightmost x of the panel the
    text goes left of the marker, so it never runs into the legend beside the axes."""
    trans = ax.get_xaxis_transform()
    for xv, marks in failures.items():
        for i, (status, colour) in enumerate(marks):
            text, marker_colour = FAIL_STYLE[status]
            yv = 0.96 - i * _STACK_STEP
            ax.plot(
                [xv],
                [yv],
                transform=trans,
                marker="x",
                color=marker_colour,
                ms=7,
                mew=2,
                ls="none",
                clip_on=False,
            )
            right = xv == x_right
            ax.annotate(
                text,
                (xv, yv),
                xycoords=trans,
                xytext=(-6 if right else 6, 0),
                textcoords="offset points",
                ha="right" if right else "left",
                va="center",
                fontsize=7,
                color=colour,
                fontweight="bold",
            )


def failure_handles(statuses: set[str]) -> list[Line2D]:
    """Legend proxies for the failure markers that were drawn."""
    return [
        Line2D([], [], marker="x", color=FAIL_STYLE[s][1], mew=2, ls="none", label=FAIL_LEGEND[s])
        for s in ("oom", "error")
        if s in statuses
    ]


def outside_legend(anchor: Axes, sources: Sequence[Axes], extra: Sequence[Line2D] = ()) -> None:
    """One legend for the whole figure, right of `anchor`, with each label once."""
    seen: dict[str, object] = {}
    for ax in sources:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    for handle in extra:
        seen.setdefault(handle.get_label(), handle)
    if seen:
        anchor.legend(
            list(seen.values()), list(seen), loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False
        )


def rotate_clashing_value_labels(fig: Figure) -> None:
    """Turn the bar value labels of an axes vertical when any two of them overlap horizontally.

    Decided on the laid-out figure (call after tight_layout), because how wide a bar is in inches
    is only known then. Headroom for vertical labels is reserved when the bars are drawn.
    """
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = [t for t in ax.texts if t.get_gid() == VALUE_LABEL_GID]
        boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
        if any(b.x0 < a.x1 for a, b in pairwise(boxes)):
            for t in labels:
                t.set_rotation(90)
                t.set_fontsize(6.5)


def label_groups(
    df: pd.DataFrame, sort: Sequence[str], base: Callable[[pd.DataFrame], pd.Series], extras: Sequence[str]
) -> tuple[pd.DataFrame, list[str]]:
    """Add a "group" column: `base(rows)` plus "name=value" for each of `extras` that takes several values.

    Returns the rows (sorted by `sort`, then the varying extras) with "group", and the group labels
    in that x order.
    """
    varying = [c for c in extras if c in df.columns and df[c].nunique(dropna=True) > 1]
    out = df.sort_values([*sort, *varying], kind="stable").copy()
    labels = base(out).astype(str)
    for col in varying:
        labels = labels + "\n" + col.replace("_len", "") + "=" + out[col].map(_short)
    out["group"] = labels
    return out, list(dict.fromkeys(out["group"]))


def _short(v: object) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", transform=ax.transAxes, ha="center", va="center", color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def draw_grouped_bars(
    ax: Axes,
    df: pd.DataFrame,
    group: str,
    groups: Sequence[str],
    variants: Sequence[str],
    value: str,
    style: Callable[[str], dict],
    logy: bool = False,
    fmt: Callable[[float], str] | None = None,
    floor: str | None = None,
    floor_color: str = "black",
) -> bool:
    """Bars of `value` per variant within each group; failed bars become an "OOM"/"ERR" note.

    Parameters
    ----------
    df : rows with columns `group`, "variant", "status", `value` (and `floor`); the median of the ok
        rows of a (group, variant) is drawn.
    groups, variants : x order of the groups and bar order within a group.
    style : variant -> bar kwargs (label, color, hatch ...).
    fmt : value -> text written above each bar, or None for no labels.
    floor : column drawn as a short dashed mark across each bar (e.g. the link floor), in `floor_color`.

    Returns
    -------
    True if any floor mark was drawn (so the caller can add it to the legend).
    """
    width = 0.8 / max(len(variants), 1)
    ok = df[(df["status"] == "ok") & df[value].notna()]
    if logy:
        ok = ok[ok[value] > 0]  # a zero bar has no height on a log axis
    cells = ok.groupby([group, "variant"])[value].median()
    floors = ok.groupby([group, "variant"])[floor].median() if floor else pd.Series(dtype=float)
    failed = df[df["status"] != "ok"].groupby([group, "variant"])["status"].first()
    heights: list[float] = []
    drew_floor = False
    for i, variant in enumerate(variants):
        xs = np.arange(len(groups)) + (i - (len(variants) - 1) / 2) * width
        vals = np.array([cells.get((g, variant), np.nan) for g in groups], dtype=float)
        ax.bar(xs, np.nan_to_num(vals), width, edgecolor="white", linewidth=0.5, **style(variant))
        for xv, g, v in zip(xs, groups, vals, strict=True):
            if np.isfinite(v):
                heights.append(v)
                if fmt:
                    ax.annotate(
                        fmt(v),
                        (xv, v),
                        xytext=(0, 2),
                        textcoords="offset points",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        gid=VALUE_LABEL_GID,
                        # over the target / floor marks, which would otherwise strike through a short bar's label
                        zorder=4,
                        bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.85},
                    )
                fv = floors.get((g, variant), np.nan)
                if np.isfinite(fv) and fv > 0:
                    ax.hlines(fv, xv - width / 2, xv + width / 2, colors=floor_color, linestyles="--", lw=1.2)
                    heights.append(fv)
                    drew_floor = True
            elif (g, variant) in failed.index:
                note, colour = FAIL_STYLE[failed[(g, variant)]]
                ax.annotate(
                    note,
                    (xv, 0.02),
                    xycoords=ax.get_xaxis_transform(),
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=6.5,
                    color=colour,
                    fontweight="bold",
                )
    ax.set_xticks(np.arange(len(groups)))
    ax.set_xticklabels(groups)
    ax.grid(axis="x", visible=False)
    if logy:
        ax.set_yscale("log")
    positive = [h for h in heights if h > 0]
    if positive:
        reserve_top(ax, max(positive), min(positive), 0.22 if fmt else 0.08)
    return drew_floor
