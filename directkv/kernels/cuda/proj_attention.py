"""CUDA K/V projection (+ RoPE) and attention of one sequence (csrc/include/directkv/proj_attention.cuh).

Variants (the reference backend's, directkv/kernels/reference/proj_attention.py)
--------
separate : cuBLAS projects Q, K and V; K (after RoPE) and V are stored to their cache pages; the tiled prefill
           kernel then reads the past and the new K/V back from the pages. The new K/V cross the link twice
           (written, then read back).
fused    : cuBLAS projects Q only (the stationary-K/V loop needs every Q tile in HBM); the tiled schedule's
           CTAs project each new K/V chunk from x inside the attention kernel when they reach it, store it to
           its pages once and attend to it from shared memory. The new K/V cross the link once, as writes.

Both run the tiled schedule (plan_tiled; the fused kernel's chunks are smaller, as its shared memory also
holds the weight stages) and round Q, K and V to the cache dtype before use. Q, and separate's K, are
projected by cuBLAS in the input dtype and rotated in fp32 (one more rounding than the reference's fp32
product); the fused kernel accumulates K / V in fp32 and rotates before its one rounding.
"""

from __future__ import annotations

import math

import torch

from directkv.errors import check, unknown_name
from directkv.kernels.cuda import build
from directkv.kernels.cuda.prefill_attention import (
    DTYPE_CODES,
    HEAD_DIMS,
    HOST_LOADS,
    SMEM_PAD,
    TILE_KV,
    TILE_Q,
    TiledPlan,
    check_host_pools,
    device_limits,
    plan_tiled,
)
from directkv.kernels.cuda.zero_copy import device_view
from directkv.kernels.paged import PagedKV, per_table
from directkv.kernels.reference.rope import rope_angles
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import proj_attention_traffic

VARIANTS = ("separate", "fused")
HIDDEN_STEP = 64  # rows of Wk / Wv per shared-memory stage of the fused kernel (kHiddenStep)
STAGES = 2  # weight stages of the fused kernel
_SLOTS_MEMO: dict = {}  # per_table's memo of _Slots: where the new tokens go


class _Slots:
    """The new tokens' cache slots split by tier (GPU index tensors) and the token counts the closed form needs.
    The entries are checked first: the kernels write the new tokens' slots through raw pointers, so an entry
    out of its pool or a page listed twice would write outside the cache or over another token."""

    def __init__(self, kv: PagedKV, past_len: int, q_len: int, device: torch.device):
        total, page_size = past_len + q_len, kv.page_size
        entries = kv.block_table[0, : -(-total // page_size)].cpu().to(torch.int64)
        host_pages, hbm_pages = int(kv.host_k.shape[0]), int(kv.hbm_k.shape[0])
        bad = entries[(entries >= host_pages) | (-(entries + 1) >= hbm_pages)]
        check(not len(bad), f"block-table entries {bad[:4].tolist()} are outside the pools ({host_pages} host pages: "
              f"entries 0..{host_pages - 1}; {hbm_pages} HBM pages: entries -1..{-hbm_pages})")
        check(len(entries.unique()) == len(entries), f"the block table lists a page twice among its first "
              f"{len(entries)} entries (the pages of past_len + q_len = {total} tokens)")
        pos = torch.arange(total)
        e = entries[pos // page_size]
        hbm = e < 0
        self.past_hbm_tokens = int(hbm[:past_len].sum())
        self.new_hbm_tokens = int(hbm[past_len:].sum())
        new, slot = pos[past_len:], pos[past_len:] % page_size
        e_new, hbm_new = e[past_len:], hbm[past_len:]
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        rows = new - past_len
        self.host = tuple(to(t[~hbm_new]) for t in (rows, e_new, slot))
        self.hbm = tuple(to(t[hbm_new]) for t in (rows, -(e_new + 1), slot))


def _slots(kv: PagedKV, past_len: int, q_len: int, device: torch.device) -> _Slots:
    key = (past_len, q_len, kv.page_size, kv.host_k.shape[0], kv.hbm_k.shape[0], str(device))
    return per_table(_SLOTS_MEMO, kv.block_table, key, lambda: _Slots(kv, past_len, q_len, device))


def stage_bytes(head_dim: int, dtype_bytes: int) -> int:
    """Shared memory of the fused kernel's weight stages: STAGES x (Wk, Wv) x [HIDDEN_STEP][head_dim + pad]."""
    return STAGES * 2 * HIDDEN_STEP * (head_dim + SMEM_PAD) * dtype_bytes


def rope_tables(past_len: int, q_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[q_len, head_dim / 2]` float32 at positions past_len.. (the reference's float64 angles)."""
    angles = rope_angles(past_len, q_len, head_dim, theta, device)
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()


def _rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of fp32 y `[tokens, heads, head_dim]` with `[tokens, head_dim / 2]` tables."""
    half = y.shape[-1] // 2
    y1, y2 = y[..., :half], y[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1)


def project(x: torch.Tensor, w: torch.Tensor, head_dim: int, rot) -> torch.Tensor:
    """x @ w as `[q_len, heads, head_dim]` in x's dtype, rotated in fp32 when rot = (cos, sin) is given."""
    y = (x @ w).view(x.shape[0], -1, head_dim)
    return y if rot is None else _rotate(y.float(), *rot).to(x.dtype)


def _check_inputs(x, wq, wk, wv, kv: PagedKV, variant: str, tile_q: int, tile_kv: int, host_load: str,
                  rope_theta, out) -> tuple[int, int]:
    """Validate; returns (num_heads, past_len)."""
    if variant not in VARIANTS:
        raise unknown_name("proj_attention variant", variant, VARIANTS)
    if host_load not in HOST_LOADS:
        raise unknown_name("proj_attention host_load", host_load, HOST_LOADS)
    check(tile_q == TILE_Q, f"tile_q {tile_q!r} is not supported by the CUDA kernel; valid: {TILE_Q}")
    check(tile_kv == TILE_KV, f"tile_kv {tile_kv!r} is not supported by the CUDA kernel; valid: {TILE_KV}")
    check(x.dim() == 2 and x.shape[0] >= 1, f"x must be [q_len >= 1, hidden]; got shape {tuple(x.shape)}")
    check(x.dtype in DTYPE_CODES, f"dtype {x.dtype} is not supported; valid: float16, bfloat16")
    q_len, hidden = x.shape
    head_dim = kv.head_dim
    check(head_dim in HEAD_DIMS, f"head_dim {head_dim} is not supported; valid: {HEAD_DIMS}")
    check(variant != "fused" or hidden % HIDDEN_STEP == 0,
          f"hidden {hidden} must be a multiple of {HIDDEN_STEP} for the fused kernel (its weight stages)")
    check(wq.dim() == 2 and wq.shape[0] == hidden and wq.shape[1] % head_dim == 0 and wq.shape[1] > 0,
          f"wq must be [hidden={hidden}, num_heads * head_dim={head_dim}k]; got shape {tuple(wq.shape)}")
    num_heads = wq.shape[1] // head_dim
    check(num_heads % kv.num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {kv.num_kv_heads}")
    for name, w in (("wk", wk), ("wv", wv)):
        want = (hidden, kv.num_kv_heads * head_dim)
        check(tuple(w.shape) == want, f"{name} must be [hidden, num_kv_heads * head_dim] = {want}; got {tuple(w.shape)}")
    check(x.device.type == "cuda", f"x must be a CUDA tensor; got {x.device}")
    for name, t in (("x", x), ("wq", wq), ("wk", wk), ("wv", wv), ("hbm_k", kv.hbm_k), ("hbm_v", kv.hbm_v)):
        check(t.device == x.device, f"{name} is on {t.device}; x is on {x.device}: every tensor must be on x's device")
        check(t.is_contiguous(), f"{name} must be contiguous; got strides {t.stride()} for shape {tuple(t.shape)}")
        check(t.dtype == x.dtype, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
    check_host_pools(kv, x.dtype, x.device)
    check(rope_theta is None or rope_theta > 0, f"rope_theta must be None or > 0; got {rope_theta}")
    check(kv.batch == 1, f"proj_attention takes one sequence; kv.batch is {kv.batch}")
    past_len = int(kv.seq_lens[0])
    pages = -(-(past_len + q_len) // kv.page_size)
    check(past_len >= 0 and pages <= kv.block_table.shape[1], f"past_len {past_len} + q_len {q_len} tokens need "
          f"{pages} pages; the block table has {kv.block_table.shape[1]}")
    if out is not None:
        want = (q_len, num_heads, head_dim)
        check(tuple(out.shape) == want and out.dtype == x.dtype and out.device == x.device and out.is_contiguous(),
              f"out must be a contiguous {x.dtype} tensor of shape {want} on {x.device}")
    return num_heads, past_len


def plan(x: torch.Tensor, num_heads: int, kv: PagedKV, past_len: int, variant: str, *, kv_chunk=None,
         num_splits=None) -> TiledPlan:
    """plan_tiled for past_len + q_len keys; the fused kernel's chunks fit beside its weight stages."""
    q_len, _ = x.shape
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sms, smem = device_limits(device)
    extra = stage_bytes(kv.head_dim, x.element_size()) if variant == "fused" else 0
    return plan_tiled(past_len + q_len, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                      dtype_bytes=x.element_size(), part_bytes_per_split=q_len * num_heads * (kv.head_dim + 2) * 4,
                      sms=sms, smem_optin=smem, kv_chunk=kv_chunk, num_splits=num_splits, extra_smem=extra)


def proj_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    kv: PagedKV,
    *,
    variant: str,
    rope_theta: float | None = None,
    causal: bool = True,
    tile_q: int = TILE_Q,
    tile_kv: int = TILE_KV,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    kv_chunk: int | None = None,
    num_splits: int | None = None,
    host_load: str = "ca",
) -> tuple[torch.Tensor, Traffic]:
    """Project x to Q, K, V, store the new K/V in their cache pages in place, and attend (module docstring).

    Parameters
    ----------
    x : `[q_len, hidden]` CUDA tensor, fp16 or bf16 (hidden a multiple of 64 for "fused").
    wq : `[hidden, num_heads * head_dim]`; wk, wv : `[hidden, num_kv_heads * head_dim]`; CUDA, x's dtype.
    kv : one-sequence paged cache holding past_len = kv.seq_lens[0] tokens, whose block table already reserves
        pages for past_len + q_len tokens; host pools as zero-copy views of pinned memory (or pinned CPU
        tensors), HBM pools on the GPU, head_dim 64 or 128. Positions past_len.. are overwritten with the new
        K (after RoPE) and V; seq_lens is not changed (the KV manager owns lengths).
    variant : "separate" or "fused".
    rope_theta : RoPE base applied to q and k at positions past_len + i; None for no RoPE.
    causal, sm_scale, out : as in prefill_attention; tile_q and tile_kv must be 64.
    kv_chunk, num_splits : force the tiled schedule's stationary chunk and CTAs per KV head (see plan_tiled).
    host_load : "ca" (default) or "cg": how the past K/V pages are copied (prefill_attention's docstring).

    Returns
    -------
    (out `[q_len, num_heads, head_dim]`, Traffic: proj_attention_traffic at tile_kv = the planned kv_chunk.
    Link bytes are exact. HBM bytes are the reference schedule's, a lower bound on the fused kernel's: each
    KV head's CTAs read x again and, in each chunk holding new rows, stream their Wk / Wv slices once per round
    (one 16-row block per warp), from L2 while x and the slices fit in it (x is 4 MB at q_len 512 x hidden
    4096), from HBM beyond.)
    """
    num_heads, past_len = _check_inputs(x, wq, wk, wv, kv, variant, tile_q, tile_kv, host_load, rope_theta, out)
    q_len, hidden = x.shape
    head_dim = kv.head_dim
    tiled = plan(x, num_heads, kv, past_len, variant, kv_chunk=kv_chunk, num_splits=num_splits)
    slots = _slots(kv, past_len, q_len, x.device)  # checks the block table before any work
    rot = None if rope_theta is None else rope_tables(past_len, q_len, head_dim, float(rope_theta), x.device)
    q = project(x, wq, head_dim, rot).contiguous()
    with torch.cuda.device(x.device):  # a view of pinned CPU pools is made on the current device
        host_k, host_v = (t if t.device.type == "cuda" else device_view(t) for t in (kv.host_k, kv.host_v))
    if variant == "separate":
        k, v = project(x, wk, head_dim, rot), project(x, wv, head_dim, None)
        for (rows, pages, idx), (pk, pv) in ((slots.host, (host_k, host_v)), (slots.hbm, (kv.hbm_k, kv.hbm_v))):
            pk[pages, idx] = k[rows]
            pv[pages, idx] = v[rows]
    out = torch.empty_like(q) if out is None else out
    table = kv.block_table[0]
    if table.device != x.device or table.dtype != torch.int32:
        table = table.to(device=x.device, dtype=torch.int32)
    part_o = torch.empty(tiled.num_splits, q_len, num_heads, head_dim, dtype=torch.float32, device=x.device)
    part_ml = torch.empty(tiled.num_splits, q_len, num_heads, 2, dtype=torch.float32, device=x.device)
    fused = variant == "fused"
    ptr = lambda t: t.data_ptr() if fused and t is not None else 0  # noqa: E731
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    with torch.cuda.device(x.device):  # the launcher sizes and launches on the current device
        build.load("proj_attention").run(
            q.data_ptr(), ptr(x), ptr(wk), ptr(wv), ptr(rot[0] if rot else None), ptr(rot[1] if rot else None),
            host_k.data_ptr(), host_v.data_ptr(), kv.hbm_k.data_ptr(), kv.hbm_v.data_ptr(), table.contiguous().data_ptr(),
            out.data_ptr(), part_o.data_ptr(), part_ml.data_ptr(), q_len, past_len, hidden, num_heads, kv.num_kv_heads,
            head_dim, kv.page_size, bool(causal), VARIANTS.index(variant), tiled.kv_chunk, tiled.num_splits, tiled.threads,
            scale, DTYPE_CODES[x.dtype], HOST_LOADS.index(host_load), torch.cuda.current_stream(x.device).cuda_stream,
        )  # fmt: skip
    t = proj_attention_traffic(q_len, past_len, hidden=hidden, num_heads=num_heads, num_kv_heads=kv.num_kv_heads,
                               head_dim=head_dim, dtype_bytes=x.element_size(), variant=variant, causal=bool(causal),
                               tile_q=TILE_Q, tile_kv=tiled.kv_chunk, past_hbm_tokens=slots.past_hbm_tokens,
                               new_hbm_tokens=slots.new_hbm_tokens)
    return out, t
