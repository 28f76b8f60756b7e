"""Simulation executor: the real scheduler and KV manager, a virtual clock advanced by the cost model.

No model math runs: each step's time is the system's cost for that step's traffic on the HardwareSpec, plus
the measured executor's host time per step where the hardware's calibration holds one (directkv/host_time.py),
so a laptop reproduces the shape of the paper's curves in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

from directkv.costmodel import CostModel
from directkv.engine.loop import ServeResult, activation_bytes, serve
from directkv.engine.scheduler import SchedulerConfig
from directkv.engine.state import Step
from directkv.engine.systems import (
    DEFAULT_NO_PAST_PREFILL,
    NO_PIPELINING,
    Pipelining,
    StepCost,
    SystemPolicy,
    check_hbm_prefill,
    check_no_past_prefill,
    gpu_memory_bytes,
    step_cost,
)
from directkv.errors import KVCapacityError
from directkv.host_time import HostTime
from directkv.kernels.traffic_model import (
    SERVING_STREAM_CHUNK_MIB,
    SERVING_STREAM_SLOTS,
    check_stream_chunk_mib,
    check_stream_slots,
)
from directkv.memory import KVCacheManager
from directkv.specs import ModelSpec
from workloads.request import Request


@dataclass(frozen=True)
class MemoryConfig:
    hbm_budget_bytes: float  # GPU memory the system may use in total (weights included)
    host_budget_bytes: float  # pinned host memory the KV may use
    runtime_overhead_bytes: float = 1.0e9  # CUDA context, library workspaces
    page_size: int = 16


def kv_budgets(policy: SystemPolicy, model: ModelSpec, mem: MemoryConfig, sched: SchedulerConfig) -> tuple[int, int]:
    """(hbm, host) KV budgets; HBM KV gets what weights, activations and runtime leave of the budget."""
    reserve = activation_bytes(model, sched.max_batched_tokens, sched.max_num_seqs) + mem.runtime_overhead_bytes
    left = mem.hbm_budget_bytes - model.weight_bytes() - reserve
    if left < 0:
        raise KVCapacityError("hbm", int(model.weight_bytes() + reserve), 0, int(mem.hbm_budget_bytes))
    if policy.kv_tier == "hbm":
        return int(left), 0
    return 0, int(mem.host_budget_bytes)


@dataclass(frozen=True)
class CostModelStepper:
    policy: SystemPolicy
    model: ModelSpec
    cm: CostModel
    pipelining: Pipelining = NO_PIPELINING
    page_size: int = 16
    on_step: Callable[[Step, StepCost], None] | None = None  # sees every step and its cost (profile's comparison)
    stream_slots: int = SERVING_STREAM_SLOTS  # directkv stream's rings' HBM, in 16 MiB slots of K
    hbm_prefill: str = "kernel"  # what attends prompt chunks over HBM pages (hbm and the staged systems)
    stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB  # K per slot of its decode ring
    no_past_prefill: str = DEFAULT_NO_PAST_PREFILL  # what attends directkv's prompt chunks with no past
    cuda_graphs: bool = True  # the measured executor's setting being modelled: without graphs every step issues eagerly

    @cached_property
    def host(self) -> HostTime:
        """This system's host time per step, looked up once (not per step)."""
        return self.cm.host_for(self.policy.label)

    def run_step(self, step: Step) -> StepCost:
        cost = step_cost(self.policy, step, self.model, self.cm, self.pipelining, page_size=self.page_size,
                         stream_slots=self.stream_slots, stream_chunk_mib=self.stream_chunk_mib,
                         hbm_prefill=self.hbm_prefill, no_past_prefill=self.no_past_prefill, graphs=self.cuda_graphs)
        # the measured executor's host time (planning; issuing a step too large for its graphs, or the eager part
        # of a graph-sized step: its prompt chunks, or its decodes' attention): host_time.py
        cost = replace(cost, time_s=self.host.step_seconds(cost.time_s, len(step.decodes), step.num_tokens,
                                                            self.model.num_layers, self.cuda_graphs))
        if self.on_step is not None:
            self.on_step(step, cost)
        return cost


def simulate(requests: list[Request], policy: SystemPolicy, model: ModelSpec, cm: CostModel, *,
             mem: MemoryConfig, sched_cfg: SchedulerConfig | None = None, warmup: int = 0,
             pipelining: Pipelining = NO_PIPELINING,
             on_step: Callable[[Step, StepCost], None] | None = None,
             stream_slots: int = SERVING_STREAM_SLOTS, stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB,
             hbm_prefill: str = "kernel", no_past_prefill: str = DEFAULT_NO_PAST_PREFILL,
             cuda_graphs: bool = True) -> ServeResult:
    """Serve `requests` with `policy` on the cost model; raises KVCapacityError if weights alone don't fit.
    pipelining: directkv's two-part steps as the measured executor would run them (systems.pipelined_step_cost).
    on_step: called with every step and its simulated cost. stream_slots: directkv stream's rings' HBM, in 16 MiB
    slots of K (executor.directkv_stream_slots; the prompt chunk's ring takes up to that many); stream_chunk_mib:
    the K per slot of its decode ring (executor.directkv_stream_chunk_mib).
    hbm_prefill: our tiled kernel or SDPA for prompt chunks over HBM pages (executor.hbm_prefill).
    no_past_prefill: the same for directkv's prompt chunks with no past (executor.directkv_no_past_prefill).
    cuda_graphs: the measured executor's executor.cuda_graphs being modelled (its host time per step; host_time.py)."""
    pipelining.check_system(policy)
    check_stream_slots(stream_slots)
    check_stream_chunk_mib(stream_chunk_mib, stream_slots)
    check_hbm_prefill(hbm_prefill)
    check_no_past_prefill(no_past_prefill)
    sched_cfg = sched_cfg or SchedulerConfig()
    hbm_kv, host_kv = kv_budgets(policy, model, mem, sched_cfg)
    kv = KVCacheManager(model, page_size=mem.page_size, hbm_budget_bytes=hbm_kv, host_budget_bytes=host_kv,
                        bytes_per_token=policy.kv_bytes_per_token(model))
    stepper = CostModelStepper(policy, model, cm, pipelining, mem.page_size, on_step, stream_slots=stream_slots,
                               stream_chunk_mib=stream_chunk_mib, hbm_prefill=hbm_prefill,
                               no_past_prefill=no_past_prefill, cuda_graphs=cuda_graphs)
    res = serve(requests, stepper, kv, policy.kv_tier, model, sched_cfg=sched_cfg, warmup=warmup)
    res.gpu_mem_bytes = gpu_memory_bytes(model, kv_hbm_peak=res.kv_hbm_peak_bytes,
                                         staging_peak=res.staging_peak_bytes,
                                         activation_peak=res.activation_peak_bytes,
                                         runtime_overhead=int(mem.runtime_overhead_bytes))
    return res
