import json
from pathlib import Path

import pandas as pd
import pytest

from directkv.calibration import fit, load_all, main
from directkv.costmodel import CALIBRATION, CostModel, Efficiency
from directkv.errors import ConfigError
from directkv.specs import get_hardware

RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "superseded" / "20261129-113829"


def test_fit_on_the_stored_h200_run():
    rows = pd.read_parquet(RUN / "results.parquet")
    f = fit(rows, get_hardware("h200-pcie5"))
    assert 0.95 < f["link_sm"] <= 1.01  # the tiled decode kernel runs at the SM read ceiling
    assert 0.9 < f["link_ce"] <= 1.01
    assert 0.1 < f["attention"] < 0.6


def test_fit_ignores_simulated_rows():
    rows = pd.read_parquet(RUN / "results.parquet")
    assert fit(rows[rows["mode"] == "simulated"], get_hardware("h200-pcie5")) == {}


def test_stored_calibration_is_used_by_the_cost_model():
    CALIBRATION.clear()
    load_all()
    assert "h200-pcie5" in CALIBRATION
    cm = CostModel.for_hardware(get_hardware("h200-pcie5"))
    assert cm.eff == CALIBRATION["h200-pcie5"] and cm.eff != Efficiency()
    assert CostModel.for_hardware(get_hardware("gh200-c2c")).eff == Efficiency()  # nothing measured there


def test_cli_rejects_a_run_without_kernel_rows(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no results.parquet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


CPU_RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "cpu_attention" / "20261129-155009"


def _fitted(run: Path):
    """(rows, the H200 spec, the factors fitted to the rows) of a stored run."""
    rows = pd.read_parquet(run / "results.parquet")
    hw = get_hardware("h200-pcie5")
    return rows, hw, fit(rows, hw)


def test_cpu_mem_is_fitted_from_the_default_cpu_kernel():
    rows, hw, f = _fitted(CPU_RUN)
    assert set(f) == {"cpu_mem", "cpu_ns_per_head_token"}
    assert f["cpu_ns_per_head_token"] == 0.0  # one group size: nothing tells work from memory
    native = rows[rows["variant"] == "native"]
    # the H200 host's 16 cores read 23-29 GB/s with the native kernel, of the spec's 80
    assert 25 / hw.cpu_mem_bw_gbps < f["cpu_mem"] < 31 / hw.cpu_mem_bw_gbps
    assert fit(rows[rows["variant"] == "flash"], hw) == {}  # only the kernel serving uses by default
    assert len(native) and fit(native, hw) == f


def test_cli_needs_hardware_for_cpu_rows_and_merges_into_the_stored_file(tmp_path, monkeypatch, capsys):
    import directkv.calibration as cal

    assert main([str(CPU_RUN)]) == 2
    assert "not a hardware spec: pass --hardware (valid: " in capsys.readouterr().err
    assert main([str(CPU_RUN), "--hardware", "h100"]) == 2
    assert "unknown hardware 'h100'; valid: " in capsys.readouterr().err
    monkeypatch.setattr(cal, "DATA", tmp_path)
    assert main([str(RUN), "--write"]) == 0
    first = json.loads((tmp_path / "h200-pcie5.json").read_text())
    assert main([str(CPU_RUN), "--hardware", "h200-pcie5", "--write"]) == 0
    merged = json.loads((tmp_path / "h200-pcie5.json").read_text())
    # the kernel factors fitted first stay, each with its run; cpu_mem joins with its own
    assert {k: merged["factors"][k] for k in first["fitted"]} == {k: first["factors"][k] for k in first["fitted"]}
    assert set(merged["fitted"]) == set(first["fitted"]) | {"cpu_mem", "cpu_ns_per_head_token"}
    assert merged["sources"]["cpu_mem"]["run"] == str(CPU_RUN) and merged["sources"]["link_sm"]["run"] == str(RUN)
    assert merged["factors"]["cpu_mem"] != Efficiency().cpu_mem


OPT_CPU_RUN = CPU_RUN.parent / "20261129-191000"  # OPT-13B's heads: one query head per KV head


def test_two_group_sizes_fit_memory_and_work_apart(tmp_path, monkeypatch):
    """Llama's 4-head groups read 23-29 GB/s, OPT-13B's single heads 60-74: cpu_mem comes from OPT's rows,
    the work per head and token from Llama's, and the cost model then reproduces both runs' medians."""
    import directkv.calibration as cal

    monkeypatch.setattr(cal, "DATA", tmp_path)
    assert main([str(CPU_RUN), str(OPT_CPU_RUN), "--hardware", "h200-pcie5", "--write"]) == 0
    stored = json.loads((tmp_path / "h200-pcie5.json").read_text())
    hw = get_hardware("h200-pcie5")
    f = stored["factors"]
    assert 60 / hw.cpu_mem_bw_gbps < f["cpu_mem"] < 74 / hw.cpu_mem_bw_gbps
    assert 3 < f["cpu_ns_per_head_token"] < 7
    for key in ("cpu_mem", "cpu_ns_per_head_token"):
        assert stored["sources"][key]["run"] == [str(CPU_RUN), str(OPT_CPU_RUN)]
        assert stored["sources"][key]["gpu"] == "NVIDIA H200"
    cm = CostModel(hw, Efficiency(cpu_mem=f["cpu_mem"], cpu_ns_per_head_token=f["cpu_ns_per_head_token"]))
    for run in (CPU_RUN, OPT_CPU_RUN):
        rows = pd.read_parquet(run / "results.parquet").query("variant == 'native'")
        ratio = [cm.cpu_attention_time(r.kv_bytes, r.batch_size * r.context_len * r.num_heads) / (r.time_ms * 1e-3)
                 for r in rows.itertuples()]
        assert 0.8 < sorted(ratio)[len(ratio) // 2] < 1.25, (run.name, ratio)


RATE_RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "rate_sweep" / "20261129-155722"


def test_dense_floor_is_fitted_from_hbm_at_the_lowest_rate_with_graphs():
    rows, hw, f = _fitted(RATE_RUN)
    assert set(f) == {"dense_us_per_layer"}
    # hbm at 1 req/s: 9.5-10 ms per token over Llama-3.1-8B's 32 layers
    assert 9.4e3 / 32 < f["dense_us_per_layer"] < 10.1e3 / 32
    assert fit(rows.assign(cuda_graphs=False), hw) == {}  # eager steps have another floor
    assert fit(rows.assign(system="swap"), hw) == {}
    assert fit(rows.assign(prefill_new_pass="flash"), hw) == {}  # the model charges the tiled prefill kernel
    assert fit(rows.assign(prefill_new_pass="kernel"), hw) == f


ALPACA = Path(__file__).resolve().parents[1] / "results" / "h200" / "rate_sweep" / "combined-20261129g-alpaca"


def test_flexgen_overhead_is_fitted_beside_hbm_at_the_lowest_rate_and_cpu_attn_s_is_not():
    """flexgen's per-layer time over hbm's at Alpaca 1 req/s (53.4 vs 10.0 ms per token); cpu_attn's fixed times
    come from its step series (fit_cpu_attn.py), not from this difference, which also holds its CPU attention."""
    rows, hw, f = _fitted(ALPACA)
    assert (53.4 - 10.0) * 1e3 / 32 == pytest.approx(f["flexgen_us_per_layer"], rel=0.01)
    assert "cpu_attn_us_per_layer" not in f
    no_hbm = rows[rows["system"] != "hbm"]
    assert "flexgen_us_per_layer" not in fit(no_hbm, hw)  # nothing to subtract


PREFILL_RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "kernel_ablation" / "20261202-030939"


def test_flash_attention_is_fitted_from_sdpa_in_hbm_apart_from_the_tiled_kernel(tmp_path, monkeypatch, capsys):
    """SDPA's prefill in HBM (sdpa_hbm rows) and the tiled kernel with K/V in HBM (tiled:kv_hbm) get a factor each:
    on the H200 SDPA ran at ~1.5x the tiled kernel's rate. --only stores the named factors alone, and refuses one
    the runs cannot fit."""
    import directkv.calibration as cal

    rows, hw, f = _fitted(PREFILL_RUN)
    assert set(f) == {"attention", "flash_attention"}
    assert 0.3 < f["flash_attention"] < 0.5 and 1.3 < f["flash_attention"] / f["attention"] < 2.0
    sdpa = rows[(rows["variant"] == "sdpa_hbm") & (rows["mode"] == "measured")]
    # by hand: the past's keys all, the new ones causal (~half), over the median time of the three q_lens
    effs = sorted(4 * 128 * 32 * (q * 16384 + q * q / 2) / (ms * 1e-3) / (hw.bf16_tflops * 1e12)
                  for q, ms in zip(sdpa["q_len"], sdpa["time_ms"], strict=True))
    assert len(effs) == 3 and effs[1] == pytest.approx(f["flash_attention"], rel=0.02)
    monkeypatch.setattr(cal, "DATA", tmp_path)
    assert main([str(PREFILL_RUN), "--only", "flash_attention", "--write"]) == 0
    stored = json.loads((tmp_path / "h200-pcie5.json").read_text())
    assert stored["fitted"] == ["flash_attention"] and stored["factors"]["attention"] == Efficiency().attention
    assert stored["factors"]["flash_attention"] == f["flash_attention"]
    capsys.readouterr()
    assert main([str(PREFILL_RUN), "--only", "cpu_mem"]) == 2
    assert "no measured rows to fit cpu_mem from in " in capsys.readouterr().err


def test_the_flash_factor_times_flash_flops_only():
    cm = CostModel(get_hardware("h200-pcie5"), Efficiency(attention=0.25, flash_attention=0.5))
    from directkv.kernels.traffic import Traffic

    t = Traffic(flops=10**12)
    assert cm.terms(t)["compute"] == pytest.approx(2 * cm.terms(t, flops_kind="flash_attention")["compute"])
    with pytest.raises(ConfigError, match=r"unknown flops_kind 'flash'; valid: attention, flash_attention, matmul"):
        cm.terms(t, flops_kind="flash")
