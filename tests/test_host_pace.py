"""The host-pace probe every manifest carries (directkv/host_pace.py)."""

import json
import math
import time

from directkv import host_pace
from directkv.results import ResultsWriter


def test_the_probe_times_the_op_it_is_given():
    fast = host_pace.op_us(lambda: None, blocks=3, ops=50)
    slow = host_pace.op_us(lambda: time.sleep(2e-4), blocks=3, ops=50)
    assert 0 < fast < 50 and slow >= 200  # a 200 us op reads as at least 200 us per call


def test_every_manifest_records_the_hosts_pace(tmp_path):
    ResultsWriter(tmp_path / "run", exp="context_sweep", config={})
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert 0 < manifest["host_torch_op_us"] < 1000
    load = manifest["host_loadavg_1m"]
    assert load is None or (math.isfinite(load) and load >= 0)


def test_a_platform_without_a_load_average_records_none(monkeypatch):
    monkeypatch.delattr(host_pace.os, "getloadavg")
    assert host_pace.probe()["host_loadavg_1m"] is None
