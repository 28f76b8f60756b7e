"""Fit the cost model's efficiency factors to measured kernel rows, and load the fitted factors.

`python -m directkv.calibration RUN_DIR [--write]` reads a measured `kernel_ablation` run and prints the
factors; `--write` stores them in `directkv/specs/calibration/<hardware>.json`, from where every later
simulation on that hardware picks them up (the manifest records which factors a run used). Each factor is
a median over the run's points of measured rate / the spec's ceiling:

* link_sm    tiled decode: K/V bytes / time over the SM zero-copy read ceiling
* link_ce    copy-then-attend decode: bytes / (copy + SDPA time) over the cudaMemcpy ceiling
* hbm        SDPA decode on HBM-resident K/V: bytes / time over the HBM ceiling (may exceed 1: the
             ceiling is a copy, which also writes)
* attention  tiled prefill with K/V in HBM: the schedule's FLOPs / time over the bf16 peak
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import pandas as pd

from directkv.costmodel import CALIBRATION, Efficiency
from directkv.errors import ConfigError
from directkv.kernels import traffic_model as tm
from directkv.specs import HardwareSpec, get_hardware

DATA = Path(__file__).resolve().parent / "specs" / "calibration"


def fit(rows: pd.DataFrame, hw: HardwareSpec) -> dict[str, float]:
    """Efficiency factors from measured kernel_ablation rows (only the factors the rows can inform)."""
    ok = rows[(rows["mode"] == "measured") & (rows["status"] == "ok")]
    dec = ok[(ok["op"] == "decode") & (ok["kv_bytes"] >= 1e8)]  # past launch-overhead sizes
    out: dict[str, float] = {}

    def rate(sel) -> list[float]:
        return list(sel["kv_bytes"] / (sel["time_ms"] * 1e-3) / 1e9)

    if len(t := dec[dec["variant"] == "tiled"]):
        out["link_sm"] = statistics.median(rate(t)) / hw.link_sm_read_gbps
    if len(t := dec[dec["variant"] == "swap_sdpa"]):
        out["link_ce"] = statistics.median(rate(t)) / hw.link_ce_h2d_gbps
    if len(t := dec[dec["variant"] == "sdpa_hbm"]):
        out["hbm"] = statistics.median(rate(t)) / hw.hbm_bw_gbps
    pre = ok[(ok["op"] == "prefill") & (ok["variant"] == "tiled:kv_hbm")]
    if len(pre):
        effs = []
        for _, r in pre.iterrows():
            t = tm.prefill_traffic(int(r["q_len"]), int(r["context_len"]), num_heads=int(r["num_heads"]),
                                   num_kv_heads=int(r["num_kv_heads"]), head_dim=int(r["head_dim"]),
                                   dtype_bytes=2, variant="tiled")
            effs.append(t.flops / (r["time_ms"] * 1e-3) / (hw.bf16_tflops * 1e12))
        out["attention"] = statistics.median(effs)
    return out


def path_for(hardware: str) -> Path:
    return DATA / f"{hardware}.json"


def load_all() -> None:
    """Put every stored calibration into costmodel.CALIBRATION (defaults for factors not fitted)."""
    for p in sorted(DATA.glob("*.json")):
        data = json.loads(p.read_text())
        known = {f.name for f in fields(Efficiency)}
        CALIBRATION[p.stem] = Efficiency(**{k: v for k, v in data["factors"].items() if k in known})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m directkv.calibration", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a measured kernel_ablation run (results.parquet + manifest.json)")
    ap.add_argument("--write", action="store_true", help="store the factors for the run's hardware")
    a = ap.parse_args(argv)
    try:
        from directkv.results import load_results

        rows, manifest = load_results(a.run_dir)
        hardware = str(rows["hardware"].iloc[0])
        factors = fit(rows, get_hardware(hardware))
        if not factors:
            raise ConfigError(f"{a.run_dir} has no measured kernel rows to fit")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    merged = asdict(Efficiency()) | factors
    print(json.dumps({"hardware": hardware, "fitted": factors}, indent=2))
    if a.write:
        DATA.mkdir(parents=True, exist_ok=True)
        path_for(hardware).write_text(json.dumps({
            "hardware": hardware, "factors": merged, "fitted": sorted(factors),
            "source_run": str(a.run_dir), "source_git_sha": manifest.get("git_sha"), "gpu": manifest.get("gpu"),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
        print(f"wrote {path_for(hardware)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
