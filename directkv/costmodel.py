"""Roofline cost model: time of an op from its bytes per tier and FLOPs on a HardwareSpec.

time = max(link reads / link read bw, link writes / link write bw, HBM bytes / HBM bw, FLOPs / peak) + launch.
The bandwidths are the achievable ceilings of the spec; `Efficiency` scales them per op class and is what
a calibration against measured results fits (`Efficiency.fit`-style updates land in CALIBRATION).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from directkv.errors import unknown_name
from directkv.host_time import BASE, HostTime, for_system
from directkv.kernels.traffic import Traffic
from directkv.specs import HardwareSpec


@dataclass(frozen=True)
class Efficiency:
    link_sm: float = 1.0  # zero-copy kernels vs the SM read ceiling (DirectKV kernels aim for >= 0.98)
    link_ce: float = 1.0  # copy-engine transfers vs cudaMemcpy bandwidth
    hbm: float = 0.9  # streaming kernels vs the HBM ceiling
    matmul: float = 0.7  # projections / MLP vs bf16 peak
    attention: float = 0.45  # attention FLOPs vs bf16 peak: our tiled kernels (fitted from tiled, K/V in HBM)
    # torch SDPA's FlashAttention passes, which directkv stream's prompt chunks run over its ring: on the H200 they
    # ran at ~1.55x the tiled kernel's rate (fitted 0.39 vs 0.25: kernel_ablation, sdpa_hbm vs tiled:kv_hbm), and
    # charging stream's chunks the tiled rate simulated the step of an 8K chunk over an 8K past at OPT-13B at 1.29x
    # its measured time (1.08x with this factor; H200, 2026-12-02, step 1 of results/h200/context_sweep/20261202-031313:
    # 716 ms measured, 921 / 771 simulated)
    flash_attention: float = 0.45
    cpu_mem: float = 0.8  # CPU attention vs CPU DRAM bandwidth
    # CPU attention's work per query head and cached token (ns, all threads together), where it bounds the
    # kernel rather than DRAM: with GQA each K/V byte serves several query heads (measured on the H200 host:
    # the same kernel read Llama-3.1-8B's 4-head groups at 23-29 GB/s, OPT-13B's single heads at 60-74).
    # 0 (not modelled) unless fitted from cpu_attention runs of two group sizes.
    cpu_ns_per_head_token: float = 0.0
    dequant_hbm: float = 0.5  # unfused dequantisation kernels (FlexGen-like) vs the HBM ceiling
    # Least time of one layer's dense part (norms, projections, RoPE, MLP: a chain of ~10 kernels) in a small
    # step, where the roofline's weight read is ~0.1 ms but kernel latency and small-GEMM efficiency rule. Not
    # an efficiency: microseconds, 0 (not modelled) unless fitted to a measured serving run.
    dense_us_per_layer: float = 0.0
    # Fixed time per layer a system adds to a small step beyond hbm's, where the roofline sees almost no
    # work: FlexGen's chain of unfused quantise / dequantise kernels (fitted to a rate sweep); cpu_attn's handoffs
    # per part of a step (Q to the host, the CPU worker's wake-up, O back to the GPU; fitted to a step series,
    # systems.cpu_attn_layer). Microseconds, 0 (not modelled) unless fitted.
    flexgen_us_per_layer: float = 0.0
    cpu_attn_us_per_layer: float = 0.0
    # cpu_attn's CPU time per decode per layer beyond its K/V reads (the kernel's per-sequence work, the worker's
    # per-row share of Q / O): microseconds, 0 (not modelled) unless fitted to a step series
    cpu_attn_us_per_decode: float = 0.0


# Per-hardware fitted factors, loaded on first use from directkv/specs/calibration/*.json (written by
# `python -m directkv.calibration RUN_DIR [RUN_DIR ...] [--hardware NAME] --write`); hardware without a file
# uses the priors above.
CALIBRATION: dict[str, Efficiency] = {}
# Per-hardware host time per step of each system (directkv/host_time.py), from the same files' "host_time" section
HOST_CALIBRATION: dict[str, dict[str, HostTime]] = {}
# the Efficiency factors FLOPs can be charged at (CostModel.terms' flops_kind)
FLOPS_KINDS = ("matmul", "attention", "flash_attention")


@dataclass(frozen=True)
class CostModel:
    hw: HardwareSpec
    eff: Efficiency = Efficiency()
    # the measured executor's host time per step, by system label (host_time.py); empty: not modelled
    host: Mapping[str, HostTime] = field(default_factory=dict, hash=False)  # compared: it changes what is simulated

    @classmethod
    def for_hardware(cls, hw: HardwareSpec, **overrides: float) -> CostModel:
        """The cost model of `hw` with its fitted factors and host times (directkv/specs/calibration/), else the
        priors and no host time."""
        eff = replace(calibration_for(hw.name), **overrides)
        return cls(hw, eff, dict(HOST_CALIBRATION.get(hw.name, {})))

    def host_for(self, label: str) -> HostTime:
        """The host time per step of the system `label` (SystemPolicy.label): its own fit, else hbm's, else none."""
        return for_system(self.host, label)

    @cached_property
    def runner_eager_s(self) -> float:
        """Seconds the host takes to issue one layer's kernels eagerly: hbm's fit, as every system shares the
        runner (0 where none is fitted). Looked up once per cost model, not per simulated step."""
        return (self.host_for(BASE).eager_us_per_layer or 0.0) * 1e-6


    def terms(self, t: Traffic, *, flops_kind: str = "attention", link: str = "sm", hbm_eff: float | None = None
              ) -> dict[str, float]:
        """Seconds each resource alone would need; `link` is "sm" (zero-copy loads) or "ce" (copy engine);
        flops_kind: the Efficiency factor the FLOPs run at, one of FLOPS_KINDS."""
        hw, e = self.hw, self.eff
        if link == "sm":
            rd, wr, le = hw.link_sm_read_gbps, hw.link_sm_write_gbps, e.link_sm
        else:
            rd, wr, le = hw.link_ce_h2d_gbps, hw.link_ce_d2h_gbps, e.link_ce
        if flops_kind not in FLOPS_KINDS:
            raise unknown_name("flops_kind", flops_kind, FLOPS_KINDS)
        fe = getattr(e, flops_kind)
        return {
            "link_read": t.link_read_bytes / (rd * 1e9 * le),
            "link_write": t.link_write_bytes / (wr * 1e9 * le),
            "hbm": (t.hbm_read_bytes + t.hbm_write_bytes) / (hw.hbm_bw_gbps * 1e9 * (hbm_eff or e.hbm)),
            "compute": t.flops / (hw.bf16_tflops * 1e12 * fe),
        }

    def time(self, t: Traffic, **kw) -> float:
        """Roofline time in seconds of one kernel (or a fused group of kernels) with this traffic."""
        return max(self.terms(t, **kw).values()) + self.hw.launch_us * 1e-6

    def bound(self, t: Traffic, **kw) -> str:
        terms = self.terms(t, **kw)
        return max(terms, key=terms.get)

    def copy_time(self, nbytes: float, direction: str = "h2d", *, launch: bool = True) -> float:
        """Copy-engine transfer of `nbytes` between pinned host memory and HBM; with its launch unless `launch`
        is False (a copy queued behind others, whose launch the host paid earlier)."""
        bw = self.hw.link_ce_h2d_gbps if direction == "h2d" else self.hw.link_ce_d2h_gbps
        return (nbytes / (bw * 1e9 * self.eff.link_ce) + launch * self.hw.launch_us * 1e-6) if nbytes else 0.0

    def dense_time(self, t: Traffic) -> float:
        """One layer's dense part (projections, MLP) with traffic `t`: its roofline time, but never below the
        fitted floor (Efficiency.dense_us_per_layer)."""
        return max(self.time(t, flops_kind="matmul"), self.eff.dense_us_per_layer * 1e-6)

    def layer_overhead(self, system: str) -> float:
        """Seconds of fixed work per layer `system` ("flexgen" or "cpu_attn") adds to a step (Efficiency)."""
        return getattr(self.eff, f"{system}_us_per_layer") * 1e-6

    def cpu_attention_time(self, kv_bytes: float, head_tokens: float = 0.0) -> float:
        """Decode attention on the host CPU (Neo-like): reading `kv_bytes` from DRAM or its work over
        `head_tokens` (query heads x cached tokens, Efficiency.cpu_ns_per_head_token), whichever is longer."""
        memory = kv_bytes / (self.hw.cpu_mem_bw_gbps * 1e9 * self.eff.cpu_mem) if kv_bytes else 0.0
        return max(memory, head_tokens * self.eff.cpu_ns_per_head_token * 1e-9)


def mode_for(hw: HardwareSpec) -> str:
    """Result label of a simulation on `hw` (DESIGN.md: C2C numbers are projections)."""
    return "simulated" if hw.measured_here else "projected"


def calibration_for(hardware: str) -> Efficiency:
    if not CALIBRATION:
        from directkv.calibration import load_all

        load_all()
    return CALIBRATION.get(hardware, Efficiency())
