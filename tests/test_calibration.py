from pathlib import Path

import pandas as pd
import pytest

from directkv.calibration import fit, load_all, main
from directkv.costmodel import CALIBRATION, CostModel, Efficiency
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
