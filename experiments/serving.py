"""Shared serving-point runner for the context and rate sweeps: one (workload, system) point -> rows.

On a GPU a point is served for real (mode=measured) and also simulated with the same requests
(mode=simulated), so every measured row has its cost-model twin in the same table.
"""

from __future__ import annotations

import time
from pathlib import Path

from directkv.engine.loop import ServeResult
from directkv.engine.sim_executor import kv_budgets, simulate
from directkv.engine.systems import SystemPolicy, directkv_row_columns
from directkv.errors import ConfigError, KVCapacityError
from directkv.results import ResultsWriter
from experiments.common import Setup
from workloads.request import Request

METRIC_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
               "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
               "request_throughput", "output_throughput", "total_token_throughput", "completed", "num_oom",
               "duration_s")


# The systems (policy labels) this process has finished a serving of on the GPU (a warm-up pass or a measured
# point). The first system measured in a fresh process ran its first ~6 s of ShareGPT steps slower than a system
# measured after it (prompt steps +39-54%, the host's own per-step work too), 8-30% on the whole run (H200,
# 2026-12-02, results/h200/README.md, eighteenth session; cause not known). A system measured after another
# still pays for its own first uses: at Llama-3.1-8B batch 4 32K swap measured second took 0.81-0.94 s on its
# first step against 62 ms when warmed, and 47-74 ms more on each request's first step beside a decode
# (twenty-first session). So executor.warmup_pass warms each system once per process, unmeasured.
_served: set[str] = set()


def batch_fits(policy: SystemPolicy, s: Setup, requests: list[Request]) -> str:
    """'' if every request's KV fits its tier at once, else why not (the paper's fixed-batch OOM)."""
    hbm, host = kv_budgets(policy, s.model, s.mem, s.sched)
    budget = hbm if policy.kv_tier == "hbm" else host
    need = sum(r.prompt_len + r.output_len for r in requests) * policy.kv_bytes_per_token(s.model)
    if need > budget:
        return f"batch KV {need / 1e9:.1f} GB exceeds the {policy.kv_tier} KV budget {budget / 1e9:.1f} GB"
    return ""


def _fill(row: dict, res: ServeResult, s: Setup, extra: dict) -> dict:
    m = res.metrics
    status = "ok" if m["completed"] else "oom"
    return row | {k: m[k] for k in METRIC_KEYS} | {
        "status": status,
        "error": "" if status == "ok" else f"{m['num_oom']} request(s) can never fit the KV budget",
        "tpot_ms": m["mean_tpot_ms"],
        "ttft_ms": m["mean_ttft_ms"],
        "time_ms": res.duration_s * 1e3,
        "gpu_mem_gb": res.gpu_mem_bytes / 1e9,
        "host_pinned_gb": res.host_pinned_bytes / 1e9,
        "kv_bytes": float(res.kv_bytes),
        "link_read_bytes": float(res.traffic.link_read_bytes),
        "link_write_bytes": float(res.traffic.link_write_bytes),
        "hbm_budget_gb": s.mem.hbm_budget_bytes / 1e9,
        "steps": res.steps,
    } | extra


def _one(policy: SystemPolicy, s: Setup, requests: list[Request], row: dict, *, measure: bool, warmup: int,
         steps_path: Path | None) -> dict:
    row = row | ({"mode": "measured"} if measure else {})
    try:
        if measure:
            if steps_path is not None:
                steps_path.unlink(missing_ok=True)  # an earlier, cut attempt's series is not this run's
            warm = policy.label in _served
            res, extra = _serve_gpu(policy, s, requests, warmup, steps_path)
            # warm only once a serving has finished: a point that failed (before its first step, or midway) may
            # have warmed nothing, so the system's next point gets its pass (and says process_warm truthfully)
            _served.add(policy.label)
            return _fill(row, res, s, extra | {"process_warm": warm})
        res = simulate(requests, policy, s.model, s.cm, mem=s.mem, sched_cfg=s.sched, warmup=warmup,
                       pipelining=s.pipelining, stream_slots=s.stream_slots, stream_chunk_mib=s.stream_chunk_mib,
                       hbm_prefill=s.hbm_prefill, no_past_prefill=s.no_past_prefill, cuda_graphs=s.sim_graphs)
        # a pipelined directkv row is simulated pipelined too, and says so like its measured row; a stream row
        # says with which decode ring it was simulated; a directkv row, with what attended its chunks with no past;
        # every row, with which prompt-chunk attention over HBM pages (as every measured row says)
        extra = (s.pipelining.row_columns(policy, measured=False)
                 | directkv_row_columns(policy, s.stream_slots, s.stream_chunk_mib, s.no_past_prefill)
                 | {"hbm_prefill": s.hbm_prefill})
        return _fill(row, res, s, extra)
    except KVCapacityError as e:
        return row | {"status": "oom", "error": str(e)}
    except ConfigError:
        raise  # the user's input, not this point, is wrong: one line and exit 2
    except Exception as e:  # noqa: BLE001 - a failing point is recorded and the sweep goes on
        import torch

        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        return row | {"status": "oom" if oom else "error", "error": f"{type(e).__name__}: {e}"[:500]}


def _serve_gpu(policy: SystemPolicy, s: Setup, requests: list[Request], warmup: int, steps_path: Path | None):
    from directkv.engine.gpu.executor import run_gpu

    return run_gpu(requests, policy, s.model, mem=s.mem, sched_cfg=s.sched, warmup=warmup, cuda_graphs=s.cuda_graphs,
                   cpu_attn_kernel=s.cpu_attn_kernel, pipelining=s.pipelining, prefill_new_pass=s.prefill_new_pass,
                   stream_slots=s.stream_slots, stream_chunk_mib=s.stream_chunk_mib, hbm_prefill=s.hbm_prefill,
                   no_past_prefill=s.no_past_prefill, steps_path=steps_path)


def warm_process(policy: SystemPolicy, s: Setup, requests: list[Request], *, warmup: int) -> bool:
    """The warm-up pass (executor.warmup_pass): serve `requests` once with `policy` on the GPU, unmeasured, if this
    process has finished no serving of that system (its label: name and variant) yet. Returns whether it ran. A
    failing pass is reported on one line and the point is measured anyway (its row's process_warm says false);
    the system's next point tries a pass again."""
    if policy.label in _served:
        return False
    t0 = time.perf_counter()
    try:
        _serve_gpu(policy, s, requests, warmup, None)
    except Exception as e:  # noqa: BLE001 - the measured point that follows records its own failure, if any
        print(f"warm-up pass with {policy.label} failed ({type(e).__name__}: {str(e)[:200]}); measuring cold", flush=True)
        return False
    _served.add(policy.label)
    print(f"warm-up pass: {policy.label}, {len(requests)} requests, {time.perf_counter() - t0:.1f} s, unmeasured "
          f"(executor.warmup_pass)", flush=True)
    return True


def point_done(writer: ResultsWriter, s: Setup, **key) -> bool:
    """Whether a rerun into the same run directory skips this serving point: on a GPU when its measured row is
    ok or oom (a simulated twin alone does not count: a measurement that failed is tried again), when simulating
    when any row is. A point not done loses its earlier rows, so its next attempt does not sit beside them."""
    if writer.done(**key, **({"mode": "measured"} if s.device == "cuda" else {})):
        return True
    writer.forget(**key)
    return False


def steps_file(run_dir: Path, policy: SystemPolicy, point: str) -> Path:
    """Where a measured run of `policy` at `point` (e.g. "sharegpt-rate10", "context16384") writes its step series:
    one file per system and point in the run (a run serves one directkv variant; a system is listed once)."""
    return run_dir / "steps" / f"{policy.label}-{point}.parquet"


def serve_point(policy: SystemPolicy, s: Setup, requests: list[Request], row: dict, *, whole_batch: bool,
                warmup: int = 0, steps_path: Path | None = None) -> list[dict]:
    """Rows of one point: simulated, plus measured on a GPU; OOM and failures become status rows. steps_path: where
    the measured run writes its per-step times (parquet; steps_file), if anywhere."""
    row = dict(row, num_requests=len(requests) - warmup, warmup_requests=warmup)
    why = batch_fits(policy, s, requests) if whole_batch else ""
    modes = [True, False] if s.device == "cuda" else [False]
    if why:
        return [row | {"status": "oom", "error": why} | ({"mode": "measured"} if m else {}) for m in modes]
    if s.device == "cuda" and s.warmup_pass:
        warm_process(policy, s, requests, warmup=warmup)
    return [_one(policy, s, requests, row, measure=m, warmup=warmup, steps_path=steps_path) for m in modes]
