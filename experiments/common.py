"""What every experiment needs from the config: specs, budgets, system policies, device, progress, rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from directkv.costmodel import CostModel, mode_for
from directkv.device import resolve_device
from directkv.engine.scheduler import SchedulerConfig
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import (
    CPU_ATTN_KERNELS,
    DEFAULT_CPU_ATTN_KERNEL,
    DEFAULT_NO_PAST_PREFILL,
    NO_PIPELINING,
    Pipelining,
    SystemPolicy,
    check_hbm_prefill,
    check_no_past_prefill,
)
from directkv.errors import ConfigError, check, unknown_name
from directkv.kernels.cuda.prefill_attention import NEW_PASSES
from directkv.kernels.traffic_model import (
    SERVING_STREAM_CHUNK_MIB,
    SERVING_STREAM_SLOTS,
    STREAM_SLOTS_AUTO,
    check_stream_chunk_mib,
    resolve_stream_slots,
)
from directkv.specs import HardwareSpec, ModelSpec, get_hardware, get_model


@dataclass(frozen=True)
class Setup:
    model: ModelSpec
    hw: HardwareSpec
    cm: CostModel
    mem: MemoryConfig
    sched: SchedulerConfig
    device: str  # "cpu" (simulate) or "cuda" (measure)
    sim_mode: str  # label of simulated rows on this hardware: simulated | projected
    cuda_graphs: bool = False  # measured serving: the runner's dense layer parts replayed as CUDA graphs
    cpu_attn_kernel: str = DEFAULT_CPU_ATTN_KERNEL  # measured cpu_attn: one native OpenMP call, or torch's flash loop
    pipelining: Pipelining = NO_PIPELINING  # directkv: steps as two parts, one part's attention on a side stream (simulated too)
    prefill_new_pass: str = "kernel"  # measured serving: a prompt chunk's new tokens by the tiled kernel or by flash
    stream_slots: int = SERVING_STREAM_SLOTS  # directkv stream, measured and simulated: its rings' HBM in 32 MiB slots (auto resolved)
    warmup_pass: bool = True  # measured serving: each system's first point of a process served once, unmeasured, first
    hbm_prefill: str = "kernel"  # measured and simulated: a prompt chunk over HBM pages by our tiled kernel or by SDPA
    stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB  # directkv stream: the K per slot its decode ring cuts its HBM into
    no_past_prefill: str = DEFAULT_NO_PAST_PREFILL  # measured and simulated: directkv's prompt chunks with no past by its kernel or SDPA
    sim_graphs: bool = True  # executor.cuda_graphs as the simulation models it (the host time per step), also on a CPU


def budgets(cfg: DictConfig, hw: HardwareSpec) -> tuple[float, float]:
    """(HBM budget, host budget) in bytes, validated against the hardware."""
    hbm_gb = cfg.hardware.get("hbm_budget_gb")
    host_gb = cfg.hardware.get("host_budget_gb")
    hbm_gb = hw.hbm_gb if hbm_gb is None else as_float(hbm_gb, "hardware.hbm_budget_gb")
    host_gb = 0.9 * hw.host_mem_gb if host_gb is None else as_float(host_gb, "hardware.host_budget_gb")
    check(0 < hbm_gb <= hw.hbm_gb, f"hardware.hbm_budget_gb must be in (0, {hw.hbm_gb}] for {hw.name}, got {hbm_gb}")
    check(0 <= host_gb <= hw.host_mem_gb,
          f"hardware.host_budget_gb must be in [0, {hw.host_mem_gb}] for {hw.name}, got {host_gb}")
    return hbm_gb * 1e9, host_gb * 1e9


def setup(cfg: DictConfig, *, hardware: str | None = None) -> Setup:
    model = get_model(cfg.model.name)
    hw = get_hardware(hardware or cfg.hardware.name)
    hbm, host = budgets(cfg, hw) if hardware is None else (hw.hbm_bytes, 0.9 * hw.host_mem_gb * 1e9)
    overhead = as_float(cfg.memory.runtime_overhead_gb, "memory.runtime_overhead_gb")
    check(overhead >= 0, f"memory.runtime_overhead_gb must be >= 0, got {overhead}")
    page = as_int(cfg.memory.page_size, "memory.page_size")
    check(page >= 1 and page & (page - 1) == 0, f"memory.page_size must be a power of two, got {page}")
    mem = MemoryConfig(hbm, host, overhead * 1e9, page)
    sched = SchedulerConfig(as_int(cfg.scheduler.max_num_seqs, "scheduler.max_num_seqs"),
                            as_int(cfg.scheduler.max_batched_tokens, "scheduler.max_batched_tokens"))
    executor = cfg.get("executor", {})
    graphs = executor.get("cuda_graphs", False)
    check(isinstance(graphs, bool), f"executor.cuda_graphs must be true or false; got {graphs!r}")
    device = resolve_device(cfg.device)
    cpu_kernel = str(executor.get("cpu_attn_kernel", DEFAULT_CPU_ATTN_KERNEL))
    if cpu_kernel not in CPU_ATTN_KERNELS:
        raise unknown_name("executor.cpu_attn_kernel", cpu_kernel, CPU_ATTN_KERNELS)
    new_pass = str(executor.get("prefill_new_pass", "kernel"))
    if new_pass not in NEW_PASSES:
        raise unknown_name("executor.prefill_new_pass", new_pass, NEW_PASSES)
    slots = resolve_stream_slots(executor.get("directkv_stream_slots", STREAM_SLOTS_AUTO),
                                 model.kv_bytes_per_token_per_layer(), "executor.directkv_stream_slots")
    chunk_mib = check_stream_chunk_mib(executor.get("directkv_stream_chunk_mib", SERVING_STREAM_CHUNK_MIB), slots,
                                       "executor.directkv_stream_chunk_mib")
    hbm_prefill = check_hbm_prefill(executor.get("hbm_prefill", "kernel"))
    no_past_prefill = check_no_past_prefill(executor.get("directkv_no_past_prefill", DEFAULT_NO_PAST_PREFILL))
    warm = executor.get("warmup_pass", True)
    check(isinstance(warm, bool), f"executor.warmup_pass must be true or false; got {warm!r}")
    pipelining = Pipelining.from_config(executor)
    pipelining.check_system(SystemPolicy("directkv", directkv_variant(cfg)))
    # graphs run in the measured executor only; the simulation models their setting as the host time of the steps
    # they leave eager (sim_graphs; host_time.py). directkv's pipelining is simulated too (systems.pipelined_step_cost)
    return Setup(model, hw, CostModel.for_hardware(hw), mem, sched, device, mode_for(hw), graphs and device == "cuda",
                 cpu_kernel, pipelining, new_pass, slots, warm, hbm_prefill, chunk_mib, no_past_prefill, graphs)


def policies(cfg: DictConfig) -> list[SystemPolicy]:
    names = list(cfg.system.names)
    check(len(names) > 0, "system.names is empty; valid: directkv, hbm, swap, cpu_attn, flexgen")
    # a point is keyed by its system, so a second entry would be skipped as already done, silently
    twice = sorted({str(n) for n in names if names.count(n) > 1})
    check(not twice, f"system.names lists {', '.join(twice)} more than once; each system runs once per point")
    variant = directkv_variant(cfg)
    return [SystemPolicy(n, variant if n == "directkv" else "") for n in names]


def directkv_variant(cfg: DictConfig) -> str:
    return str(cfg.system.get("directkv_variant", "tiled"))


def as_float(value, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number, got {value!r}") from None


def as_int(value, what: str) -> int:
    if isinstance(value, bool):  # int(True) is 1: a `true` where a count belongs is a mistake, not a 1
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be an integer, got {value!r}") from None


def int_list(values, what: str, *, allow_empty: bool = False) -> list[int]:
    """A list override as ints; one value (`contexts=4096`) is a list of one; an empty list is refused unless
    allow_empty."""
    if isinstance(values, (int, float, str)):
        values = [values]
    out = [as_int(v, what) for v in values]
    check(allow_empty or len(out) > 0, f"give at least one {what}; got an empty list")
    return out


def check_context(model: ModelSpec, context: int) -> None:
    context = as_int(context, "context length")
    check(context >= 1, f"context length must be >= 1, got {context}")
    check(int(context) <= model.max_context,
          f"context length {context} exceeds {model.name}'s limit of {model.max_context} tokens")


def check_rate(rate: float) -> None:
    check(isinstance(rate, (int, float)) and rate > 0 and not math.isnan(rate), f"rate must be > 0 req/s, got {rate}")


def progress(cfg: DictConfig, items: list, desc: str):
    """tqdm over the sweep's points, unless progress=false (checked here, before the first point)."""
    show = cfg.get("progress", True)
    check(isinstance(show, bool), f"progress must be true or false; got {show!r}")
    check(len(items) > 0, f"{desc} has no points to run: a list override (contexts, ops, rates, datasets, sizes, "
          f"variants, ...) is empty")
    return tqdm(items, desc=desc, disable=not show, unit="pt", dynamic_ncols=True)


def base_row(cfg: DictConfig, s: Setup, *, system: str, variant: str = "", mode: str | None = None,
             hardware: str | None = None) -> dict:
    return {"exp": cfg.exp_name, "system": system, "variant": variant, "model": s.model.name,
            "hardware": hardware or s.hw.name, "mode": mode or s.sim_mode, "status": "ok"}


def plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
