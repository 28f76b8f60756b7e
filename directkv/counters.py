"""Nsight Compute counters for kernel experiments: bytes over PCIe and L2 hit rate per measured call.

ncu replays each kernel once per metric pass, so it is used for counters only, never for latency
(DESIGN.md §2). `--clock-control none` leaves the GPU's clocks as they are. The profiled program marks the
call to measure with an NVTX range named `measure`; every kernel inside it is aggregated.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

METRICS = ("pcie__read_bytes.sum", "pcie__write_bytes.sum", "lts__t_sector_hit_rate.pct",
           "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
REPO = Path(__file__).resolve().parents[1]
# to bytes and nanoseconds, in case a unit other than the base one comes back
UNITS = {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "usecond": 1e3, "msecond": 1e6, "second": 1e9}


def ncu_path() -> str | None:
    for cand in (os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if cand and Path(cand).exists():
            return cand
    return None


def parse_csv(text: str) -> list[dict]:
    """Rows of ncu's `--csv --page raw`-less output: one (kernel, metric, value) per line."""
    start = text.find('"ID"')
    if start < 0:
        return []
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    return [r for r in rows if r.get("Metric Name") in METRICS]


def aggregate(rows: list[dict]) -> dict[str, float]:
    """Sum bytes and time over the kernels of the range; L2 hit rate weighted by each kernel's time."""
    per_kernel: dict[str, dict[str, float]] = {}
    for r in rows:
        value = float(str(r["Metric Value"]).replace(",", "") or "nan") * UNITS.get(r.get("Metric Unit", ""), 1.0)
        per_kernel.setdefault(r["ID"], {})[r["Metric Name"]] = value
    out = {"ncu_kernels": float(len(per_kernel))}
    if not per_kernel:
        return out
    t = [k.get("gpu__time_duration.sum", 0.0) for k in per_kernel.values()]
    out["ncu_pcie_read_bytes"] = sum(k.get("pcie__read_bytes.sum", 0.0) for k in per_kernel.values())
    out["ncu_pcie_write_bytes"] = sum(k.get("pcie__write_bytes.sum", 0.0) for k in per_kernel.values())
    out["ncu_dram_read_bytes"] = sum(k.get("dram__bytes_read.sum", 0.0) for k in per_kernel.values())
    out["ncu_dram_write_bytes"] = sum(k.get("dram__bytes_write.sum", 0.0) for k in per_kernel.values())
    out["ncu_time_ms"] = sum(t) / 1e6  # ns -> ms
    hits = [k.get("lts__t_sector_hit_rate.pct", 0.0) for k in per_kernel.values()]
    out["l2_hit_pct"] = sum(h * w for h, w in zip(hits, t, strict=True)) / max(sum(t), 1e-9)
    return out


def profile(target_args: list[str], *, timeout_s: int = 300) -> dict[str, float]:
    """Run `python -m experiments.ncu_target ARGS` under ncu; aggregated counters of its `measure` range."""
    ncu = ncu_path()
    if ncu is None:
        return {"ncu_error": "ncu not found"}
    cmd = [ncu, "--clock-control", "none", "--print-units", "base", "--nvtx", "--nvtx-include", "measure/", "--metrics", ",".join(METRICS),
           "--csv", sys.executable, "-m", "experiments.ncu_target", *target_args]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"ncu_error": f"ncu timed out after {timeout_s} s"}
    out = aggregate(parse_csv(p.stdout))
    if p.returncode or out["ncu_kernels"] == 0:
        out["ncu_error"] = (p.stderr.strip().splitlines() or ["no kernels profiled"])[-1][:300]
    return out
