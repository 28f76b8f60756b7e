"""Fig. 13 of a GPU run: the stream options of a point drawn as one bar, the prefill target marked."""

from __future__ import annotations

import pandas as pd
from matplotlib.collections import LineCollection

from plots.figures.common import FASTEST, with_fastest_option
from plots.figures.kernel_ablation import MARKS, POINT, SHOWN, fig13_kernel_time
from tests.test_plots import kernel_rows, row


def test_kernel_time_draws_the_fastest_stream_option_per_point_and_the_prefill_target() -> None:
    """Prefill at two q_lens with six stream options and tiled diagnostics each: the figure keeps the paper's
    variants and anchors, one bar for the fastest stream option of each point (named under it; a failed option
    is never picked), marks prefill's bars at their target and decode's at the link floor, and names both marks
    in the legend."""
    base = [r for r in kernel_rows() if r["op"] in ("decode", "prefill") and r["context_len"] == 16384.0]
    options = {512: {"stream": 2.0, "stream:4chunks": 1.7, "stream:8chunks:graph": 1.37, "stream:16chunks:graph": 1.41,
                     "stream:4chunks:graph:torch_merge": 1.45, "tiled:kv_hbm": 0.75},
               2048: {"stream": 2.6, "stream:4chunks:graph": 1.96, "stream:8chunks:graph": 1.95,
                      "stream:16chunks": 1.2, "tiled:cg": 5.0}}
    rows = []
    for q, target in ((512, 1.47), (2048, 2.0)):
        rows += [r | {"q_len": float(q), "target_ms": target} for r in base if r["op"] == "prefill"]
        rows += [row("kernel_ablation", system="", op="prefill", variant=v, context_len=16384.0, q_len=float(q),
                     time_ms=t, target_ms=target, kv_bytes=67e6, link_read_bytes=67e6, floor_ms=1.25, mode="measured",
                     status="error" if v == "stream:16chunks" else "ok")
                 for v, t in options[q].items()]
    rows += [r | {"floor_ms": 2.5} for r in base if r["op"] == "decode"]
    df = pd.DataFrame(rows)
    drawn = with_fastest_option(df, SHOWN, POINT)
    best = drawn[drawn["variant"] == FASTEST].set_index("q_len")
    assert best.loc[512.0, "option"] == "8chunks:graph" and best.loc[2048.0, "option"] == "8chunks:graph"
    assert not {"tiled:kv_hbm", "tiled:cg", "stream:4chunks"} & set(drawn["variant"])
    fig = fig13_kernel_time(df, {"gpu": "NVIDIA H200"})
    decode, prefill = fig.axes[:2]
    assert [t.get_text() for t in prefill.get_xticklabels()] == [
        "16K\nq=512\nfastest stream:\n8chunks:graph", "16K\nq=2048\nfastest stream:\n8chunks:graph"]
    marks = {round(float(seg[0][1]), 2) for c in prefill.collections if isinstance(c, LineCollection)
             for seg in c.get_segments()}
    assert marks == {1.47, 2.0}  # the targets, not the 1.25 ms link floor
    assert {round(float(seg[0][1]), 2) for c in decode.collections if isinstance(c, LineCollection)
            for seg in c.get_segments()} == {2.5}
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert {label for label, _ in MARKS.values()} <= set(legend) and "streamed, fastest option" in legend


def test_the_fastest_option_is_picked_by_its_median_over_repeated_runs() -> None:
    """Two runs of a point in one frame: option a at 1.0 and 2.0 ms (median 1.5) loses to option b at 1.2 and
    1.2; every row of the picked option is kept, so its bar (the median) is 1.2."""
    times = (("stream:a", 1.0), ("stream:a", 2.0), ("stream:b", 1.2), ("stream:b", 1.2))
    rows = [row("kernel_ablation", system="", op="prefill", variant=v, context_len=16384.0, q_len=512.0, time_ms=t,
                mode="measured") for v, t in times]
    drawn = with_fastest_option(pd.DataFrame(rows), SHOWN, POINT)
    assert list(drawn["option"]) == ["b", "b"] and list(drawn["time_ms"]) == [1.2, 1.2]
