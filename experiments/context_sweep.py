"""Fig. 11: per-token latency and GPU memory vs context length for every system."""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.results import ResultsWriter
from experiments.common import base_row, check_context, policies, progress, setup
from experiments.serving import serve_point
from workloads import synthetic_workload


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    pols = policies(cfg)
    out = int(cfg.output_len)
    for ctx in cfg.contexts:
        check_context(s.model, int(ctx) + out)
    points = [(int(ctx), p) for ctx in cfg.contexts for p in pols]
    for ctx, pol in progress(cfg, points, "context_sweep"):
        key = dict(system=pol.name, variant=pol.variant, context_len=float(ctx))
        if writer.done(**key):
            continue
        wl = synthetic_workload(int(cfg.batch_size), ctx, out, seed=int(cfg.seed))
        row = base_row(cfg, s, system=pol.name, variant=pol.variant) | {
            "context_len": float(ctx), "output_len": out, "batch_size": int(cfg.batch_size), "rate": float("inf")}
        for r in serve_point(pol, s, wl.requests, row, whole_batch=True):
            writer.add(r)
