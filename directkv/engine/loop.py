"""The serving loop shared by every executor: arrivals, scheduling, one step at a time, on an engine clock.

The clock advances by each step's time — the cost model's in simulation, CUDA-event time on a GPU — and
jumps to the next arrival when the engine is idle, so both executors produce per-request token times on
the same clock and the same metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from directkv.engine.scheduler import Scheduler, SchedulerConfig
from directkv.engine.state import ReqState, Step
from directkv.engine.systems import StepCost
from directkv.kernels.traffic import Traffic
from directkv.memory import KVCacheManager
from directkv.metrics import summarize
from directkv.specs import ModelSpec
from workloads.request import Request


class Stepper(Protocol):
    def run_step(self, step: Step) -> StepCost: ...


def activation_bytes(model: ModelSpec, tokens: int, logits_rows: int) -> int:
    """Peak activations of one step: hidden states, MLP intermediates and fp32 logits."""
    return (tokens * (4 * model.hidden_size + 2 * model.intermediate_size) * model.dtype_bytes
            + logits_rows * model.vocab_size * 4)


@dataclass
class ServeResult:
    states: list[ReqState]
    duration_s: float
    traffic: Traffic
    kv_hbm_peak_bytes: int
    host_pinned_bytes: int
    kv_bytes: int  # peak KV bytes held (all tiers)
    staging_peak_bytes: int
    activation_peak_bytes: int
    steps: int
    metrics: dict = field(default_factory=dict)
    gpu_mem_bytes: int = 0  # filled by the executor (model: formula; GPU: measured)


def serve(requests: list[Request], stepper: Stepper, kv: KVCacheManager, tier: str, model: ModelSpec, *,
          sched_cfg: SchedulerConfig, warmup: int = 0) -> ServeResult:
    """Serve `requests`; the first `warmup` (by arrival) are run but left out of the metrics."""
    sched = Scheduler(sched_cfg, kv, tier)
    states = [ReqState(r) for r in sorted(requests, key=lambda r: (r.arrival_s, r.req_id))]
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
        cost = stepper.run_step(step)
        t += cost.time_s
        sched.complete(step, t)
        traffic = traffic + cost.traffic
        staging_peak = max(staging_peak, cost.staging_bytes)
        act_peak = max(act_peak, activation_bytes(model, step.num_tokens, step.num_logits))
        steps += 1
    stats = kv.stats()
    measured = states[warmup:]
    end = max((s.token_times[-1] for s in measured if s.token_times), default=0.0)
    start = min((s.req.arrival_s for s in measured), default=0.0)
    return ServeResult(states, t, traffic, stats.hbm_peak_bytes, stats.host_peak_bytes,
                       stats.hbm_peak_bytes + stats.host_peak_bytes, staging_peak, act_peak, steps,
                       summarize(measured, end - start))
