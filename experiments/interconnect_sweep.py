"""Fig. 14: the same attention kernels over PCIe Gen5 (H200) and NVLink-C2C (GH200), from the cost model.

Rows on the H200 spec are `simulated` (its ceilings were measured here); GH200 rows are `projected`.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from omegaconf import DictConfig

from directkv.costmodel import CostModel
from directkv.errors import check
from directkv.results import ResultsWriter
from directkv.specs import get_hardware
from experiments.common import as_int, base_row, check_context, int_list, progress, setup
from experiments.kernel_ablation import variant_traffic

OPS = ("decode", "prefill")


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    # the same kernels on every link: one set of efficiency factors (the first hardware's, fitted where it
    # was measured), so only the ceilings of the specs differ between the rows
    first = setup(cfg, hardware=cfg.hardwares[0])
    setups = {hw: replace(setup(cfg, hardware=hw), cm=CostModel(get_hardware(hw), first.cm.eff))
              for hw in cfg.hardwares}
    writer.manifest["cost_model"] = {"efficiency": asdict(first.cm.eff), "from_hardware": cfg.hardwares[0]}
    for op in cfg.ops:
        check(op in OPS, f"unknown op {op!r}; valid: {', '.join(OPS)}")
    contexts = int_list(cfg.contexts, "context length")
    pts = [(hw, op, v, c) for hw in cfg.hardwares for op in cfg.ops for v in cfg.variants for c in contexts]
    for hw, op, v, ctx in progress(cfg, pts, "interconnect_sweep"):
        s = setups[hw]
        check_context(s.model, ctx)
        q_len, batch = (1, as_int(cfg.decode_batch, "decode_batch")) if op == "decode" else (as_int(cfg.prefill_q_len, "prefill_q_len"), 1)
        t = variant_traffic(op, v, s, ctx=ctx, q_len=q_len, batch=batch, dtype_bytes=s.model.dtype_bytes,
                            tile_q=as_int(cfg.tile_q, "tile_q"), tile_kv=as_int(cfg.tile_kv, "tile_kv"))
        ms = s.cm.time(t, link="sm") * 1e3
        writer.add(base_row(cfg, s, system="directkv", variant=v, hardware=hw) | {
            "op": op, "context_len": float(ctx), "q_len": q_len, "batch": batch, "time_ms": ms,
            "link_read_bytes": float(t.link_read_bytes), "link_write_bytes": float(t.link_write_bytes),
            "kv_bytes": float(batch * ctx * s.model.kv_bytes_per_token_per_layer()),
            "interconnect": s.hw.interconnect, "bound": s.cm.bound(t, link="sm")})
