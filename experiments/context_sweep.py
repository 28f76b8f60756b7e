"""Fig. 11: per-token latency and GPU memory vs context length for every system."""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.errors import check
from directkv.results import ResultsWriter
from experiments.common import as_int, base_row, check_context, int_list, policies, progress, setup
from experiments.serving import point_done, serve_point, steps_file
from workloads import synthetic_workload


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    pols = policies(cfg)
    out = as_int(cfg.output_len, "output_len")
    batch = as_int(cfg.batch_size, "batch_size")
    check(batch >= 1, f"batch_size must be >= 1, got {batch}")
    contexts = int_list(cfg.contexts, "context length")
    for ctx in contexts:
        check_context(s.model, ctx)
        # each request then generates output_len tokens on top: name the largest context that leaves room
        check(ctx + out <= s.model.max_context,
              f"context {ctx} + output_len {out} = {ctx + out} tokens exceeds {s.model.name}'s limit of "
              f"{s.model.max_context}; with output_len={out} contexts must be <= {s.model.max_context - out}")
    points = [(ctx, p) for ctx in contexts for p in pols]
    for ctx, pol in progress(cfg, points, "context_sweep"):
        key = dict(system=pol.name, variant=pol.variant, context_len=float(ctx))
        if point_done(writer, s, **key):
            continue
        wl = synthetic_workload(batch, ctx, out, seed=as_int(cfg.seed, "seed"))
        row = base_row(cfg, s, system=pol.name, variant=pol.variant) | {
            "context_len": float(ctx), "output_len": out, "batch_size": batch, "rate": float("inf")}
        steps = steps_file(writer.run_dir, pol, f"context{ctx}")
        for r in serve_point(pol, s, wl.requests, row, whole_batch=True, steps_path=steps):
            writer.add(r)
