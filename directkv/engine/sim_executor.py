"""Simulation executor: the real scheduler and KV manager, a virtual clock advanced by the cost model.

No model math runs: each step's time is the system's cost for that step's traffic on the HardwareSpec,
so a laptop reproduces the shape of the paper's curves in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from directkv.costmodel import CostModel
from directkv.engine.scheduler import Scheduler, SchedulerConfig
from directkv.engine.state import ReqState
from directkv.engine.systems import SystemPolicy, gpu_memory_bytes, step_cost
from directkv.errors import KVCapacityError
from directkv.kernels.traffic import Traffic
from directkv.memory import KVCacheManager
from directkv.metrics import summarize
from directkv.specs import ModelSpec
from workloads.request import Request


@dataclass(frozen=True)
class MemoryConfig:
    hbm_budget_bytes: float  # GPU memory the system may use in total (weights included)
    host_budget_bytes: float  # pinned host memory the KV may use
    runtime_overhead_bytes: float = 1.0e9  # CUDA context, library workspaces
    page_size: int = 16


def activation_bytes(model: ModelSpec, tokens: int, logits_rows: int) -> int:
    """Peak activations of one step: hidden states, MLP intermediates and fp32 logits."""
    return (tokens * (4 * model.hidden_size + 2 * model.intermediate_size) * model.dtype_bytes
            + logits_rows * model.vocab_size * 4)


@dataclass
class SimResult:
    states: list[ReqState]
    duration_s: float
    traffic: Traffic
    gpu_mem_bytes: int
    host_pinned_bytes: int
    kv_bytes: int  # peak KV bytes held (all tiers)
    steps: int
    metrics: dict = field(default_factory=dict)


def kv_budgets(policy: SystemPolicy, model: ModelSpec, mem: MemoryConfig, sched: SchedulerConfig) -> tuple[int, int]:
    """(hbm, host) KV budgets; HBM KV gets what weights, activations and runtime leave of the budget."""
    reserve = activation_bytes(model, sched.max_batched_tokens, sched.max_num_seqs) + mem.runtime_overhead_bytes
    left = mem.hbm_budget_bytes - model.weight_bytes() - reserve
    if left < 0:
        raise KVCapacityError("hbm", int(model.weight_bytes() + reserve), 0, int(mem.hbm_budget_bytes))
    if policy.kv_tier == "hbm":
        return int(left), 0
    return 0, int(mem.host_budget_bytes)


def simulate(requests: list[Request], policy: SystemPolicy, model: ModelSpec, cm: CostModel, *,
             mem: MemoryConfig, sched_cfg: SchedulerConfig = SchedulerConfig(), warmup: int = 0) -> SimResult:
    """Serve `requests` (sorted by arrival) with `policy`; raises KVCapacityError if weights alone don't fit."""
    hbm_kv, host_kv = kv_budgets(policy, model, mem, sched_cfg)
    kv = KVCacheManager(model, page_size=mem.page_size, hbm_budget_bytes=hbm_kv, host_budget_bytes=host_kv,
                        bytes_per_token=policy.kv_bytes_per_token(model))
    sched = Scheduler(sched_cfg, kv, policy.kv_tier)
    states = [ReqState(r) for r in sorted(requests, key=lambda r: r.arrival_s)]
    t, i, steps = 0.0, 0, 0
    traffic, staging_peak, act_peak = Traffic(), 0, 0
    while i < len(states) or not sched.idle:
        while i < len(states) and states[i].req.arrival_s <= t:
            sched.add(states[i])
            i += 1
        step = sched.schedule(t)
        if step.num_tokens == 0:
            if i >= len(states):
                break  # only unservable requests were left; they are marked oom
            t = max(t, states[i].req.arrival_s)
            continue
        cost = step_cost(policy, step, model, cm)
        t += cost.time_s
        sched.complete(step, t)
        traffic = traffic + cost.traffic
        staging_peak = max(staging_peak, cost.staging_bytes)
        act_peak = max(act_peak, activation_bytes(model, step.num_tokens, step.num_logits))
        steps += 1
    stats = kv.stats()
    gpu = gpu_memory_bytes(policy, model, kv_hbm_peak=stats.hbm_peak_bytes, staging_peak=staging_peak,
                           activation_peak=act_peak, runtime_overhead=int(mem.runtime_overhead_bytes))
    measured = states[warmup:]
    end = max((s.token_times[-1] for s in measured if s.token_times), default=0.0)
    start = min((s.req.arrival_s for s in measured), default=0.0)
    return SimResult(states, t, traffic, gpu, stats.host_peak_bytes, stats.hbm_peak_bytes + stats.host_peak_bytes,
                     steps, summarize(measured, end - start))
