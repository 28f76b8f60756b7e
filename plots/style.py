"""Names, colours and titles shared by every figure, so one system looks the same everywhere.

Unknown system / variant / hardware names are drawn under their raw name with a fallback colour
rather than rejected: a new baseline added to the engine should still plot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from directkv.errors import ConfigError

RC: dict[str, Any] = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "figure.titlesize": 11,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "savefig.dpi": 150,
    "savefig.facecolor": "white",
}

MODES = ("measured", "simulated", "projected")
STATUSES = ("ok", "oom", "error")

# Okabe-Ito based, distinguishable in greyscale print by marker as well as colour.
SYSTEMS: dict[str, tuple[str, str, str]] = {  # system -> (label, colour, marker)
    "directkv": ("DirectKV", "#0072B2", "o"),
    "hbm": ("SGLang-like (HBM)", "#E69F00", "s"),
    "swap": ("Pie-like (swap)", "#009E73", "^"),
    "cpu_attn": ("Neo-like (CPU attn)", "#CC79A7", "D"),
    "flexgen": ("FlexGen-like (4-bit)", "#8C564B", "v"),
}
DIRECTKV_SHADES = {"tiled": "#0072B2", "fused": "#56B4E9", "naive": "#1B3A5C", "stream": "#332288"}

VARIANTS: dict[str, tuple[str, str]] = {  # kernel variant -> (label, colour)
    "naive": ("naive zero-copy", "#D55E00"),
    "tiled": ("CPU-aware tiled", "#0072B2"),
    "pipelined": ("tiled + warp pipeline", "#56B4E9"),
    "ring": ("SM-staged HBM ring", "#44AA99"),
    "fused": ("fused proj+attn", "#009E73"),
    "separate": ("separate kernels", "#E69F00"),
    "stream": ("streamed", "#CC79A7"),
    "flash": ("torch CPU flash, per decode", "#8C564B"),
    "native": ("native OpenMP, one call", "#0072B2"),
    "sdpa_hbm": ("SDPA, KV in HBM", "#4D4D4D"),
    "sdpa_zero_copy": ("SDPA, zero-copy KV", "#A6A6A6"),
    "swap_sdpa": ("swap to HBM + SDPA", "#8C564B"),
    "read_probe": ("plain read, same bytes", "#999933"),
    "cublas_hbm": ("cuBLAS, HBM", "#4D4D4D"),
    "cublas_zero_copy": ("cuBLAS, zero-copy", "#A6A6A6"),
}
# Anchors are library/baseline reference points, hatched so they read as "not ours".
ANCHOR_VARIANTS = frozenset({"sdpa_hbm", "sdpa_zero_copy", "swap_sdpa", "read_probe", "cublas_hbm", "cublas_zero_copy"})

HARDWARE_LABELS = {
    "h200-pcie5": "H200 (PCIe5)",
    "h100-pcie5": "H100 (PCIe5)",
    "gh200-c2c": "GH200 (NVLink-C2C)",
}
DATASET_LABELS = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}
OP_LABELS = {
    "decode": "Decode attention",
    "prefill": "Prefill attention",
    "proj_attention": "K/V projection + attention",
}

_FALLBACK_COLOURS = ("#1F77B4", "#FF7F0E", "#2CA02C", "#9467BD", "#17BECF", "#BCBD22", "#7F7F7F")
_FALLBACK_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _fallback(name: str, palette: tuple[str, ...]) -> str:
    # Stable across runs and processes (unlike hash()), so a new name keeps its colour.
    return palette[sum(name.encode()) % len(palette)]


def system_label(system: str, variant: str = "") -> str:
    """Legend label of a serving system, e.g. ("directkv", "tiled") -> "DirectKV (tiled)"."""
    base = SYSTEMS[system][0] if system in SYSTEMS else system
    if system == "directkv" and variant:
        return f"{base} ({variant})"
    return f"{base} [{variant}]" if variant else base


def system_style(system: str, variant: str = "") -> dict[str, str]:
    """Matplotlib line kwargs (color, marker) for a serving system."""
    if system in SYSTEMS:
        _, colour, marker = SYSTEMS[system]
        if system == "directkv":
            colour = DIRECTKV_SHADES.get(variant, colour)
        return {"color": colour, "marker": marker}
    return {
        "color": _fallback(system + variant, _FALLBACK_COLOURS),
        "marker": _fallback(system, _FALLBACK_MARKERS),
    }


def system_rank(system: str) -> int:
    """Legend order: DirectKV first, then the baselines as the paper lists them, unknown last."""
    order = list(SYSTEMS)
    return order.index(system) if system in order else len(order)


def variant_label(variant: str) -> str:
    """Legend label; a tuning/diagnostic variant "base:detail" reads "<base label> [detail]"."""
    if variant in VARIANTS:
        return VARIANTS[variant][0]
    base, _, detail = variant.partition(":")
    return f"{VARIANTS[base][0]} [{detail}]" if detail and base in VARIANTS else variant


def variant_colour(variant: str) -> str:
    """A known variant's colour; "base:detail" is a lighter shade of its base, so the family stays visible."""
    if variant in VARIANTS:
        return VARIANTS[variant][1]
    base, _, detail = variant.partition(":")
    if detail and base in VARIANTS:
        from matplotlib.colors import to_hex, to_rgb

        t = (0.3, 0.5, 0.7)[sum(detail.encode()) % 3]
        return to_hex(tuple(c + (1 - c) * t for c in to_rgb(VARIANTS[base][1])))
    return _fallback(variant, _FALLBACK_COLOURS)


def variant_rank(variant: str) -> int:
    order = list(VARIANTS)
    return order.index(variant) if variant in order else len(order)


def hardware_label(hardware: str) -> str:
    return HARDWARE_LABELS.get(hardware, hardware)


def op_label(op: str) -> str:
    return OP_LABELS.get(op, op)


def op_rank(op: str) -> int:
    order = list(OP_LABELS)
    return order.index(op) if op in order else len(order)


def dataset_label(dataset: str) -> str:
    return DATASET_LABELS.get(dataset, dataset)


def dataset_rank(dataset: str) -> int:
    order = list(DATASET_LABELS)
    return order.index(dataset) if dataset in order else len(order)


def context_label(tokens: float) -> str:
    """Tick label of a context length: 1024 -> "1K", 131072 -> "128K", 1000 -> "1000"."""
    n = int(tokens)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def mode_suffix(modes: Iterable[str], gpu: str | None = None) -> str:
    """Title suffix saying where the numbers come from.

    Parameters
    ----------
    modes : the `mode` values of the rows drawn (duplicates fine), each one of MODES.
    gpu : GPU name from the manifest, used only when every row is measured.

    Returns
    -------
    "(simulated)", "(projected)", "(measured on NVIDIA H200)", or for rows of several modes
    "(mixed: measured + simulated)" with the modes in MODES order.
    """
    present = set(modes)
    bad = present - set(MODES)
    if bad:
        raise ConfigError(f"unknown mode {sorted(bad)[0]!r}; valid: {', '.join(MODES)}")
    if not present:
        raise ConfigError("no rows to take the mode from; valid modes: " + ", ".join(MODES))
    if len(present) > 1:
        return "(mixed: " + " + ".join(m for m in MODES if m in present) + ")"
    (mode,) = present
    if mode == "measured":
        return f"(measured on {gpu})" if gpu else "(measured)"
    return f"({mode})"


def figure_title(what: str, modes: Iterable[str], manifest: Mapping[str, Any]) -> str:
    """`what` followed by the mode suffix, e.g. "Fig. 11: ... (simulated)"."""
    gpu = manifest.get("gpu")
    # The results writer records "none" when no CUDA device was visible.
    known = isinstance(gpu, str) and gpu.strip().lower() not in ("", "none", "unknown")
    return f"{what} {mode_suffix(modes, gpu if known else None)}"
