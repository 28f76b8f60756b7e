"""Fit the cost model's efficiency factors to measured kernel rows, and load the fitted factors.

`python -m directkv.calibration RUN_DIR [RUN_DIR ...] [--hardware NAME] [--write]` reads measured
`kernel_ablation`, `cpu_attention` and `rate_sweep` runs and prints the factors; `--write` adds them to
`directkv/specs/calibration/<hardware>.json` (factors fitted before and not refitted stay, each with the run it
came from), from where every later simulation on that hardware picks them up (the manifest records which
factors a run used). Each factor is a median over the run's points of measured rate / the spec's ceiling:

* link_sm    tiled decode: K/V bytes / time over the SM zero-copy read ceiling
* link_ce    copy-then-attend decode: bytes / (copy + SDPA time) over the cudaMemcpy ceiling
* hbm        SDPA decode on HBM-resident K/V: bytes / time over the HBM ceiling (may exceed 1: the
             ceiling is a copy, which also writes)
* attention  tiled prefill with K/V in HBM: the schedule's FLOPs / time over the bf16 peak
* flash_attention  SDPA prefill in HBM (sdpa_hbm rows): the same FLOPs / time over the bf16 peak
* cpu_mem    cpu_attn's default CPU kernel (cpu_attention rows): K/V bytes / time over the spec's CPU DRAM
             bandwidth, from the rows of the smallest query-head group (the least work per byte). Those rows
             name the CPU, not a hardware spec, so their runs need --hardware.
* cpu_ns_per_head_token  not a ratio: with rows of a larger group too (another model's heads) that read
             under 0.9x the smallest group's rate, the time per query head and cached token of those rows
             (all threads together): the kernel's work, not DRAM, bounds them; else 0 (not modelled). Fitted
             across every run given, so pass the cpu_attention runs of both models together.
* dense_us_per_layer  not a ratio: hbm's per-token latency at the rate sweep's lowest rate over the model's
             layers, with the executor's default CUDA graphs. A step there holds one or two requests, whose
             attention in HBM is short, so the time is the layers' dense parts: the floor of one layer's
             dense part in a small step.
* host_time  not a factor: each system's host time per step (planning; issuing a step too large for the CUDA
             graphs; issuing a graph-sized step's prompt chunks, or its decodes' attention), fitted from the step series (steps/) of
             measured rate sweeps with graphs on (directkv/host_time.py); stored by system in the file's
             "host_time" section.
* flexgen_us_per_layer  not a ratio: FlexGen's per-token latency minus hbm's, at the lowest rate where a run
             holds both (same dataset, graphs on), over the model's layers: the fixed time per layer its
             unfused quantise / dequantise kernels add where its roofline work is almost nil.
* cpu_attn_us_per_layer, cpu_attn_us_per_decode  not fitted here: cpu_attn's handoffs per part and layer and its
             CPU work per decode, fitted to a step series by
             results/h200/cpu-attn-model-20261202/fit_cpu_attn.py (the same latency difference at rate 1 also
             held cpu_attn's CPU attention and planning, which the model charges on their own since
             2026-12-02).
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

from directkv import host_time
from directkv.costmodel import CALIBRATION, HOST_CALIBRATION, Efficiency
from directkv.engine.systems import DEFAULT_CPU_ATTN_KERNEL
from directkv.errors import ConfigError
from directkv.host_time import HostTime
from directkv.kernels import traffic_model as tm
from directkv.specs import HARDWARE, HardwareSpec, get_hardware, get_model

DATA = Path(__file__).resolve().parent / "specs" / "calibration"


def fit(rows: pd.DataFrame, hw: HardwareSpec, *, cpu: bool = True) -> dict[str, float]:
    """Efficiency factors from measured kernel_ablation, cpu_attention and rate_sweep rows (only the factors the
    rows can inform); cpu=False leaves out the CPU terms, which main fits once over every run's CPU rows."""
    ok = rows[(rows["mode"] == "measured") & (rows["status"] == "ok")]
    if "op" not in ok:  # serving rows have no op
        ok = ok.assign(op=None)
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
    for factor, variant in (("attention", "tiled:kv_hbm"), ("flash_attention", "sdpa_hbm")):
        pre = ok[(ok["op"] == "prefill") & (ok["variant"] == variant)]
        if len(pre):
            effs = []
            for _, r in pre.iterrows():
                t = tm.prefill_traffic(int(r["q_len"]), int(r["context_len"]), num_heads=int(r["num_heads"]),
                                       num_kv_heads=int(r["num_kv_heads"]), head_dim=int(r["head_dim"]),
                                       dtype_bytes=2, variant="tiled")
                effs.append(t.flops / (r["time_ms"] * 1e-3) / (hw.bf16_tflops * 1e12))
            out[factor] = statistics.median(effs)
    out |= _serving_floors(ok)
    return out | (_cpu_factors(cpu_rows(ok), hw) if cpu else {})


def cpu_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The measured rows of cpu_attn's default CPU kernel (cpu_attention runs)."""
    if "op" not in rows or "variant" not in rows:
        return rows.iloc[:0]
    ok = rows[(rows["mode"] == "measured") & (rows["status"] == "ok")]
    return ok[(ok["op"] == "cpu_decode") & (ok["variant"] == DEFAULT_CPU_ATTN_KERNEL)]


def _cpu_factors(cpu: pd.DataFrame, hw: HardwareSpec) -> dict[str, float]:
    """cpu_mem and, where two query-head group sizes were measured, cpu_ns_per_head_token (module docstring)."""
    if not len(cpu):
        return {}
    cpu = cpu.assign(group=cpu["num_heads"] // cpu["num_kv_heads"],
                     gbps=cpu["kv_bytes"] / (cpu["time_ms"] * 1e-3) / 1e9,
                     ns=cpu["time_ms"] * 1e6 / (cpu["batch_size"] * cpu["context_len"] * cpu["num_heads"]))
    groups = sorted(cpu["group"].unique())
    low, high = cpu[cpu["group"] == groups[0]], cpu[cpu["group"] == groups[-1]]
    # both always, so that a refit never pairs a new cpu_mem with an older run's work term
    out = {"cpu_mem": statistics.median(low["gbps"]) / hw.cpu_mem_bw_gbps, "cpu_ns_per_head_token": 0.0}
    if len(groups) > 1 and statistics.median(high["gbps"]) < 0.9 * statistics.median(low["gbps"]):
        out["cpu_ns_per_head_token"] = statistics.median(high["ns"])
    return out


def _serving_floors(ok: pd.DataFrame) -> dict[str, float]:
    """dense_us_per_layer from measured rate-sweep rows of hbm; flexgen_us_per_layer from FlexGen's beside hbm's
    (module docstring). Rows with CUDA graphs only, where the rows say; the overhead only from rows that say."""
    if "exp" not in ok or "system" not in ok:
        return {}
    rows = ok[ok["exp"] == "rate_sweep"]
    graphs_known = "cuda_graphs" in rows
    if graphs_known:
        rows = rows[rows["cuda_graphs"].fillna(False).astype(bool)]
    if "prefill_new_pass" in rows:  # the model charges prefill as the tiled kernel: fit from rows that ran it
        rows = rows[rows["prefill_new_pass"].fillna("kernel") == "kernel"]
    rows = rows.assign(layers=[get_model(str(m)).num_layers for m in rows["model"]])
    hbm = rows[rows["system"] == "hbm"]
    if not len(hbm):
        return {}

    def per_layer_at_lowest_rate(df: pd.DataFrame, ms: pd.Series) -> float:
        low = df["rate"] == df["rate"].min()
        return statistics.median(ms[low] * 1e3 / df["layers"][low])

    out = {"dense_us_per_layer": per_layer_at_lowest_rate(hbm, hbm["tpot_ms"])}
    key = ["dataset", "rate", "model"]
    if graphs_known:
        both = rows[rows["system"] == "flexgen"].merge(hbm[key + ["tpot_ms"]], on=key, suffixes=("", "_hbm"))
        if len(both):
            extra = per_layer_at_lowest_rate(both, both["tpot_ms"] - both["tpot_ms_hbm"])
            out["flexgen_us_per_layer"] = max(0.0, extra)
    return out


def path_for(hardware: str) -> Path:
    return DATA / f"{hardware}.json"


HOST = "host_time"  # the calibration file's section of per-system host times (host_time.py)
STEPS_NEEDED = "step series of a measured rate sweep with CUDA graphs (steps/)"  # what HOST is fitted from


def runs_source(runs: list[tuple[str, str | None, str | None]]) -> dict:
    """The source record of a factor fitted over several (run, commit, gpu) at once."""
    gpus = sorted({str(g) for _, _, g in runs})
    return {"run": [r for r, _, _ in runs], "git_sha": [c for _, c, _ in runs], "gpu": gpus[0] if len(gpus) == 1 else gpus}


def load_all() -> None:
    """Put every stored calibration into costmodel.CALIBRATION (defaults for factors not fitted)."""
    for p in sorted(DATA.glob("*.json")):
        data = json.loads(p.read_text())
        known = {f.name for f in fields(Efficiency)}
        CALIBRATION[p.stem] = Efficiency(**{k: v for k, v in data["factors"].items() if k in known})
        host_fields = {f.name for f in fields(HostTime)}
        HOST_CALIBRATION[p.stem] = {k: HostTime(**{f: x for f, x in v.items() if f in host_fields})
                                    for k, v in data.get(HOST, {}).items()}


def run_hardware(rows: pd.DataFrame, run_dir: Path, hardware: str | None) -> str:
    """The hardware spec a run's factors belong to: --hardware, else the one its rows name."""
    if hardware is not None:
        return hardware
    named = str(rows["hardware"].iloc[0])
    if named not in HARDWARE:
        raise ConfigError(f"{run_dir}'s rows name {named!r}, not a hardware spec: pass --hardware (valid: "
                          f"{', '.join(sorted(HARDWARE))})")
    return named


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m directkv.calibration", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                    help="measured kernel_ablation / cpu_attention / rate_sweep runs (results.parquet + manifest.json)")
    ap.add_argument("--hardware", help="the hardware spec the runs measured (default: the one their rows name)")
    ap.add_argument("--write", action="store_true", help="store the factors for the runs' hardware")
    ap.add_argument("--only", nargs="+", metavar="FACTOR", choices=[f.name for f in fields(Efficiency)] + [HOST],
                    help="fit and store these factors alone (the others keep their stored values and sources); "
                         f"{HOST}: the systems' host time per step, from the runs' step series")
    a = ap.parse_args(argv)
    fitted: dict[str, float | dict] = {}  # HOST: {system: HostTime's fields}
    sources: dict[str, dict] = {}
    steps, step_sources = [], []
    try:
        from directkv.results import load_results

        if a.hardware is not None:
            get_hardware(a.hardware)  # an unknown name: one line listing the valid ones
        names, cpu_parts, cpu_sources = set(), [], []
        for run_dir in a.run_dirs:
            rows, manifest = load_results(run_dir)
            names.add(hardware := run_hardware(rows, run_dir, a.hardware))
            factors, cpu = fit(rows, get_hardware(hardware), cpu=False), cpu_rows(rows)
            run_steps = serving_steps(rows, run_dir)
            if not factors and not len(cpu) and run_steps.empty:
                raise ConfigError(f"{run_dir} has no measured kernel / CPU / serving rows to fit a factor from and no "
                                  f"{STEPS_NEEDED} to fit {HOST} from")
            fitted |= factors
            commit = manifest.get("code_commit", manifest.get("git_sha"))  # a derived run lists its parts'
            sources |= {k: {"run": str(run_dir), "git_sha": commit, "gpu": manifest.get("gpu")} for k in factors}
            if not run_steps.empty:
                steps.append(run_steps)
                step_sources.append((str(run_dir), commit, manifest.get("gpu")))
            if len(cpu):
                cpu_parts.append(cpu)
                cpu_sources.append((str(run_dir), commit, manifest.get("gpu")))
        if len(names) > 1:
            raise ConfigError(f"the runs measured different hardware {sorted(names)}; calibrate one at a time")
        if cpu_parts:  # once, over every run's rows: the work term needs both models' group sizes at once
            factors = _cpu_factors(pd.concat(cpu_parts, ignore_index=True), get_hardware(hardware))
            fitted |= factors
            one = len(cpu_sources) == 1
            source = dict(zip(("run", "git_sha", "gpu"), cpu_sources[0], strict=True)) if one else runs_source(cpu_sources)
            sources |= {k: dict(source) for k in factors}
        host = host_time.fit(pd.concat(steps, ignore_index=True)) if steps else {}
        if host:
            fitted[HOST] = {k: asdict(v) for k, v in sorted(host.items())}
            # by system: a later fit of some systems keeps the others' values and sources (write)
            sources[HOST] = {k: runs_source(step_sources) for k in host}
        if a.only:
            if missing := sorted(set(a.only) - set(fitted)):
                what = " or ".join(sorted({STEPS_NEEDED if k == HOST else "measured rows" for k in missing}))
                raise ConfigError(f"no {what} to fit {', '.join(missing)} from in "
                                  f"{', '.join(map(str, a.run_dirs))}; they fit {', '.join(sorted(fitted))}")
            fitted, sources = {k: fitted[k] for k in a.only}, {k: sources[k] for k in a.only}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"hardware": hardware, "fitted": fitted}, indent=2))
    if a.write:
        write(hardware, fitted, sources)
        print(f"wrote {path_for(hardware)}")
    return 0


def write(hardware: str, fitted: dict[str, float | dict], sources: dict[str, dict]) -> None:
    """Merge newly fitted factors into the hardware's file; factors not refitted keep their value and source."""
    path = path_for(hardware)
    old = json.loads(path.read_text()) if path.exists() else {}
    fitted = dict(fitted)
    host = old.get(HOST, {}) | fitted.pop(HOST, {})  # by system: a system not in this fit keeps its stored one
    factors = asdict(Efficiency()) | old.get("factors", {}) | fitted
    all_sources = old.get("sources", {}) | sources
    if HOST in sources:
        all_sources[HOST] = old.get("sources", {}).get(HOST, {}) | sources[HOST]
    DATA.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "hardware": hardware, "factors": factors, HOST: host, "fitted": sorted(all_sources), "sources": all_sources,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")


def serving_steps(rows: pd.DataFrame, run_dir: Path) -> pd.DataFrame:
    """The step series of a measured rate sweep with CUDA graphs (host_time.fit's input; empty otherwise)."""
    ok = rows[(rows["mode"] == "measured") & (rows["status"] == "ok")] if "mode" in rows else rows.iloc[:0]
    if "exp" not in ok or not (ok["exp"] == "rate_sweep").any() or "model" not in ok:
        return pd.DataFrame()
    if "cuda_graphs" in ok and not ok["cuda_graphs"].fillna(False).astype(bool).all():
        return pd.DataFrame()
    return host_time.load_steps(run_dir, get_model(str(ok["model"].iloc[0])).num_layers)


if __name__ == "__main__":
    sys.exit(main())
