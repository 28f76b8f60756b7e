"""Measured path of the kernel experiments (device=cuda): the CUDA benchmark functions, labelled rows,
ceilings measured once per run, and Nsight Compute counters when `counters=ncu`."""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.errors import check
from experiments.common import Setup, base_row

COUNTERS = ("none", "ncu")
COUNTED_EXPS = ("kernel_ablation", "gemm_case_study")  # the experiments whose measured rows ncu profiles
NCU_VARIANTS = ("naive", "tiled", "pipelined", "ring", "raster", "tiled:cg", "tiled:ca", "pipelined:ca",
                "pipelined:splits", "sdpa_zero_copy", "cublas_zero_copy")  # tiled:cg: prefill's row
KERNEL_NAMES = ("naive", "tiled", "pipelined", "ring", "raster", "stream", "fused", "separate")  # else an anchor row
_ceilings: dict | None = None


def ceilings() -> dict:
    """SM zero-copy read, copy-engine and HBM ceilings, measured once per process, in the same run."""
    global _ceilings
    if _ceilings is None:
        from directkv.kernels.cuda.probe import measure_ceilings

        _ceilings = measure_ceilings()
    return _ceilings


def _label(cfg: DictConfig, s: Setup, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        anchor = r["variant"].split(":")[0] not in KERNEL_NAMES
        base = base_row(cfg, s, system="anchor" if anchor else "directkv", variant=r["variant"], mode="measured")
        out.append(base | {k: v for k, v in r.items() if k not in ("mode",)} | {"mode": "measured"})
    return out


def check_counters(cfg: DictConfig) -> str:
    """cfg.counters if it is one of COUNTERS, else the one-line ConfigError; the experiments check it before their
    first point, simulated ones too (where ncu has nothing to count), so a typo is not silently dropped."""
    mode = str(cfg.get("counters", "none"))
    check(mode in COUNTERS, f"unknown counters {mode!r}; valid: {', '.join(COUNTERS)}")
    exp = cfg.get("exp_name")
    check(mode == "none" or exp is None or exp in COUNTED_EXPS, f"counters={mode} profiles kernels and applies to "
          f"{', '.join(COUNTED_EXPS)}, not {exp}")
    return mode


def _with_counters(cfg: DictConfig, rows: list[dict], args_of) -> list[dict]:
    """With counters=ncu, Nsight Compute's counters on each row of NCU_VARIANTS, and beside them those of one
    plain streaming read of the same host bytes (ncu_target's read_probe, profiled once per call of this): ncu's
    PCIe byte counter read 1.09x the K/V bytes for the tiled kernels' .ca loads and 1.75x for their .cg ones, whose
    schedules read each byte once (H200, 2026-11-29), as if it counted per-request overhead with the payload; the
    probe's own factor is what a kernel reading each byte once shows, so ncu_read_x_probe (a row's bytes per K/V
    byte over the probe's per byte read) is its re-read factor net of that counting."""
    if check_counters(cfg) != "ncu":
        return rows
    from directkv.counters import profile
    from experiments.ncu_target import host_bytes

    probe: dict | None = None
    for r in rows:
        if r["variant"] in NCU_VARIANTS and r["status"] == "ok":
            args = args_of(r)
            r.update(profile(args))
            if probe is None:  # every row of a call has one shape: args are (op, variant, --context N, ...)
                opts = dict(zip(args[2::2], args[3::2], strict=True))
                nbytes = host_bytes(args[0], int(opts["--context"]), int(opts.get("--batch", 1)))
                probe = {"ncu_probe_bytes": float(nbytes)} | {
                    k.replace("ncu_", "ncu_probe_", 1): v for k, v in profile([args[0], "read_probe", *args[2:]]).items()
                    if k in ("ncu_pcie_read_bytes", "ncu_error")}
            r.update(probe)
            read, kv, floor = (r.get("ncu_pcie_read_bytes"), r.get("kv_bytes"), probe.get("ncu_probe_pcie_read_bytes"))
            if read and kv and floor:
                r["ncu_read_x_probe"] = (read / kv) / (floor / probe["ncu_probe_bytes"])
    return rows


def measure(cfg: DictConfig, s: Setup, op: str, ctx: int, q_len: int, batch: int) -> list[dict]:
    import torch

    dtype = getattr(torch, str(cfg.dtype))
    m = s.model
    shape = dict(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=dtype)
    if op == "decode":
        from directkv.kernels.cuda.bench_decode import bench_decode

        rows = bench_decode([ctx], [batch], ceilings=ceilings(), **shape)
    elif op == "proj_attention":
        from directkv.kernels.cuda.bench_proj import bench_proj

        theta = m.rope_theta if m.family == "llama" else None
        rows = bench_proj(q_lens=(q_len,), past_len=ctx, hidden=m.hidden_size, rope_theta=theta,
                          ceilings=ceilings(), **shape)
    else:
        from directkv.kernels.cuda.bench_prefill import bench_prefill

        rows = bench_prefill(q_lens=(q_len,), past_len=ctx, ceilings=ceilings(), **shape)
    for r in rows:
        r.setdefault("q_len", q_len)
        r.setdefault("batch", batch)
        r["context_len"] = float(ctx)
    return _with_counters(cfg, _label(cfg, s, rows),
                          lambda r: [op, r["variant"], "--context", str(ctx), "--batch", str(batch),
                                     "--q-len", str(q_len)])


def measure_gemm(cfg: DictConfig, s: Setup, n: int) -> list[dict]:
    from directkv.kernels.cuda.bench_gemm import bench_gemm

    rows = bench_gemm(sizes=(n,), ceilings=ceilings())
    return _with_counters(cfg, _label(cfg, s, rows), lambda r: ["gemm", r["variant"], "--context", str(n)])
