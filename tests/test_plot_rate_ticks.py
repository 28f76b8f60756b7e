"""Fig. 10's rate axis is ticked at the rates served, whether a run served one rate or several."""

import math

import pandas as pd
import pytest

from plots.figures.rate_sweep import fig10_rate_sweep


def _rows(rates):
    return pd.DataFrame([
        {"exp": "rate_sweep", "system": s, "variant": "stream" if s == "directkv" else "", "model": "llama-3.1-8b",
         "hardware": "h200-pcie5", "mode": mode, "status": "ok", "error": "", "dataset": "sharegpt", "rate": r,
         "tpot_ms": 30.0 + r + (2 if mode == "measured" else 0), "context_len": math.nan}
        for s in ("directkv", "swap") for mode in ("measured", "simulated") for r in rates])


@pytest.mark.parametrize("rates", [[20.0], [1.0, 5.0, 10.0, 20.0, 30.0], [0.5, 10.0]])
def test_rate_axis_ticks_are_the_rates_served(rates):
    fig = fig10_rate_sweep(_rows(rates), {"gpu": "NVIDIA H200"})
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == rates
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{r:g}" for r in rates]
