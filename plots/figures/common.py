"""Splitting rows into panels and series, and finishing a figure; used by every figure module."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties

from plots.marks import Series, rotate_clashing_value_labels
from plots.style import (
    ANCHOR_VARIANTS,
    figure_title,
    hardware_label,
    system_label,
    system_rank,
    system_style,
    variant_colour,
    variant_label,
)


def panel_groups(df: pd.DataFrame, keys: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    """Rows split by the `keys` (e.g. model, hardware) that take several values.

    Returns
    -------
    [(caption, rows)] in sorted key order; the caption names every key constant within the rows
    (so a single-model figure still says which model it shows).
    """
    varying = [k for k in keys if k in df.columns and df[k].nunique(dropna=False) > 1]
    if not varying:
        return [(_caption(df, keys), df)]
    return [(_caption(rows, keys), rows) for _, rows in df.groupby(varying, sort=True, dropna=False)]


def _caption(rows: pd.DataFrame, keys: Sequence[str]) -> str:
    """The value of each key constant in `rows`, joined: e.g. "llama-3.1-8b, H200 (PCIe5)"."""
    parts = []
    for k in keys:
        if k in rows.columns and rows[k].nunique(dropna=True) == 1:
            v = str(rows[k].dropna().iloc[0])
            parts.append(hardware_label(v) if k == "hardware" else v)
    return ", ".join(p for p in parts if p)


MODE_ORDER = {"measured": 0, "simulated": 1, "projected": 2}


# Executor options that change a system's numbers (most only measured; the rings, pipelining, hbm_prefill and
# directkv_no_past_prefill simulated too): when one figure holds rows with several values of one (graphs on and off,
# say), they become separate series instead of being averaged into one line. Each maps a value to its label (values not listed show as they
# are) or is a format for the value. The pipelining columns are those systems.Pipelining.as_dict writes.
EXECUTOR_OPTIONS = {"cuda_graphs": {True: "graphs", False: "eager"}, "cpu_attn_kernel": {},
                    "prefill_new_pass": {"kernel": "tiled prefill", "flash": "flash prefill"},
                    "hbm_prefill": {"kernel": "kernel HBM prompts", "sdpa": "SDPA HBM prompts"},
                    "directkv_no_past_prefill": {"kernel": "kernel first chunks", "sdpa": "SDPA first chunks"},
                    "directkv_stream_slots": "{:g} x 32 MiB rings", "directkv_stream_chunk_mib": "{:g} MiB decode slots",
                    "directkv_pipelined": {True: "pipelined", False: "one batch"},
                    "directkv_side_ctas": "{:g} side CTAs", "directkv_pipeline_min_kv_mb": "cut from {:g} MB",
                    "directkv_pipeline_mixed": {True: "mixed steps cut", False: "decode-only cuts"}}


def _option_label(value, names: dict | str) -> str:
    if pd.isna(value):
        return ""
    return str(names.get(value, value)) if isinstance(names, dict) else names.format(value)


def executor_tags(rows: pd.DataFrame) -> pd.Series:
    """Per row, the values of the executor options that vary within `rows` ("" where none does)."""
    tags = pd.Series("", index=rows.index)
    for col, names in EXECUTOR_OPTIONS.items():
        if col not in rows.columns or rows[col].dropna().nunique() < 2:
            continue
        part = rows[col].map(lambda v, names=names: _option_label(v, names))
        tags = tags.str.cat(part, sep=", ").str.strip(", ")
    return tags


def system_series(rows: pd.DataFrame) -> list[Series]:
    """One Series per (system, variant), in legend order (DirectKV first).

    When the rows mix modes (a GPU run beside its simulation), each mode is its own series: measured
    solid, simulated/projected dashed with hollow markers, so the two are never averaged together. Measured
    rows that differ in an executor option (EXECUTOR_OPTIONS) are split the same way; all but the first
    value are dotted.
    """
    rows = rows.assign(_executor=executor_tags(rows))
    by_mode = rows["mode"].nunique() > 1
    cols = ["system", "variant", "mode", "_executor"] if by_mode else ["system", "variant", "_executor"]
    keys = sorted(rows.groupby(cols).groups,
                  key=lambda k: (system_rank(k[0]), k[0], k[1], MODE_ORDER.get(k[2], 9) if by_mode else 0, k[-1]))
    tags = sorted(t for t in rows["_executor"].unique() if t)
    out = []
    for key in keys:
        sys_, var, tag = key[0], key[1], key[-1]
        mask = (rows["system"] == sys_) & (rows["variant"] == var) & (rows["_executor"] == tag)
        style, label = dict(system_style(sys_, var)), system_label(sys_, var)
        if by_mode:
            mask &= rows["mode"] == key[2]
            label = f"{label}, {key[2]}"
            if key[2] != "measured":
                style |= {"linestyle": "--", "markerfacecolor": "none"}
        if tag:
            label = f"{label} ({tag})"
            if tag != tags[0]:
                style |= {"linestyle": ":"}
        out.append(Series(label, rows[mask].drop(columns="_executor"), style))
    return out


FASTEST = "stream:fastest"  # the bar standing for the fastest "stream:<option>" row of a point


def with_fastest_option(df: pd.DataFrame, shown: Sequence[str], keys: Sequence[str]) -> pd.DataFrame:
    """The rows of the `shown` variants, plus per point (the `keys` present: what makes a bar group, e.g. sizes or
    contexts, hardware) the rows of its fastest "stream:<option>" (lowest median time over its ok rows, the value
    its bar draws) as variant FASTEST, the option kept in "option". A GPU run measures ~20 options per point
    (chunk cuts, graphs, merges); drawn side by side they do not read. Others are left out."""
    drawn = df[df["variant"].isin(shown)]
    options = df[df["variant"].astype(str).str.startswith("stream:") & (df["status"] == "ok") & df["time_ms"].notna()]
    if options.empty:
        return drawn
    keys = [c for c in keys if c in options.columns]
    median = options.groupby([*keys, "variant"], dropna=False)["time_ms"].median().reset_index()
    best = median.loc[median.groupby(keys, dropna=False)["time_ms"].idxmin(), [*keys, "variant"]]
    picked = options.merge(best, on=[*keys, "variant"])
    picked["option"] = picked["variant"].str.partition(":")[2]
    picked["variant"] = FASTEST
    return pd.concat([drawn, picked], ignore_index=True)


def fastest_option_label(rows: pd.DataFrame, label: pd.Series) -> pd.Series:
    """Each row's group `label`, plus the fastest stream option of its group where there is one."""
    if "option" not in rows.columns:
        return label
    option = rows["option"].where(rows["variant"] == FASTEST).groupby(label).transform("first")
    return label + option.map(lambda o: f"\nfastest stream:\n{o}" if isinstance(o, str) else "")


def fastest_style(variant: str) -> dict[str, Any]:
    """bar_style, and the FASTEST bar's own colour and label."""
    if variant == FASTEST:
        return bar_style("stream") | {"label": "streamed, fastest option", "color": "#882255"}
    return bar_style(variant)


def bar_style(variant: str) -> dict[str, Any]:
    """Bar kwargs of a kernel variant; library/baseline anchors are hatched."""
    style: dict[str, Any] = {"label": variant_label(variant), "color": variant_colour(variant)}
    if variant in ANCHOR_VARIANTS:
        style["hatch"] = "///"
    return style


def finish(fig: Figure, what: str, rows: pd.DataFrame, manifest: Mapping[str, Any]) -> Figure:
    """Suptitle with the mode of `rows` (wrapped to the figure width), then tight_layout."""
    title = figure_title(what, rows["mode"], manifest)
    # ~0.6 em per character at the suptitle size; keeps a long title from being cut at the edges.
    size = FontProperties(size=matplotlib.rcParams["figure.titlesize"]).get_size_in_points()
    chars = int(fig.get_figwidth() * 72 / (0.6 * size))
    fig.suptitle("\n".join(textwrap.wrap(title, max(chars, 30))))
    fig.tight_layout()
    rotate_clashing_value_labels(fig)
    return fig
