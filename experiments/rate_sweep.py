"""Fig. 10: per-token latency vs request rate (Poisson arrivals) on ShareGPT and Alpaca, every system."""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.errors import check
from directkv.results import ResultsWriter
from experiments.common import as_int, base_row, check_rate, policies, progress, setup
from experiments.serving import serve_point
from workloads import build_workload, save_schedule, with_arrivals

DATASETS = ("sharegpt", "alpaca")


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    pols = policies(cfg)
    for d in cfg.datasets:
        check(d in DATASETS, f"unknown dataset {d!r}; valid: {', '.join(DATASETS)}")
    for r in cfg.rates:
        check_rate(r)
    n = as_int(cfg.num_requests, "num_requests")
    check(n >= 1, f"num_requests must be >= 1, got {n}")
    workloads = {d: build_workload(d, num_requests=n, seed=int(cfg.seed)) for d in cfg.datasets}
    writer.manifest["workloads"] = {d: {"path": w.path, "tokenizer": w.tokenizer, "params": w.params}
                                    for d, w in workloads.items()}
    points = [(d, float(r), p) for d in cfg.datasets for r in cfg.rates for p in pols]
    for d, rate, pol in progress(cfg, points, "rate_sweep"):
        if writer.done(system=pol.name, variant=pol.variant, dataset=d, rate=rate):
            continue
        wl = with_arrivals(workloads[d], rate, float(cfg.burstiness), seed=int(cfg.seed))
        save_schedule(wl, writer.run_dir / "schedules" / f"{d}-rate{rate:g}.parquet")  # replayable on a GPU
        row = base_row(cfg, s, system=pol.name, variant=pol.variant) | {"dataset": d, "rate": rate}
        for r in serve_point(pol, s, wl.requests, row, whole_batch=False):
            writer.add(r)
