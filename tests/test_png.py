"""Figures are written as palette PNGs (plots.render.save_png): smaller, and the same picture."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image
from test_plots import context_rows

from plots.figures.context_sweep import fig11_context_sweep
from plots.render import PNG_COLOURS, save_png
from plots.style import RC


def _figure():
    import matplotlib

    with matplotlib.rc_context(RC):
        return fig11_context_sweep(pd.DataFrame(context_rows()), {"config": {"hardware": {"hbm_budget_gb": 80.0}}})


def test_a_figure_is_a_smaller_palette_png_of_the_same_picture(tmp_path: Path):
    fig = _figure()
    full = io.BytesIO()
    fig.savefig(full, format="png")
    path = tmp_path / "fig.png"
    save_png(fig, path)
    with Image.open(path) as im, Image.open(full) as ref:
        assert im.mode == "P" and len(im.getcolors(PNG_COLOURS)) <= PNG_COLOURS
        assert im.size == ref.size
        got = np.asarray(im.convert("RGB"), dtype=np.int16)
        want = np.asarray(ref.convert("RGB"), dtype=np.int16)
        # the series' colours and the text survive: few pixels move, none far (no dithering noise)
        diff = np.abs(got - want).max(axis=-1)
        assert (diff > 24).mean() < 0.002 and diff.mean() < 1.0
        # every colour that fills many pixels (series, markers, text, background) is kept exactly
        colours, counts = np.unique(want.reshape(-1, 3), axis=0, return_counts=True)
        kept = {tuple(c) for c in np.unique(got.reshape(-1, 3), axis=0)}
        assert all(tuple(c) in kept for c in colours[counts > 500])
    assert path.stat().st_size < 0.6 * len(full.getvalue())
