"""Render a run's paper figures from its results directory: `python -m plots.render RESULTS_DIR`.

RESULTS_DIR is a run directory (holds results.parquet + manifest.json) or any directory above
run directories; every run found gets `figures/<figure>.png`, and the written paths are printed.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from PIL import Image

from directkv.errors import ConfigError, unknown_name
from plots.figures.context_sweep import fig11_context_sweep
from plots.figures.cpu_attention import fig_cpu_attention
from plots.figures.gemm_case_study import fig2_5_gemm
from plots.figures.interconnect_sweep import fig14_interconnect
from plots.figures.kernel_ablation import fig12_reread, fig13_kernel_time
from plots.figures.rate_sweep import fig10_rate_sweep
from plots.load import find_run_dirs, load_run, run_exp
from plots.style import RC

FigureFn = Callable[[pd.DataFrame, Mapping[str, Any]], Figure]

# Figures are stored as 256-colour palette PNGs: our line and bar plots use a few colours plus their anti-aliasing,
# which a median-cut palette keeps, at ~40% of the RGBA file's bytes. The results tree travels to the GPU machine
# with the code, under a 64 MiB cap, and every run directory holds its figures.
PNG_COLOURS = 256

# exp name -> {png file stem: figure function}; one function per paper figure.
FIGURES: dict[str, dict[str, FigureFn]] = {
    "rate_sweep": {"fig10_rate_sweep": fig10_rate_sweep},
    "context_sweep": {"fig11_context_sweep": fig11_context_sweep},
    "kernel_ablation": {"fig12_reread": fig12_reread, "fig13_kernel_time": fig13_kernel_time},
    "gemm_case_study": {"fig2_5_gemm": fig2_5_gemm},
    "interconnect_sweep": {"fig14_interconnect": fig14_interconnect},
    "cpu_attention": {"cpu_attention": fig_cpu_attention},  # beyond the paper: cpu_attn's CPU kernels
}


def render_run(run_dir: Path) -> list[Path]:
    """Write the figures of one run into `run_dir/figures/`.

    Parameters
    ----------
    run_dir : directory holding results.parquet and manifest.json.

    Returns
    -------
    Paths of the PNGs written, one per figure of the run's experiment.

    Raises
    ------
    ConfigError : missing/invalid files, or an experiment with no figures (lists the known ones).
    """
    run_dir = Path(run_dir)
    df, manifest = load_run(run_dir)
    exp = run_exp(df, manifest, str(run_dir))
    if exp not in FIGURES:
        raise unknown_name("experiment", exp, FIGURES)
    out_dir = run_dir / "figures"
    out_dir.mkdir(exist_ok=True)
    written = []
    with matplotlib.rc_context(RC):
        for stem, make in FIGURES[exp].items():
            path = out_dir / f"{stem}.png"
            save_png(make(df, manifest), path)
            written.append(path)
    return written


def save_png(fig: Figure, path: Path) -> None:
    """Write `fig` to `path` as a palette PNG (PNG_COLOURS colours, no dithering, so flat areas stay flat)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    with Image.open(buf) as im:
        palette_png(im).save(path, format="PNG", optimize=True)


def palette_png(im: Image.Image) -> Image.Image:
    """`im` (any mode) as a PNG_COLOURS-colour palette image: median cut, no dithering."""
    return im.convert("RGB").quantize(colors=PNG_COLOURS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: render every run under RESULTS_DIR; one line on stderr and exit 2 per bad input."""
    parser = argparse.ArgumentParser(prog="python -m plots.render", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path, help="a run directory or a directory above run directories")
    args = parser.parse_args(argv)
    try:
        runs = find_run_dirs(args.results_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = 0
    for run in runs:
        try:
            paths = render_run(run)
        except ConfigError as e:
            # One bad run must not hide the figures of the others; it still fails the command.
            print(f"error: {run}: {e}", file=sys.stderr)
            failed += 1
            continue
        for path in paths:
            print(path)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
