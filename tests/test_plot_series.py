"""How rows become lines: one series per system, variant, mode and executor option, never averaged across them;
repeated runs averaged and each shown; coinciding lines kept visible."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import pytest


def test_measured_and_simulated_rows_are_separate_series_never_averaged():
    import pandas as pd

    from plots.figures.common import system_series

    rows = pd.DataFrame({"system": ["directkv"] * 4, "variant": ["tiled"] * 4, "context_len": [1024, 1024, 4096, 4096],
                         "mode": ["measured", "simulated"] * 2, "tpot_ms": [30.0, 16.0, 61.0, 49.0],
                         "status": ["ok"] * 4})
    series = system_series(rows)
    assert [s.label.split(", ")[-1] for s in series] == ["measured", "simulated"]
    assert list(series[0].rows["tpot_ms"]) == [30.0, 61.0] and series[1].style["linestyle"] == "--"
    single = system_series(rows[rows["mode"] == "measured"])
    assert len(single) == 1 and "measured" not in single[0].label

def test_measured_rows_with_and_without_cuda_graphs_are_separate_series():
    """A run measuring graphs on and off (context_sweep/combined-20261129d-graphs) must not average the two."""
    import pandas as pd

    from plots.figures.common import system_series

    rows = pd.DataFrame({"system": ["hbm"] * 5, "variant": [""] * 5, "context_len": [1024, 1024, 4096, 4096, 1024],
                         "mode": ["measured"] * 4 + ["simulated"], "cuda_graphs": [False, True, False, True, None],
                         "tpot_ms": [37.7, 15.5, 36.8, 24.6, 5.8], "status": ["ok"] * 5})
    series = system_series(rows)
    assert [s.label for s in series] == ["SGLang-like (HBM), measured (eager)", "SGLang-like (HBM), measured (graphs)",
                                         "SGLang-like (HBM), simulated"]
    assert list(series[0].rows["tpot_ms"]) == [37.7, 36.8] and list(series[1].rows["tpot_ms"]) == [15.5, 24.6]
    assert series[1].style["linestyle"] == ":" and "linestyle" not in series[0].style
    same = system_series(rows[rows["cuda_graphs"] != False])  # noqa: E712 - one value of graphs: no tag
    assert [s.label for s in same] == ["SGLang-like (HBM), measured", "SGLang-like (HBM), simulated"]

def test_every_pipelining_column_splits_series():
    """Rows that differ only in a pipelining setting (context_sweep/20261129-192833 and -192902: mixed steps cut
    or not) are separate series; and every column Pipelining writes is an executor option."""
    import pandas as pd

    from directkv.engine.systems import Pipelining
    from plots.figures.common import EXECUTOR_OPTIONS, executor_tags, system_series

    assert set(Pipelining(enabled=True).as_dict()) <= set(EXECUTOR_OPTIONS)
    rows = pd.DataFrame({"system": ["directkv"] * 3, "variant": ["tiled"] * 3, "context_len": [16384] * 3,
                         "mode": ["measured"] * 3, "directkv_pipelined": [True, True, False],
                         "directkv_pipeline_mixed": [True, False, None], "directkv_side_ctas": [64, 32, None],
                         "directkv_pipeline_min_kv_mb": [32.0, 32.0, None], "tpot_ms": [164.3, 168.4, 172.0],
                         "status": ["ok"] * 3})
    assert list(executor_tags(rows)) == ["pipelined, 64 side CTAs, mixed steps cut",
                                         "pipelined, 32 side CTAs, decode-only cuts", "one batch"]
    assert sorted(float(s.rows["tpot_ms"].iloc[0]) for s in system_series(rows)) == [164.3, 168.4, 172.0]

def test_repeated_runs_at_one_point_are_averaged_and_each_shown():
    """Two runs of one point (rate_sweep/combined-20261129g-rate1: flexgen at Alpaca 1, 53.4 and 40.3 ms): the
    line goes through their mean and both runs are drawn as unjoined markers, so the spread is not hidden."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from plots.figures.common import system_series
    from plots.marks import draw_lines

    rows = pd.DataFrame({"system": ["flexgen"] * 3, "variant": [""] * 3, "rate": [1.0, 1.0, 5.0],
                         "mode": ["measured"] * 3, "tpot_ms": [53.4, 40.3, 62.6], "status": ["ok"] * 3})
    fig, ax = plt.subplots()
    draw_lines(ax, system_series(rows), "rate", "tpot_ms")
    line, runs = ax.get_lines()
    assert list(line.get_ydata()) == [pytest.approx(46.85), 62.6]
    assert sorted(runs.get_ydata()) == [40.3, 53.4] and runs.get_linestyle() == "None" and runs.get_label().startswith("_")  # not in the legend
    plt.close(fig)

def test_coinciding_lines_stay_visible_each_drawn_thinner_than_the_one_before() -> None:
    from plots.figures.common import system_series
    from plots.marks import draw_lines

    rows = pd.DataFrame({"system": ["directkv", "swap", "cpu_attn"] * 2, "variant": ["tiled", "", ""] * 2,
                         "context_len": [1024] * 3 + [4096] * 3, "mode": ["simulated"] * 6,
                         "gpu_mem_gb": [17.0] * 6, "status": ["ok"] * 6})  # three identical lines
    fig, ax = plt.subplots()
    draw_lines(ax, system_series(rows), "context_len", "gpu_mem_gb")
    widths = [ln.get_linewidth() for ln in ax.get_lines()]
    sizes = [ln.get_markersize() for ln in ax.get_lines()]
    assert len(widths) == 3 and widths == sorted(widths, reverse=True) and len(set(widths)) == 3
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
    plt.close(fig)
