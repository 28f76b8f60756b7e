"""Fig. 10: per-token latency vs request rate (Poisson arrivals) on ShareGPT and Alpaca, every system."""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.errors import check
from directkv.results import ResultsWriter
from experiments.common import as_float, as_int, base_row, check_rate, policies, progress, setup
from experiments.serving import point_done, serve_point, steps_file
from workloads import build_workload, save_schedule, with_arrivals

DATASETS = ("sharegpt", "alpaca")


# options of the workload group that reach the dataset loader of the same kind
LOADER_OPTIONS = ("path", "min_prompt", "max_prompt", "max_total")


def dataset_options(cfg: DictConfig, dataset: str, num_requests: int) -> dict:
    """Loader options for `dataset`: the sweep's request count and seed, plus the workload group's path and
    length limits when that group is the dataset's (`workload=sharegpt workload.path=...`)."""
    opts = {"num_requests": num_requests, "seed": as_int(cfg.seed, "seed")}
    kind = str(cfg.workload.kind)
    if kind == dataset:
        opts |= {k: cfg.workload[k] for k in LOADER_OPTIONS if cfg.workload.get(k) is not None}
    return opts


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    pols = policies(cfg)
    for d in cfg.datasets:
        check(d in DATASETS, f"unknown dataset {d!r}; valid: {', '.join(DATASETS)}")
    for r in cfg.rates:
        check_rate(r)
    kind = str(cfg.workload.kind)
    check(kind == "synthetic" or kind in cfg.datasets, f"workload={kind} sets the {kind} loader's options, but "
          f"datasets={list(cfg.datasets)} does not include {kind}; add it or drop the workload override")
    n = as_int(cfg.num_requests, "num_requests")
    check(n >= 1, f"num_requests must be >= 1, got {n}")
    w = as_int(cfg.get("warmup_requests", 0), "warmup_requests")
    check(w >= 0, f"warmup_requests must be >= 0, got {w}")
    workloads = {d: build_workload(d, **dataset_options(cfg, d, n + w)) for d in cfg.datasets}
    writer.manifest["workloads"] = {d: {"path": w.path, "tokenizer": w.tokenizer, "params": w.params}
                                    for d, w in workloads.items()}
    points = [(d, float(r), p) for d in cfg.datasets for r in cfg.rates for p in pols]
    for d, rate, pol in progress(cfg, points, "rate_sweep"):
        if point_done(writer, s, system=pol.name, variant=pol.variant, dataset=d, rate=rate):
            continue
        wl = with_arrivals(workloads[d], rate, as_float(cfg.burstiness, "burstiness"), seed=as_int(cfg.seed, "seed"))
        save_schedule(wl, writer.run_dir / "schedules" / f"{d}-rate{rate:g}.parquet")  # replayable on a GPU
        row = base_row(cfg, s, system=pol.name, variant=pol.variant) | {"dataset": d, "rate": rate}
        steps = steps_file(writer.run_dir, pol, f"{d}-rate{rate:g}")
        for r in serve_point(pol, s, wl.requests, row, whole_batch=False, warmup=w, steps_path=steps):
            writer.add(r)
