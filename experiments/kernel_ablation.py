"""Fig. 12/13: naive vs tiled vs fused vs separate attention kernels over host-resident KV.

Simulated (no GPU): each variant's traffic from the kernels' closed forms (tested equal to what the
reference schedules count), timed by the cost model, beside the anchors the GPU run measures: HBM-resident
attention, copy-then-attend (swap), and the link floor. With a GPU (device=cuda) the CUDA kernels and the
anchors are measured side by side in one run (proj_attention: separate vs fused beside cuBLAS + SDPA in HBM
and copy-then-attend).
"""

from __future__ import annotations

from omegaconf import DictConfig

from directkv.engine.step_traffic import to_hbm
from directkv.errors import check
from directkv.kernels import traffic_model as tm
from directkv.kernels.traffic import Traffic
from directkv.results import ResultsWriter
from experiments.common import Setup, as_int, base_row, check_context, int_list, progress, setup

OPS = ("decode", "prefill", "proj_attention")
VARIANTS = {"decode": ("naive", "tiled"), "prefill": ("naive", "tiled"), "proj_attention": ("separate", "fused")}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2}


def _shape(s: Setup, dtype_bytes: int) -> dict:
    m = s.model
    return dict(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype_bytes=dtype_bytes)


def variant_traffic(op: str, variant: str, s: Setup, *, ctx: int, q_len: int, batch: int, dtype_bytes: int,
                    tile_q: int, tile_kv: int) -> Traffic:
    sh = _shape(s, dtype_bytes)
    if op == "decode":
        return tm.decode_traffic([ctx] * batch, variant=variant, **sh)
    if op == "prefill":
        return tm.prefill_traffic(q_len, ctx, variant=variant, causal=True, tile_q=tile_q, tile_kv=tile_kv, **sh)
    return tm.proj_attention_traffic(q_len, ctx, hidden=s.model.hidden_size, variant=variant, causal=True,
                                     tile_q=tile_q, tile_kv=tile_kv, **sh)


def points(cfg: DictConfig) -> list[tuple[str, int, int, int]]:
    """(op, context, q_len, batch) for every configured shape."""
    pts = []
    for op in cfg.ops:
        check(op in OPS, f"unknown op {op!r}; valid: {', '.join(OPS)}")
        contexts = cfg.contexts if op == "decode" or cfg.get("prefill_contexts") is None else cfg.prefill_contexts
        for ctx in int_list(contexts, "context length"):
            if op == "decode":
                pts += [(op, ctx, 1, b) for b in int_list(cfg.decode_batches, "decode batch")]
            else:
                q_lens = int_list(cfg.prefill_q_lens, "prefill q_len", allow_empty=op == "proj_attention") + ([1] if op == "proj_attention" else [])
                pts += [(op, ctx, q, 1) for q in q_lens]
    return pts


def simulated_rows(cfg: DictConfig, s: Setup, op: str, ctx: int, q_len: int, batch: int) -> list[dict]:
    db = DTYPE_BYTES[str(cfg.dtype)]
    kv_bytes = batch * ctx * s.model.kv_bytes_per_token_per_layer() * db // s.model.dtype_bytes
    floor_ms = kv_bytes / (s.hw.link_ce_h2d_gbps * 1e9) * 1e3
    shape = {"op": op, "context_len": float(ctx), "q_len": q_len, "batch": batch, "dtype": str(cfg.dtype),
             "kv_bytes": float(kv_bytes), "floor_ms": floor_ms}
    rows = []
    tiles = {t: as_int(cfg[t], t) for t in ("tile_q", "tile_kv")}
    for v in VARIANTS[op]:
        t = variant_traffic(op, v, s, ctx=ctx, q_len=q_len, batch=batch, dtype_bytes=db, **tiles)
        ms = s.cm.time(t, link="sm") * 1e3
        rows.append(base_row(cfg, s, system="directkv", variant=v) | shape | _traffic_cols(t) | {
            "time_ms": ms, "link_gbps": t.link_read_bytes / ms / 1e6, "bound": s.cm.bound(t, link="sm")})
    # anchors: the same schedule with KV in HBM, and copy-then-attend over the copy engine
    base_variant = "tiled" if op != "proj_attention" else "separate"
    t_hbm = to_hbm(variant_traffic(op, base_variant, s, ctx=ctx, q_len=q_len, batch=batch, dtype_bytes=db, **tiles))
    hbm_ms = s.cm.time(t_hbm) * 1e3
    rows.append(base_row(cfg, s, system="anchor", variant="sdpa_hbm") | shape | _traffic_cols(t_hbm) | {"time_ms": hbm_ms})
    swap_ms = s.cm.copy_time(kv_bytes) * 1e3 + hbm_ms
    rows.append(base_row(cfg, s, system="anchor", variant="swap_sdpa") | shape | {
        "time_ms": swap_ms, "link_read_bytes": float(kv_bytes), "link_write_bytes": 0.0})
    return rows


def _traffic_cols(t: Traffic) -> dict:
    return {k: float(v) for k, v in t.as_dict().items()}


def measured_rows(cfg: DictConfig, s: Setup, op: str, ctx: int, q_len: int, batch: int) -> list[dict]:
    from experiments import kernel_bench

    return kernel_bench.measure(cfg, s, op, ctx, q_len, batch)


def run(cfg: DictConfig, writer: ResultsWriter) -> None:
    s = setup(cfg)
    check(str(cfg.dtype) in DTYPE_BYTES, f"unknown dtype {cfg.dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    for _, ctx, _, _ in points(cfg):
        check_context(s.model, int(ctx))
    for op, ctx, q_len, batch in progress(cfg, points(cfg), "kernel_ablation"):
        if writer.done(op=op, context_len=float(ctx), q_len=q_len, batch=batch):
            continue
        measured = s.device == "cuda"
        rows = (measured_rows if measured else simulated_rows)(cfg, s, op, ctx, q_len, batch)
        for r in rows:
            writer.add(r)
