"""Hardware as data: capacities, ceilings and where each number comes from.

Bandwidths are decimal GB/s (1e9 B/s) and achievable ceilings, not datasheet peaks, where a
measurement exists; `sources` says which numbers were measured on this project's H200 (DESIGN.md §2)
and which come from datasheets or other people's measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from directkv.errors import unknown_name


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    gpu: str
    interconnect: str  # "pcie5" or "nvlink-c2c"
    hbm_gb: float  # GPU memory capacity, 1e9 B
    hbm_bw_gbps: float  # streaming HBM bandwidth
    link_ce_h2d_gbps: float  # copy engine host->device (cudaMemcpy from pinned memory)
    link_ce_d2h_gbps: float  # copy engine device->host
    link_sm_read_gbps: float  # SM loads from pinned host memory (zero-copy)
    link_sm_write_gbps: float  # SM stores to pinned host memory
    bf16_tflops: float  # dense bf16 matmul rate
    num_sms: int
    l2_mb: float
    smem_per_sm_kb: int  # shared memory pool per SM usable by one CTA (KB)
    host_mem_gb: float  # CPU memory that can be pinned for KV
    cpu_cores: int
    cpu_mem_bw_gbps: float  # CPU DRAM bandwidth seen by CPU attention (Neo-like baseline)
    launch_us: float  # fixed cost of one kernel launch / copy call
    sources: str  # provenance of the numbers above
    # True when the link/HBM ceilings were measured on this project's own machine, so simulated rows
    # on it are "simulated"; on any other spec they are extrapolations and labelled "projected".
    measured_here: bool = False

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9


HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec(
            name="h200-pcie5",
            gpu="NVIDIA H200",
            interconnect="pcie5",
            hbm_gb=141.0,
            hbm_bw_gbps=4100.0,
            link_ce_h2d_gbps=55.4,
            link_ce_d2h_gbps=55.2,
            link_sm_read_gbps=51.4,
            link_sm_write_gbps=52.6,
            bf16_tflops=790.0,
            num_sms=132,
            l2_mb=60.0,
            smem_per_sm_kb=228,
            host_mem_gb=128.0,
            cpu_cores=16,
            cpu_mem_bw_gbps=80.0,
            launch_us=5.0,
            sources=(
                "measured on the lent H200 (PCIe Gen5 x16) 2026-11-29: HBM copy, cudaMemcpy H2D/D2H, SM zero-copy "
                "read/write, bf16 GEMM rate, SMs, L2; host memory and cores are the device VM's; "
                "CPU memory bandwidth is an estimate (not measured)"
            ),
            measured_here=True,
        ),
        HardwareSpec(
            name="h100-pcie5",
            gpu="NVIDIA H100 PCIe",
            interconnect="pcie5",
            hbm_gb=80.0,
            hbm_bw_gbps=2000.0,
            link_ce_h2d_gbps=55.4,
            link_ce_d2h_gbps=55.2,
            link_sm_read_gbps=51.4,
            link_sm_write_gbps=52.6,
            bf16_tflops=756.0,
            num_sms=114,
            l2_mb=50.0,
            smem_per_sm_kb=228,
            host_mem_gb=512.0,
            cpu_cores=64,
            cpu_mem_bw_gbps=200.0,
            launch_us=5.0,
            sources=(
                "HBM, TFLOP/s, SMs, L2 from the H100 PCIe datasheet; PCIe link ceilings assumed equal to those "
                "measured on the H200 PCIe Gen5 host; host side is a typical dual-socket server (estimate)"
            ),
        ),
        HardwareSpec(
            name="gh200-c2c",
            gpu="NVIDIA GH200 (96 GB HBM3)",
            interconnect="nvlink-c2c",
            hbm_gb=96.0,
            hbm_bw_gbps=4000.0,
            link_ce_h2d_gbps=375.0,
            link_ce_d2h_gbps=375.0,
            link_sm_read_gbps=371.0,
            link_sm_write_gbps=371.0,
            bf16_tflops=790.0,
            num_sms=132,
            l2_mb=50.0,
            smem_per_sm_kb=228,
            host_mem_gb=480.0,
            cpu_cores=72,
            cpu_mem_bw_gbps=500.0,
            launch_us=5.0,
            sources=(
                "NVLink-C2C 450 GB/s per direction peak, ~375 GB/s host-to-device as measured by others "
                "(published nvbandwidth figures), SM reads within ~1% of the copy engine; HBM3 96 GB at ~4 TB/s, "
                "Grace 72 cores and 480 GB LPDDR5X at ~500 GB/s from datasheets; no GH200 here, so every "
                "result on it is projected"
            ),
        ),
    )
}


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise unknown_name("hardware", name, HARDWARE) from None
