"""plots/: every experiment renders readable PNGs from a synthetic run directory; OOM, titles, CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from directkv.errors import ConfigError
from plots.figures.context_sweep import fig11_context_sweep, hbm_budget_gb
from plots.load import find_run_dirs
from plots.render import FIGURES, main, render_run
from plots.style import context_label, mode_suffix

REPO = Path(__file__).resolve().parents[1]
FLOATS = (
    "context_len",
    "rate",
    "time_ms",
    "tpot_ms",
    "ttft_ms",
    "gpu_mem_gb",
    "host_pinned_gb",
    "link_read_bytes",
    "link_write_bytes",
    "kv_bytes",
)
CONTEXTS = [1024 * 2**i for i in range(6)]  # 1K .. 32K


def row(exp: str, **kw) -> dict:
    """One results row with every contract column; unspecified floats are NaN."""
    base = {
        "exp": exp,
        "system": "directkv",
        "variant": "",
        "model": "llama-3.1-8b",
        "hardware": "h200-pcie5",
        "mode": "simulated",
        "status": "ok",
        "error": "",
    }
    base.update({c: math.nan for c in FLOATS})
    base.update(kw)
    return base


def write_run(
    root: Path,
    rows: list[dict],
    exp: str,
    mode: str = "simulated",
    gpu: str | None = None,
    config: dict | None = None,
) -> Path:
    run = root / "results" / exp / "run0"
    run.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(run / "results.parquet")
    manifest = {
        "exp": exp,
        "mode": mode,
        "gpu": gpu,
        "config": config or {},
        "git_sha": "abc",
        "hostname": "h",
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def context_rows(models=("llama-3.1-8b",)) -> list[dict]:
    """Paper-like Fig. 11 data: HBM / Pie / Neo OOM at 32K, FlexGen errors once at 1K."""
    systems = [
        ("directkv", "tiled", 1.0, 20),
        ("hbm", "", 0.7, 60),
        ("swap", "", 1.3, 62),
        ("cpu_attn", "", 1.4, 58),
        ("flexgen", "", 1.8, 50),
    ]
    rows = []
    for model in models:
        for system, variant, slow, mem in systems:
            for ctx in CONTEXTS:
                status = "oom" if ctx == 32768 and system in ("hbm", "swap", "cpu_attn") else "ok"
                if system == "flexgen" and ctx == 1024:
                    status = "error"
                ok = status == "ok"
                rows.append(
                    row(
                        "context_sweep",
                        system=system,
                        variant=variant,
                        model=model,
                        status=status,
                        error="" if ok else "boom",
                        context_len=float(ctx),
                        tpot_ms=slow * (20 + ctx / 400) if ok else math.nan,
                        gpu_mem_gb=mem + (ctx / 1024 if system == "hbm" else 0.5) if ok else math.nan,
                        host_pinned_gb=ctx / 2048,
                        output_len=128,
                        batch_size=8,
                        p99_tpot_ms=math.nan,
                        mean_ttft_ms=100.0,
                    )
                )
    return rows


def rate_rows() -> list[dict]:
    rows = []
    for dataset in ("sharegpt", "alpaca"):
        for system, slow in (("directkv", 1.0), ("hbm", 0.8), ("swap", 2.0), ("flexgen", 3.0)):
            for rate in (5.0, 10.0, 20.0, 30.0):
                oom = system == "hbm" and rate == 30.0
                rows.append(
                    row(
                        "rate_sweep",
                        system=system,
                        variant="tiled" if system == "directkv" else "",
                        dataset=dataset,
                        rate=rate,
                        status="oom" if oom else "ok",
                        tpot_ms=math.nan if oom else slow * (40 + rate**1.5),
                        p99_tpot_ms=slow * 90.0,
                        mean_ttft_ms=200.0,
                    )
                )
    return rows


def kernel_rows() -> list[dict]:
    by_op = {
        "decode": ("naive", "tiled", "sdpa_hbm", "sdpa_zero_copy", "swap_sdpa"),
        "prefill": ("naive", "tiled", "sdpa_zero_copy"),
        "proj_attention": ("separate", "fused"),
    }
    reread = {
        "naive": 8.0,
        "tiled": 1.05,
        "sdpa_hbm": 0.0,
        "sdpa_zero_copy": 17.5,
        "swap_sdpa": 1.0,
        "separate": 2.0,
        "fused": 1.0,
    }
    rows = []
    for op, variants in by_op.items():
        for variant in variants:
            for ctx in (4096.0, 16384.0):
                kv = ctx * 131072.0
                rows.append(
                    row(
                        "kernel_ablation",
                        system="",
                        op=op,
                        variant=variant,
                        context_len=ctx,
                        q_len=1.0 if op == "decode" else 512.0,
                        batch=1.0,
                        kv_bytes=kv,
                        link_read_bytes=reread[variant] * kv,
                        link_write_bytes=0.0,
                        time_ms=0.05 if variant == "sdpa_hbm" else reread[variant] * kv / 51.4e6 + 0.01,
                        floor_ms=kv / 51.4e6,
                        link_gbps=51.4,
                        mode="measured",
                    )
                )
    return rows


def gemm_rows(with_l2: bool) -> list[dict]:
    times = {"naive": 1122.0, "tiled": 54.0, "pipelined": 48.0, "cublas_hbm": 2.8, "cublas_zero_copy": 163.0}
    l2 = {"naive": 32.3, "tiled": 75.1, "pipelined": 75.1, "cublas_hbm": 77.0, "cublas_zero_copy": 40.0}
    return [
        row(
            "gemm_case_study",
            system="",
            m=n,
            n=n,
            k=n,
            variant=v,
            time_ms=t * (n / 10240) ** 3,
            link_read_bytes=2.0 * n * n,
            l2_hit_pct=l2[v] if with_l2 else math.nan,
            mode="measured",
        )
        for n in (4096, 10240)
        for v, t in times.items()
    ]


def cpu_attention_rows() -> list[dict]:
    """The dev VM's run (2 threads): ms per layer of each kernel per (decodes, tokens) point and page order."""
    times = {("consecutive", "flash"): (11.9, 9.8, 11.2, 47.6), ("consecutive", "native"): (6.7, 6.7, 8.0, 24.8),
             ("shuffled", "flash"): (31.9, 30.1, 27.2, 111.0), ("shuffled", "native"): (6.8, 6.9, 6.8, 27.0)}
    points = ((64, 256), (16, 1024), (4, 4096), (4, 16384))
    return [row("cpu_attention", system="cpu_attn", variant=v, batch_size=b, context_len=c, page_order=o, threads=2,
                time_ms=t, gbps=2 * b * c * 8 * 128 * 2 / (t * 1e-3) / 1e9, hardware="cpu: AMD EPYC", mode="measured")
            for (o, v), ts in times.items() for (b, c), t in zip(points, ts, strict=True)]


def interconnect_rows() -> list[dict]:
    rows = []
    for hw, bw, mode in (("h200-pcie5", 51.4, "measured"), ("gh200-c2c", 400.0, "projected")):
        for variant in ("naive", "tiled"):
            for ctx in (2048.0, 8192.0, 32768.0):
                rows.append(
                    row(
                        "interconnect_sweep",
                        system="",
                        op="decode",
                        variant=variant,
                        hardware=hw,
                        mode=mode,
                        context_len=ctx,
                        q_len=512.0,
                        time_ms=(3.0 if variant == "naive" else 1.0) * ctx * 131072 / bw / 1e6,
                    )
                )
    return rows


CASES = {
    "context_sweep": lambda: context_rows(),
    "rate_sweep": rate_rows,
    "kernel_ablation": kernel_rows,
    "gemm_case_study": lambda: gemm_rows(with_l2=True),
    "interconnect_sweep": interconnect_rows,
    "cpu_attention": cpu_attention_rows,
}


def assert_png(path: Path) -> None:
    assert path.is_file() and path.suffix == ".png"
    assert path.stat().st_size > 10_000
    img = mpimg.imread(path)
    height, width = img.shape[:2]
    assert 300 <= height <= 3000 and 500 <= width <= 4000
    assert width > height * 0.9  # side-by-side panels, never a tall strip
    # Something is drawn: many pixels are far from the white background.
    assert (np.abs(img[..., :3] - 1.0).sum(axis=-1) > 0.3).mean() > 0.01


@pytest.mark.parametrize("exp", sorted(CASES))
def test_every_experiment_renders(tmp_path: Path, exp: str) -> None:
    gpu = "NVIDIA H200"
    run = write_run(tmp_path, CASES[exp](), exp, gpu=gpu, config={"hardware": {"hbm_budget_gb": 80.0}})
    paths = render_run(run)
    assert [p.stem for p in paths] == list(FIGURES[exp])
    for path in paths:
        assert path.parent == run / "figures"
        assert_png(path)
        with Image.open(path) as im:
            assert im.mode == "P"  # stored as a palette PNG (save_png)


def test_every_registered_experiment_has_a_case() -> None:
    assert set(FIGURES) == set(CASES)


def test_context_sweep_oom_markers_and_budget(tmp_path: Path) -> None:
    df = pd.DataFrame(context_rows())
    manifest = {"gpu": None, "config": {"hardware": {"hbm_budget_gb": 80.0}}}
    fig = fig11_context_sweep(df, manifest)
    lat, mem = fig.axes[:2]
    labels = [line.get_label() for line in lat.get_lines()]
    assert "DirectKV (tiled)" in labels and "SGLang-like (HBM)" in labels
    hbm = next(line for line in lat.get_lines() if line.get_label() == "SGLang-like (HBM)")
    assert hbm.get_xdata().max() == 16384.0  # no line through the OOM point at 32K
    flexgen = next(line for line in lat.get_lines() if line.get_label() == "FlexGen-like (4-bit)")
    assert flexgen.get_xdata().min() == 2048.0  # the error row at 1K is skipped
    oom_texts = [t for t in lat.texts if t.get_text() == "OOM"]
    assert len(oom_texts) == 3  # hbm, swap, cpu_attn at 32K
    assert {t.get_text() for t in lat.texts} == {"OOM", "ERR"}
    budget = [line for line in mem.get_lines() if line.get_label().startswith("HBM budget")]
    assert len(budget) == 1 and budget[0].get_ydata()[0] == 80.0
    assert mem.get_ylim()[1] > 80.0
    assert "(simulated)" in fig.texts[0].get_text()  # suptitle
    assert [t.get_text() for t in lat.get_xticklabels()] == ["1K", "2K", "4K", "8K", "16K", "32K"]


def test_context_sweep_all_oom_series_still_renders(tmp_path: Path) -> None:
    rows = [
        r | {"status": "oom", "tpot_ms": math.nan, "gpu_mem_gb": math.nan}
        for r in context_rows()
        if r["system"] == "hbm"
    ]
    run = write_run(tmp_path, rows, "context_sweep")
    (path,) = render_run(run)
    assert_png(path)


def test_context_sweep_one_row_of_panels_per_model(tmp_path: Path) -> None:
    fig = fig11_context_sweep(pd.DataFrame(context_rows(("llama-3.1-8b", "opt-13b"))), {})
    titles = [ax.get_title() for ax in fig.axes]
    hw = "H200 (PCIe5)"
    assert titles == [
        f"(a) Per-token latency: llama-3.1-8b, {hw}",
        f"(b) GPU memory: llama-3.1-8b, {hw}",
        f"(c) Per-token latency: opt-13b, {hw}",
        f"(d) GPU memory: opt-13b, {hw}",
    ]


def test_hbm_budget_prefers_column_then_manifest() -> None:
    rows = pd.DataFrame({"hbm_budget_gb": [40.0, 40.0]})
    assert hbm_budget_gb(rows, {"config": {"hardware": {"hbm_budget_gb": 80}}}) == 40.0
    assert hbm_budget_gb(pd.DataFrame({"x": [1]}), {"config": {"hardware.hbm_budget_gb": 80}}) == 80.0
    assert hbm_budget_gb(pd.DataFrame({"x": [1]}), {"config": {"hardware": {"name": "h200-pcie5"}}}) is None


def test_gemm_without_l2_has_one_panel(tmp_path: Path) -> None:
    run = write_run(tmp_path, gemm_rows(with_l2=False), "gemm_case_study", mode="measured", gpu="NVIDIA H200")
    (path,) = render_run(run)
    assert_png(path)


@pytest.mark.parametrize(
    ("modes", "gpu", "expected"),
    [
        (["simulated", "simulated"], None, "(simulated)"),
        (["projected"], "NVIDIA H200", "(projected)"),
        (["measured"], "NVIDIA H200", "(measured on NVIDIA H200)"),
        (["measured"], None, "(measured)"),
        (["simulated", "measured"], "NVIDIA H200", "(mixed: measured + simulated)"),
        (["projected", "measured"], None, "(mixed: measured + projected)"),
    ],
)
def test_mode_suffix(modes: list[str], gpu: str | None, expected: str) -> None:
    assert mode_suffix(modes, gpu) == expected


def test_figure_title_ignores_a_gpu_recorded_as_none() -> None:
    from plots.style import figure_title

    assert figure_title("Fig. X", ["measured"], {"gpu": "none"}) == "Fig. X (measured)"
    assert figure_title("Fig. X", ["measured"], {"gpu": "NVIDIA H200"}) == "Fig. X (measured on NVIDIA H200)"


def test_cpu_attention_title_names_the_cpu_not_the_machines_gpu() -> None:
    """cpu_attention measures the host CPU; its manifest records the GPU wherever one is present."""
    from plots.figures.cpu_attention import fig_cpu_attention

    fig = fig_cpu_attention(pd.DataFrame(cpu_attention_rows()), {"gpu": "NVIDIA H200"})
    title = fig._suptitle.get_text().replace("\n", " ")
    plt.close(fig)
    assert title.startswith("CPU decode attention (cpu_attn)") and title.endswith("(measured)"), title
    assert "H200" not in title


def test_mode_suffix_rejects_unknown_mode() -> None:
    with pytest.raises(ConfigError, match="unknown mode 'guessed'"):
        mode_suffix(["measured", "guessed"])


def test_mixed_mode_reaches_the_figure_title(tmp_path: Path) -> None:
    from plots.figures.interconnect_sweep import fig14_interconnect

    fig = fig14_interconnect(pd.DataFrame(interconnect_rows()), {"gpu": "NVIDIA H200"})
    assert fig.texts[0].get_text().endswith("(mixed: measured + projected)")
    ratios = [t.get_text() for t in fig.axes[0].texts]
    assert len(ratios) == 6 and all(r.endswith("×") for r in ratios)
    assert float(ratios[0].rstrip("×")) == pytest.approx(400.0 / 51.4, rel=0.02)


def test_kernel_bars_show_reread_floor_and_failures() -> None:
    from plots.figures.kernel_ablation import fig12_reread, fig13_kernel_time

    rows = kernel_rows() + [
        r | {"q_len": 2048.0, "status": "oom" if r["variant"] == "naive" else "ok"}
        for r in kernel_rows()
        if r["op"] == "prefill"
    ]
    df = pd.DataFrame(rows)
    fig = fig12_reread(df, {"gpu": "NVIDIA H200"})
    decode, prefill, _ = fig.axes[:3]
    heights = sorted({round(p.get_height(), 3) for p in decode.patches})
    assert heights == [0.0, 1.0, 1.05, 8.0, 17.5]
    assert [t.get_text() for t in prefill.get_xticklabels()] == [
        "4K\nq=512",
        "4K\nq=2048",
        "16K\nq=512",
        "16K\nq=2048",
    ]
    assert sum(t.get_text() == "OOM" for t in prefill.texts) == 2  # naive at q=2048, both contexts
    assert fig.texts[0].get_text().endswith("(measured on NVIDIA H200)")
    fig13 = fig13_kernel_time(df, {"gpu": "NVIDIA H200"})
    assert fig13.axes[0].get_yscale() == "log"
    assert len(fig13.axes[0].collections) > 0  # dashed floor marks (hlines)
    legend_labels = [t.get_text() for t in fig13.axes[2].get_legend().get_texts()]
    assert "link floor (bytes / link BW)" in legend_labels


def test_gemm_bars_carry_ms_labels() -> None:
    from plots.figures.gemm_case_study import fig2_5_gemm

    fig = fig2_5_gemm(pd.DataFrame(gemm_rows(with_l2=True)), {"gpu": "NVIDIA H200"})
    time_ax, l2_ax = fig.axes[:2]
    labels = {t.get_text() for t in time_ax.texts}
    assert {"1122 ms", "2.8 ms", "48.0 ms"} <= labels
    assert time_ax.get_yscale() == "log"
    assert "32%" in {t.get_text() for t in l2_ax.texts}
    # Value labels never overprint each other (they turn vertical when bars are narrow).
    renderer = fig.canvas.get_renderer()
    for ax in (time_ax, l2_ax):
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_context_label() -> None:
    assert [context_label(c) for c in (1024, 32768, 131072, 1000)] == ["1K", "32K", "128K", "1000"]


def test_unknown_experiment_lists_known_ones(tmp_path: Path) -> None:
    run = write_run(tmp_path, [row("mystery")], "mystery")
    with pytest.raises(ConfigError, match="unknown experiment 'mystery'; valid: context_sweep"):
        render_run(run)


def test_bad_status_is_a_config_error(tmp_path: Path) -> None:
    run = write_run(tmp_path, [r | {"status": "fine"} for r in rate_rows()], "rate_sweep")
    with pytest.raises(ConfigError, match="unknown status 'fine'"):
        render_run(run)


def test_missing_column_is_named(tmp_path: Path) -> None:
    run = write_run(
        tmp_path, [{k: v for k, v in r.items() if k != "dataset"} for r in rate_rows()], "rate_sweep"
    )
    with pytest.raises(ConfigError, match="missing column.*dataset"):
        render_run(run)


def test_find_run_dirs_below_a_parent(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", rate_rows(), "rate_sweep")
    b = write_run(tmp_path / "b", interconnect_rows(), "interconnect_sweep")
    assert find_run_dirs(tmp_path) == [a, b]
    assert find_run_dirs(a) == [a]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no results.parquet"):
        find_run_dirs(tmp_path / "empty")


def test_main_renders_every_run_below_a_parent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "a", rate_rows(), "rate_sweep")
    write_run(tmp_path / "b", gemm_rows(with_l2=False), "gemm_case_study", mode="measured")
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == ["fig10_rate_sweep.png", "fig2_5_gemm.png"]
    assert all(Path(p).is_file() for p in printed)


def test_main_reports_a_bad_run_and_still_renders_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "a", rate_rows(), "rate_sweep")
    bad = write_run(tmp_path / "b", [row("mystery")], "mystery")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "results.parquet").write_bytes(b"not parquet")
    (tmp_path / "c" / "manifest.json").write_text("{}")
    assert main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert [Path(p).name for p in out.split()] == ["fig10_rate_sweep.png"]
    errors = err.strip().splitlines()
    assert len(errors) == 2
    assert str(bad) in errors[0] and "unknown experiment 'mystery'" in errors[0]
    assert "cannot read" in errors[1]


@pytest.mark.parametrize("make_dir", [False, True], ids=["missing", "empty"])
def test_cli_bad_path_exits_2_with_one_line(tmp_path: Path, make_dir: bool) -> None:
    target = tmp_path / "nothing_here"
    if make_dir:
        target.mkdir()
    python = "/work/venv/bin/python" if Path("/work/venv/bin/python").exists() else sys.executable
    proc = subprocess.run(
        [python, "-m", "plots.render", str(target)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nothing_here" in lines[0]
    assert "Traceback" not in proc.stderr


def test_gemm_draws_the_fastest_stream_option_per_size_and_the_target() -> None:
    """A GPU run's ~25 variants per size: the figure keeps the paper's, plain stream, the anchors and one bar
    for the fastest stream option of each size (named under the size), and marks each size's target."""
    from plots.figures.common import FASTEST
    from plots.figures.gemm_case_study import TARGET_LABEL, fig2_5_gemm, figure_rows

    extra = {4096: {"stream": 0.85, "stream:k": 0.71, "stream:panels16:graph": 0.67, "raster": 21.0},
             10240: {"stream": 5.5, "stream:k": 4.4, "stream:panels16:graph": 4.1, "stream:sm132": 7.0}}
    rows = gemm_rows(with_l2=False) + [
        row("gemm_case_study", system="", m=n, n=n, k=n, variant=v, time_ms=t, mode="measured")
        for n, times in extra.items() for v, t in times.items()]
    for r in rows:
        r["target_ms"] = 0.70 if r["m"] == 4096 else 4.35
    df = pd.DataFrame(rows)
    drawn = figure_rows(df)
    assert set(drawn["variant"]) == {"naive", "tiled", "pipelined", "stream", "cublas_hbm", "cublas_zero_copy", FASTEST}
    best = drawn[drawn["variant"] == FASTEST].set_index("m")
    assert best.loc[4096, "option"] == "panels16:graph" and best.loc[10240, "time_ms"] == 4.1
    fig = fig2_5_gemm(df, {"gpu": "NVIDIA H200"})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "4096×4096×4096\nfastest stream:\npanels16:graph", "10240×10240×10240\nfastest stream:\npanels16:graph"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert TARGET_LABEL in legend and "streamed, fastest option" in legend and "raster" not in " ".join(legend)
    # 7 bars per size, each with a dashed mark at its size's target
    assert len([p for p in ax.patches if p.get_height() > 0]) == 14
    from matplotlib.collections import LineCollection

    marks = [seg for c in ax.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert len(marks) == 14 and sorted({round(float(seg[0][1]), 2) for seg in marks}) == [0.70, 4.35]


def test_the_gemm_title_letters_its_panels_only_when_there_are_two() -> None:
    from plots.figures.gemm_case_study import fig2_5_gemm

    for with_l2, titles in ((False, ["GEMM time"]), (True, ["(a) GEMM time", "(b) L2 hit rate"])):
        fig = fig2_5_gemm(pd.DataFrame(gemm_rows(with_l2=with_l2)), {"gpu": "NVIDIA H200"})
        assert [ax.get_title() for ax in fig.axes if ax.get_title()] == titles
        plt.close(fig)


def test_interconnect_lines_name_their_mode() -> None:
    from plots.figures.interconnect_sweep import fig14_interconnect

    fig = fig14_interconnect(pd.DataFrame(interconnect_rows()), {})
    labels = {ln.get_label() for ax in fig.axes for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert labels and all(lb.endswith(("(measured)", "(projected)")) for lb in labels), labels
    assert any("NVLink-C2C" in lb and lb.endswith("(projected)") for lb in labels)
    plt.close(fig)
