"""GPU executor: serve requests for real with a system's KV path; GPU memory measured, not computed.

Expensive set-up is done once per process and reused across the points of a sweep: random weights per
model, and the pinned host arena (pinning is slow: 64 GB took 43 s on the H200 host), grown on demand.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pandas as pd
import torch

from directkv.engine.gpu.gc_guard import GcGuard
from directkv.engine.gpu.stepper import GPUStepper
from directkv.engine.loop import ServeResult, serve
from directkv.engine.scheduler import SchedulerConfig
from directkv.engine.sim_executor import MemoryConfig, kv_budgets
from directkv.engine.systems import (
    DEFAULT_CPU_ATTN_KERNEL,
    DEFAULT_NO_PAST_PREFILL,
    NO_PIPELINING,
    Pipelining,
    SystemPolicy,
    check_hbm_prefill,
    check_no_past_prefill,
    directkv_row_columns,
)
from directkv.kernels.traffic_model import (
    SERVING_STREAM_CHUNK_MIB,
    SERVING_STREAM_SLOTS,
    check_stream_chunk_mib,
    check_stream_slots,
)
from directkv.memory import HostArena, KVCacheManager
from directkv.model.runner import ModelRunner
from directkv.model.weights import init_weights
from directkv.results import write_parquet
from directkv.specs import ModelSpec
from workloads.request import Request

_runners: dict[tuple[str, str], ModelRunner] = {}
_arenas: dict[tuple[str, int, bool], HostArena] = {}


def runner_for(model: ModelSpec, device: torch.device) -> ModelRunner:
    key = (model.name, str(device))
    if key not in _runners:
        _runners.clear()  # one model's weights at a time
        torch.cuda.empty_cache() if device.type == "cuda" else None
        _runners[key] = ModelRunner(model, init_weights(model, device=device))
    return _runners[key]


def arena_for(model: ModelSpec, pages: int, page_size: int, *, pin: bool) -> HostArena:
    key = (model.name, page_size, pin)
    have = _arenas.get(key)
    if have is None or have.k.shape[1] < pages:
        _arenas.pop(key, None)
        _arenas[key] = HostArena.allocate(model, pages, page_size, pin=pin)
    return _arenas[key]


class NvmlSampler:
    """Background sampler of NVML memory used and PCIe throughput: a cross-check of our own accounting."""

    def __init__(self, period_s: float = 0.05):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # no NVML: the row says so with NaNs
            self.nvml = None

    def __enter__(self):
        if self.nvml:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        n = self.nvml
        while not self._stop.is_set():
            used = n.nvmlDeviceGetMemoryInfo(self.handle).used
            rx = n.nvmlDeviceGetPcieThroughput(self.handle, n.NVML_PCIE_UTIL_RX_BYTES)  # KB/s, 20 ms window
            self.samples.append((time.perf_counter(), used, rx))
            self._stop.wait(self.period_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.nvml:
            self.thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"nvml_used_gb": float("nan"), "nvml_pcie_rx_gbps_mean": float("nan")}
        return {"nvml_used_gb": max(s[1] for s in self.samples) / 1e9,
                "nvml_pcie_rx_gbps_mean": sum(s[2] for s in self.samples) / len(self.samples) * 1e3 / 1e9}


def run_gpu(requests: list[Request], policy: SystemPolicy, model: ModelSpec, *, mem: MemoryConfig,
            sched_cfg: SchedulerConfig, device: str = "cuda", warmup: int = 0, seed: int = 0,
            cuda_graphs: bool = False, cpu_attn_kernel: str = DEFAULT_CPU_ATTN_KERNEL,
            pipelining: Pipelining = NO_PIPELINING, prefill_new_pass: str = "kernel",
            stream_slots: int = SERVING_STREAM_SLOTS, stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB,
            hbm_prefill: str = "kernel", no_past_prefill: str = DEFAULT_NO_PAST_PREFILL,
            steps_path: Path | None = None) -> tuple[ServeResult, dict]:
    """Serve `requests` for real; returns the result (gpu_mem_bytes measured) and extra measured columns.
    steps_path: where to write the run's per-step times (write_step_series), if anywhere; a write that fails
    leaves the run's row, with steps_file_error saying why.

    cpu_attn_kernel: cpu_attn only: "flash" (torch's CPU flash kernel per run of pages of each decode) or
    "native" (one OpenMP call per layer for all decodes; directkv.kernels.cpu_decode_attention).

    pipelining: directkv only, when enabled: steps as two parts (halves of a decode-only step; decodes | prompt
    chunks of a mixed one), one part's zero-copy attention on a side stream overlapping the other part's
    dense layers (runner.forward_pipelined, paths.attend_async, stepper.split); see systems.Pipelining.

    cuda_graphs: replay the runner's dense layer parts as CUDA graphs on steps of <= 256 tokens
    (directkv/model/graphs.py; captured once per process, before the warm-up); attention stays eager.

    prefill_new_pass: every system's tiled prefill of a prompt chunk (the CUDA kernels): "kernel" (the new
    tokens with the past in one tiled kernel) or "flash" (prefill_attention's new_pass: the new tokens by
    FlashAttention-2, merged with the past's tiled pass).

    stream_slots: directkv variant stream only: its rings' HBM in slots of 32 MiB of K and V (2 = the 64 MiB of
    the kernel target, with stream_chunk_mib <= 16; 12 by default); a prompt chunk's ring takes up to that many
    such slots.
    stream_chunk_mib: the decode ring holds that HBM in slots of this many MiB of K (and as much V): 64 by
    default, so 3 slots; 16 = stream_slots slots. Both recorded on its rows (directkv_stream_slots,
    directkv_stream_chunk_mib).

    hbm_prefill: a prompt chunk over HBM pages (hbm, and the staging pools of swap, cpu_attn and flexgen):
    "kernel" (our tiled kernel) or "sdpa" (gathered into contiguous K/V, then torch SDPA; hbm_prefill.py).

    no_past_prefill: directkv only: a prompt chunk with no past by its kernel ("kernel") or by one SDPA call over
    the chunk's own K/V, in HBM ("sdpa"); recorded on its rows as directkv_no_past_prefill."""
    pipelining.check_system(policy)  # before pinning host memory and capturing graphs
    check_hbm_prefill(hbm_prefill)
    check_no_past_prefill(no_past_prefill)
    check_stream_slots(stream_slots, "stream_slots (executor.directkv_stream_slots)")  # before pinning, every system
    check_stream_chunk_mib(stream_chunk_mib, stream_slots, "stream_chunk_mib (executor.directkv_stream_chunk_mib)")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:  # memory-fraction and stats calls want an explicit index
        dev = torch.device("cuda", torch.cuda.current_device())
    runner = runner_for(model, dev)
    hbm_kv, host_kv = kv_budgets(policy, model, mem, sched_cfg)
    need_pages = sum(-(-(r.prompt_len + r.output_len) // mem.page_size) for r in requests)
    per_token = policy.kv_bytes_per_token(model)
    host_kv = min(host_kv, need_pages * mem.page_size * per_token)  # pin what the run can use, not the budget
    hbm_kv = min(hbm_kv, need_pages * mem.page_size * per_token)
    extra: dict = {}
    arena = None
    if policy.kv_tier == "host" and policy.name != "flexgen":
        t0 = time.perf_counter()
        arena = arena_for(model, host_kv // (mem.page_size * per_token), mem.page_size, pin=cuda)
        extra["pin_s"] = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, mem.hbm_budget_bytes / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
    kv = KVCacheManager(model, page_size=mem.page_size, hbm_budget_bytes=hbm_kv, host_budget_bytes=host_kv,
                        bytes_per_token=per_token, materialize=policy.name != "flexgen", hbm_device=dev, arena=arena)
    extra["cuda_graphs"] = bool(cuda_graphs)
    if cuda_graphs:
        t0 = time.perf_counter()
        runner.enable_graphs(slots=2 if pipelining.runs_parts(policy) else 1)  # a pipelined step replays one graph set per half
        extra["graph_capture_s"] = time.perf_counter() - t0
    else:
        runner.disable_graphs()  # the runner is shared by a sweep's points: an earlier point may have enabled them
    threads = int(os.environ.get("DIRECTKV_CPU_THREADS", os.cpu_count() or 1))
    if policy.name == "cpu_attn":
        extra["cpu_attn_kernel"] = cpu_attn_kernel
    extra |= pipelining.row_columns(policy, measured=True)
    extra["prefill_new_pass"] = prefill_new_pass
    extra["hbm_prefill"] = hbm_prefill
    extra |= directkv_row_columns(policy, stream_slots, stream_chunk_mib, no_past_prefill)
    stepper = GPUStepper(policy, runner, kv, dev, seed=seed, cpu_threads=threads, cpu_attn_kernel=cpu_attn_kernel,
                         pipelining=pipelining, prefill_new_pass=prefill_new_pass, stream_slots=stream_slots,
                         stream_chunk_mib=stream_chunk_mib, hbm_prefill=hbm_prefill, no_past_prefill=no_past_prefill)
    # warm-up outside the measurement: kernel builds and first launches, library handles
    serve([Request(-1, 64, 3), Request(-2, 40, 3)], stepper, kv, policy.kv_tier, model, sched_cfg=sched_cfg)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if cuda else 0
    stepper.forget_steps()  # the warm-up's steps are not the run's
    with GcGuard() as collections, NvmlSampler() if cuda else _Null() as sampler:
        res = serve(requests, stepper, kv, policy.kv_tier, model, sched_cfg=sched_cfg, warmup=warmup)
    extra |= step_time_columns(stepper.step_times, device=cuda) | collections.columns()
    if steps_path is not None:
        try:
            write_step_series(steps_path, stepper.step_shapes, stepper.step_times)
        except OSError as e:  # the measurement stands without its series
            extra["steps_file_error"] = f"{type(e).__name__}: {e}"[:300]
    if cuda:
        res.gpu_mem_bytes = torch.cuda.max_memory_reserved(dev)
        extra |= {"gpu_peak_allocated_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
                  "gpu_weights_and_pools_gb": base / 1e9} | sampler.summary()
        if policy.name == "flexgen":
            shadow = sum(t.numel() * t.element_size() for t in stepper.path.shadow)
            res.gpu_mem_bytes -= shadow  # the exact layer-0 cache exists only to measure accuracy
            extra["flexgen_shadow_gb"] = shadow / 1e9
    if policy.name == "flexgen":
        errs = stepper.path.errors
        res.host_pinned_bytes = stepper.path.pinned_bytes()
        extra |= {"flexgen_rel_err_mean": sum(errs) / len(errs) if errs else float("nan"),
                  "flexgen_rel_err_max": max(errs, default=float("nan"))}
    elif arena is not None:
        res.host_pinned_bytes = arena.nbytes
    return res, extra


def write_step_series(path: Path, shapes: list[tuple[int, int, float]],
                      times: list[tuple[float, float, float]]) -> None:
    """One row per step of a measured run, in order, at `path` (parquet): its start in seconds from the first
    step's, its decodes and prompt tokens, device ms, host ms to queue it and to plan it (the row's
    step_ms_mean, host_queue_ms_mean, host_prep_ms_mean are their means). A row's means say how slow a run was;
    the series says when: two runs of one system in one call differed by 20-30% (H200, 2026-12-01), every step
    slower in the slow one. Written whole or not at all (a run cut by a timeout leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    first = shapes[0][2] if shapes else 0.0
    write_parquet(pd.DataFrame({"step": range(len(times)), "start_s": [s[2] - first for s in shapes],
                                "decodes": [s[0] for s in shapes], "prompt_tokens": [s[1] for s in shapes],
                                "device_ms": [1e3 * t[0] for t in times],
                                "host_queue_ms": [1e3 * t[1] for t in times],
                                "host_prep_ms": [1e3 * t[2] for t in times]}), path)


def step_time_columns(times: list[tuple[float, float, float]], *, device: bool = True) -> dict:
    """Row columns of a run's (device s, host s to queue the step, host s to plan it) triples: mean step time, mean
    host time to queue a step and to plan it (plan_step and the path's begin, which issues the step's first copies:
    the copy engine cannot start before), and the share of steps the host took >= 90% of the step's time to queue;
    there the device likely waited for the host's launches, which no roofline of the device models (the
    simulation beside the row does not). A path that waits for the device within a step (cpu_attn's copies of Q
    to the host, a pipelined step's CPU half) counts that wait as host time too. Off a GPU (device False) the host
    runs the step itself: the share is NaN. The steps are all of the serve call's, the warm-up requests' included."""
    names = ("step_ms_mean", "host_queue_ms_mean", "host_prep_ms_mean", "host_bound_step_share")
    if not times:
        return dict.fromkeys(names, float("nan"))
    n = len(times)
    means = [1e3 * sum(t[i] for t in times) / n for i in range(3)]
    share = sum(h >= 0.9 * d for d, h, _ in times) / n if device else float("nan")
    return dict(zip(names, (*means, share), strict=True))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def summary(self) -> dict:
        return {}
