"""CUDA prefill attention of one sequence over a paged two-tier KV cache (csrc/include/directkv/prefill_attention.cuh).

Variants
--------
naive : FlashAttention order: a CTA owns 64 query rows (the G = num_heads / num_kv_heads heads of
        64 / G tokens) and streams all the K/V it can see, so past K/V cross the link once per CTA.
tiled : CPU-memory-aware: a chunk of `kv_chunk` K/V tokens of one KV head is loaded into shared memory
        once and meets every query row; per-split partial (O, max, sum) live in HBM and a merge kernel
        combines the splits. Past K/V cross the link once. Optionally (double_buffer) two half-size chunk
        buffers let the next chunk cross the link while the current one is computed; on the H200 this was
        not faster (2026-11-29: q_len 2048 over 16K host tokens, 6.3 ms vs 5.4 ms), so one buffer is the
        default.
stream : as decode_attention's stream: the copy engine moves the host pages a chunk at a time into a small
         HBM ring (2 slots x (K, V) x <= 16 MiB; a serving step's kept ring, prefill_ring, up to its
         stream_slots) on a side stream while the GPU attends the queries to the
         previous chunk; every pass (the new tokens alone, first, then each ring chunk and the HBM-resident pages)
         gives O (q's dtype from flash passes, fp32 from tiled ones) and its LSE, and the passes are merged with a
         softmax over the LSEs in one launch (merge_strided), folded as they come past a few (RunningMerge) so
         their outputs do not grow with the past. Past K/V cross the
         link once, by DMA instead of SM loads. Its schedule and ring are in prefill_stream.py. The ring and
         new-token passes run torch's FlashAttention-2 forward by default (pass_kernel="flash": an HBM
         attention core faster than ours; the G query heads of a KV head are folded into rows, exact since a
         past chunk is seen whole by every query) or this module's tiled kernel (pass_kernel="tiled").
         Its host-side schedule (chunks, ring positions, runs) is a PrefillStreamPlan, made once per block
         table by plan_prefill_stream: made per call it cost 3.5-6 ms of Python at 16K past tokens, which
         the GPU waited for (H200, 2026-11-29: q 2048 took 4.92 ms planned per call, 2.72 ms planned once).

The split plan (chunk size, buffers, CTAs per KV head) is host-side arithmetic on the SM count and shared
memory: see plan_tiled. stream plans each of its passes the same way.

host_load picks the cp.async form that copies the past K/V pages (all variants; for stream, the ring's
pages): "ca" goes through L1 (the default), "cg" caches in L2 only. Measured on the H200 (2026-11-29, one
run, 16K past tokens on host): ca vs cg 2.11 vs 3.16 ms at q_len 512, 4.00 vs 5.05 ms at 2048, 15.2 vs
16.4 ms at 8192; ncu PCIe reads at 2048: 73 MB (1.09x the K/V bytes) vs 117 MB (1.75x). The kernel never
writes the pages, so L1's lack of coherence within a launch cannot serve stale bytes; the new K/V and the partial state stay on "cg".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from directkv.errors import check, unknown_name
from directkv.kernels.cuda import build, merge_strided
from directkv.kernels.cuda.prefill_stream import (
    STREAM_SLOTS,
    PrefillRing,
    PrefillStreamPlan,
    check_stream_options,
    copy_pass,
    plan_prefill_stream,
)
from directkv.kernels.cuda.side_stream import side_stream
from directkv.kernels.paged import PagedKV, check_queries, per_table
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import prefill_traffic

VARIANTS = ("naive", "tiled", "stream")
PASS_KERNELS = ("flash", "tiled")  # stream: the kernel of its ring and new-token passes
NEW_PASSES = ("kernel", "flash")  # tiled: the new tokens with the past in one kernel, or their own flash pass
MERGES = ("kernel", "torch")  # stream: its passes merged by merge_strided (one launch) or by torch ops
STATE_DTYPES = ("float32", "input")  # tiled: partial O between chunks in fp32, or normalised in q's dtype
HOST_LOADS = ("cg", "ca")  # index = the kernel's host-load code (csrc/include/directkv/dispatch.h)
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
HEAD_DIMS = (64, 128)
TILE_Q = 64  # query rows per naive CTA (4 warps x 16): the kernel's only Q tile
TILE_KV = 64  # keys per shared-memory tile: the kernel's only K/V tile
SMEM_PAD = 8  # elements of padding per shared-memory row (bank-conflict-free ldmatrix)
WORKSPACE_CAP = 3 << 30  # bytes of split partial state at most; fewer splits beyond it
_TRAFFIC_MEMO: dict = {}  # per_table's memo of the closed-form Traffic


@dataclass(frozen=True)
class TiledPlan:
    """Launch plan of the tiled kernel: `num_splits` CTAs per KV head of `threads` threads, each owning a
    contiguous run of the `num_chunks` chunks of `kv_chunk` keys, with `num_buffers` chunk buffers."""

    kv_chunk: int
    num_chunks: int
    num_splits: int
    threads: int
    num_buffers: int = 1


def plan_tiled(
    keys: int,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    part_bytes_per_split: int,
    sms: int,
    smem_optin: int,
    kv_chunk: int | None = None,
    num_splits: int | None = None,
    double_buffer: bool = False,
    extra_smem: int = 0,
) -> TiledPlan:
    """Plan the tiled kernel for `keys` = past_len + q_len keys per KV head.

    Default: one 8-warp CTA per SM and chunks as large as the buffers allow, sized so every CTA gets the
    same number of chunks (a big chunk keeps the partial-O traffic per key low). A given kv_chunk small
    enough for two CTAs per SM runs 4-warp CTAs, two per SM. num_splits is clipped to the chunk count and
    to WORKSPACE_CAP bytes of partial state. extra_smem: shared memory each CTA holds beside its chunk
    buffers (proj_attention's weight stages).
    """
    buffers = 2 if double_buffer else 1
    chunk_bytes = 2 * (head_dim + SMEM_PAD) * dtype_bytes * buffers  # K + V row of every buffer
    max_chunk = (smem_optin - extra_smem) // chunk_bytes // TILE_KV * TILE_KV
    check(max_chunk >= TILE_KV, f"shared memory ({smem_optin} B, {extra_smem} B of it taken by weight stages) holds "
          f"no {buffers}-buffer chunk of {TILE_KV} keys")
    if kv_chunk is None:
        splits = max(1, sms // num_kv_heads)
        rounds = math.ceil(keys / (splits * max_chunk))
        kv_chunk = TILE_KV * math.ceil(keys / (splits * rounds * TILE_KV))
        per_sm = 1
    else:
        check(
            isinstance(kv_chunk, int) and TILE_KV <= kv_chunk <= max_chunk and kv_chunk % TILE_KV == 0,
            f"kv_chunk {kv_chunk!r} must be a multiple of {TILE_KV} in {TILE_KV}..{max_chunk} "
            f"(shared memory) for head_dim {head_dim}",
        )
        per_sm = 2 if 2 * (kv_chunk * chunk_bytes + extra_smem) <= smem_optin else 1
        splits = max(1, sms * per_sm // num_kv_heads)
    if num_splits is not None:
        check(isinstance(num_splits, int) and num_splits >= 1, f"num_splits must be a positive int; got {num_splits!r}")
        splits = num_splits
    chunks = math.ceil(keys / kv_chunk)
    splits = max(1, min(splits, chunks, WORKSPACE_CAP // max(1, part_bytes_per_split)))
    return TiledPlan(kv_chunk, chunks, splits, 128 if per_sm == 2 else 256, buffers)


@cache
def device_limits(device: int) -> tuple[int, int]:
    with torch.cuda.device(device):
        return tuple(build.load("prefill_attention").device_limits())


def check_host_pools(kv: PagedKV, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
    """The host pools must be zero-copy views of pinned memory (on `device` when given) or pinned CPU tensors,
    contiguous, of `dtype` when given."""
    for name, t in (("host_k", kv.host_k), ("host_v", kv.host_v)):
        view = t.device.type == "cuda" and device in (None, t.device)
        zero_copy = view or (t.device.type == "cpu" and t.is_pinned())
        check(zero_copy and t.is_contiguous() and dtype in (None, t.dtype),
              f"{name} must be a contiguous{'' if dtype is None else ' ' + str(dtype)} zero-copy view "
              f"(zero_copy.device_view{'' if device is None else ' on ' + str(device)}) or pinned CPU tensor; got "
              f"{t.dtype} on {t.device}, pinned={t.device.type == 'cpu' and t.is_pinned()}, "
              f"contiguous={t.is_contiguous()}")


def _check_inputs(q, k_new, v_new, kv: PagedKV, variant: str, tile_q: int, tile_kv: int, out, host_load: str,
                  chunk_bytes: int | None = None, min_chunks: int = 1) -> None:
    if variant not in VARIANTS:
        raise unknown_name("prefill_attention variant", variant, VARIANTS)
    if host_load not in HOST_LOADS:
        raise unknown_name("prefill_attention host_load", host_load, HOST_LOADS)
    check_stream_options(variant, chunk_bytes, min_chunks)
    check(tile_q == TILE_Q, f"tile_q {tile_q!r} is not supported by the CUDA kernel; valid: {TILE_Q} (query rows per CTA)")
    check(tile_kv == TILE_KV, f"tile_kv {tile_kv!r} is not supported by the CUDA kernel; valid: {TILE_KV}")
    q_len, num_heads, head_dim = check_queries(q, kv, rows="q_len")
    check(q_len >= 1, "prefill needs q_len >= 1")
    check(q.dtype in DTYPE_CODES, f"dtype {q.dtype} is not supported; valid: float16, bfloat16")
    check(head_dim in HEAD_DIMS, f"head_dim {head_dim} is not supported; valid: {HEAD_DIMS}")
    check(kv.batch == 1, f"prefill takes one sequence; kv.batch is {kv.batch}")
    want = (q_len, kv.num_kv_heads, head_dim)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check(tuple(t.shape) == want and t.dtype == q.dtype, f"{name} must be {q.dtype} {list(want)}; got "
              f"{t.dtype} {list(t.shape)}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("hbm_k", kv.hbm_k), ("hbm_v", kv.hbm_v)):
        check(t.device.type == "cuda" and t.is_contiguous(), f"{name} must be a contiguous CUDA tensor; got {t.device}")
    check_host_pools(kv)
    if out is not None:
        check(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous(),
              f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")


def traffic(q_len: int, past_len: int, kv: PagedKV, *, num_heads: int, variant: str, causal: bool,
            kv_chunk: int = TILE_KV, host_table: torch.Tensor | None = None) -> Traffic:
    """Closed-form Traffic of one call (traffic_model.prefill_traffic), memoised per block-table version.

    Link bytes are exact: naive reads every past host token once per CTA of 64 rows, tiled and stream once.
    HBM bytes are the reference schedule's at the kernel's tiles (naive: 64 // G query tokens; tiled: tile_kv =
    kv_chunk); the kernel's chunks also straddle the past / new boundary and its merge adds one partial pass
    per split, which the closed form leaves out. stream is tiled's closed form (at the kv_chunk tiled would
    plan for the whole call) plus the ring: every host byte is written into it and read back from it; its
    per-pass plans, fp32 pass outputs and final merge are left out. host_table: a CPU copy of kv.block_table,
    read instead of it (reading a GPU table is a device sync).
    """
    if variant == "stream":
        t = traffic(q_len, past_len, kv, num_heads=num_heads, variant="tiled", causal=causal, kv_chunk=kv_chunk,
                    host_table=host_table)
        return Traffic(t.link_read_bytes, t.link_write_bytes, t.hbm_read_bytes + t.link_read_bytes,
                       t.hbm_write_bytes + t.link_read_bytes, t.flops)
    table = kv.block_table
    key = (variant, q_len, past_len, num_heads, kv.num_kv_heads, kv.head_dim, kv.dtype, causal, kv_chunk, kv.page_size)

    def closed_form() -> Traffic:
        pages = -(-past_len // kv.page_size)
        entries = (table if host_table is None else host_table).reshape(1, -1)[0, :pages].cpu().to(torch.int64)
        tokens = (past_len - torch.arange(pages) * kv.page_size).clamp(max=kv.page_size)
        hbm_tokens = int((tokens * (entries < 0)).sum())
        group = num_heads // kv.num_kv_heads
        tile_q = max(1, TILE_Q // group) if variant == "naive" else TILE_Q
        t = prefill_traffic(q_len, past_len, num_heads=num_heads, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                            dtype_bytes=kv.host_k.element_size(), variant=variant, causal=causal, tile_q=tile_q,
                            tile_kv=kv_chunk if variant == "tiled" else TILE_KV, past_hbm_tokens=hbm_tokens)
        if variant == "naive":  # exact also when G does not divide 64 (a CTA then holds part of a token's heads)
            ctas = -(-q_len * group // TILE_Q)
            t.link_read_bytes = ctas * (past_len - hbm_tokens) * 2 * kv.num_kv_heads * kv.head_dim * kv.host_k.element_size()
        return t

    return per_table(_TRAFFIC_MEMO, table, key, closed_form)


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv: PagedKV,
    *,
    variant: str,
    causal: bool = True,
    tile_q: int = TILE_Q,
    tile_kv: int = TILE_KV,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    kv_chunk: int | None = None,
    num_splits: int | None = None,
    double_buffer: bool = False,
    host_load: str = "ca",
    chunk_bytes: int | None = None,
    min_chunks: int = 1,
    pass_kernel: str = "flash",
    state_dtype: str = "float32",
    stream_plan: PrefillStreamPlan | None = None,
    stream_ring: PrefillRing | None = None,
    host_table: torch.Tensor | None = None,
    new_pass: str = "kernel",
    merge: str = "kernel",
) -> tuple[torch.Tensor, Traffic]:
    """Attention of q_len new tokens over the past_len = kv.seq_lens[0] cached tokens and themselves.

    Parameters
    ----------
    q : `[q_len, num_heads, head_dim]` CUDA tensor, fp16 or bf16, head_dim 64 or 128; query i sits at
        absolute position past_len + i.
    k_new, v_new : `[q_len, num_kv_heads, head_dim]` CUDA tensors (the new tokens' K/V, in HBM).
    kv : one-sequence paged cache; pools `[num_pages, page_size, num_kv_heads, head_dim]`, host pools as
        zero-copy views of pinned memory (or pinned CPU tensors), HBM pools on the GPU; block_table
        `[1, max_pages]` and seq_lens `[1]` int32 (CPU or GPU; a CPU block table is copied to the GPU).
    variant : "naive", "tiled" or "stream" (module docstring).
    causal : new query i sees new tokens j <= i (all past tokens always).
    tile_q, tile_kv : must be 64 (query rows per naive CTA, keys per shared-memory tile).
    sm_scale : softmax scale, default 1 / sqrt(head_dim).
    out : optional `[q_len, num_heads, head_dim]` output buffer (q's dtype).
    kv_chunk, num_splits, double_buffer : tiled and each pass of stream: force the stationary chunk (keys,
        multiple of 64), the CTAs per KV head (None plans them, see plan_tiled) and two half-size chunk
        buffers (load the next chunk while computing the current one).
    host_load : "ca" (through L1, default) or "cg" (L2 only): how the past K/V pages are copied (module
        docstring). It changes no result and no closed-form traffic.
    chunk_bytes, min_chunks : stream only: bytes of K per ring chunk (default and at most STREAM_CHUNK_BYTES)
        and a cut of small caches into at least that many chunks (see stream_chunk_pages).
    pass_kernel : stream only: what attends the queries to each ring chunk and to the new tokens: "flash"
        (default; torch's FlashAttention-2 forward on the HBM ring, GQA heads folded into rows) or "tiled"
        (this module's tiled kernel). The HBM-page pass always runs the tiled kernel.
    state_dtype : tiled (and stream's tiled passes): "float32" (default) keeps the partial O that goes to HBM
        between chunks in fp32; "input" keeps it normalised (O / l) in q's dtype, halving those bytes at the
        cost of one rounding per round trip. The closed-form Traffic counts fp32 state either way.
    stream_plan : stream only: a `plan_prefill_stream(kv)` result reused across calls over the same block
        table and past (every layer of a serving step; the benchmark's repeats); made per call when None,
        which reads the block table on the CPU (a device sync when it lives on the GPU) and costs ~ms of
        host work at 16K past tokens. chunk_bytes / min_chunks are then the plan's.
    stream_ring : stream with a stream_plan only: a `prefill_ring(stream_plan, pool, device)` kept across calls
        instead of a ring allocated per call, so `prefetch_prefill_stream` can copy the next call's first
        chunks ahead.
    host_table : a CPU copy of kv.block_table, where the caller has one (a serving step): the closed-form
        Traffic reads it instead, with no device sync.
    new_pass : tiled only: "kernel" (default) attends the queries to the past and the new tokens in one tiled
        kernel; "flash" attends them to the new tokens alone with torch's FlashAttention-2 (causal), to the past
        with the tiled kernel, and merges the two by LSE. The tiled kernel is built to read a link-bound past
        once; over 2048 new tokens without a past it ran at ~100 TFLOPS on the H200 (serving profile,
        2026-12-01), where FlashAttention-2 runs at several times that. The closed-form Traffic is tiled's.
    merge : stream only: how its passes' outputs are merged by LSE: "kernel" (default; merge_strided, one launch
        reading each pass once where it lies) or "torch" (merge_strided.merge_passes: an fp32 read-modify-write
        of the output per pass). Either way the passes are merged as they come (merge_strided.RunningMerge): at
        most traffic_model.STREAM_HELD_PASSES of their O are held, plus the one being added and an fp32 running
        one. Tiled with new_pass="flash" always merges its two passes with merge_strided.

    Returns
    -------
    (out `[q_len, num_heads, head_dim]`, Traffic from the closed form, see `traffic`).
    """
    if state_dtype not in STATE_DTYPES:
        raise unknown_name("prefill_attention state_dtype", state_dtype, STATE_DTYPES)
    check(variant != "naive" or state_dtype == "float32", f"state_dtype is an option of the tiled and stream "
          f"variants; got variant 'naive' with state_dtype={state_dtype!r}")
    if pass_kernel not in PASS_KERNELS:
        raise unknown_name("prefill_attention pass_kernel", pass_kernel, PASS_KERNELS)
    if new_pass not in NEW_PASSES:
        raise unknown_name("prefill_attention new_pass", new_pass, NEW_PASSES)
    if merge not in MERGES:
        raise unknown_name("prefill_attention merge", merge, MERGES)
    check(variant == "stream" or merge == "kernel", f"merge is an option of variant 'stream'; got variant "
          f"{variant!r} with merge={merge!r}")
    check(new_pass == "kernel" or variant == "tiled", f"new_pass is an option of variant 'tiled'; got variant "
          f"{variant!r} with new_pass={new_pass!r}")
    check(new_pass == "kernel" or _FLASH is not None,
          "this torch has no aten._scaled_dot_product_flash_attention; use new_pass='kernel'")
    check(variant == "stream" or pass_kernel == "flash", f"pass_kernel is an option of variant 'stream'; got "
          f"variant {variant!r} with pass_kernel={pass_kernel!r}")
    check(pass_kernel != "flash" or variant != "stream" or _FLASH is not None,
          "this torch has no aten._scaled_dot_product_flash_attention; use pass_kernel='tiled'")
    check(stream_plan is None or (variant == "stream" and chunk_bytes is None and min_chunks == 1),
          f"stream_plan is an option of variant 'stream' and carries its chunking; got variant {variant!r} with "
          f"chunk_bytes={chunk_bytes!r}, min_chunks={min_chunks!r}")
    check(stream_ring is None or stream_plan is not None, "stream_ring is an option of variant 'stream' with a "
          "stream_plan (the ring is sized by the plan); got no stream_plan")
    _check_inputs(q, k_new, v_new, kv, variant, tile_q, tile_kv, out, host_load, chunk_bytes, min_chunks)
    q_len, num_heads, head_dim = q.shape
    past_len = int(kv.seq_lens[0])
    if stream_plan is not None:
        check(stream_plan.past_len == past_len, f"stream_plan was made for past_len {stream_plan.past_len}; this cache "
              f"has {past_len}")
    pages = -(-past_len // kv.page_size)
    check(past_len >= 0 and pages <= kv.block_table.shape[1], f"past_len {past_len} needs {pages} pages; the block "
          f"table has {kv.block_table.shape[1]}")
    out = torch.empty_like(q) if out is None else out
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    launch = dict(causal=bool(causal), scale=scale, host_load=host_load, half_state=state_dtype == "input")
    tiled_opts = dict(kv_chunk=kv_chunk, num_splits=num_splits, double_buffer=double_buffer)
    # stream's Traffic is tiled's closed form, at the plan tiled would make for the whole call
    plan = None if variant == "naive" else _plan(past_len + q_len, q, kv.num_kv_heads, **tiled_opts)
    if variant == "stream" and stream_plan is None:
        stream_plan = plan_prefill_stream(kv, chunk_bytes=chunk_bytes, min_chunks=min_chunks, device=q.device)
    if variant == "stream" and not stream_plan.passes:
        # no past: the new tokens' pass alone, written straight into out, not merged as one pass of one. (Serving
        # reads such chunks in place with the tiled variant, paths.ZeroCopyPath; this is for direct callers.)
        if pass_kernel == "flash":
            out.copy_(_flash_new(q, k_new, v_new, launch["scale"], launch["causal"])[0])
        else:
            _launch(q, k_new, v_new, (kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v), None, 0, variant="tiled", plan=plan,
                    include_new=True, out=out, **launch)
    elif variant == "stream":
        _run_stream(q, k_new, v_new, kv, out, stream_plan, tiled_opts=tiled_opts, pass_kernel=pass_kernel,
                    merge=merge, ring=stream_ring, **launch)
    else:
        table = kv.block_table[0]
        if table.device != q.device or table.dtype != torch.int32:
            table = table.to(device=q.device, dtype=torch.int32)
        pools = (kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v)
        if new_pass == "flash":
            _flash_new_and_tiled_past(q, k_new, v_new, kv, pools, table.contiguous(), past_len, out,
                                      tiled_opts=tiled_opts, **launch)
        else:
            _launch(q, k_new, v_new, pools, table.contiguous(), past_len, variant=variant, plan=plan,
                    include_new=True, out=out, **launch)
    t = traffic(q_len, past_len, kv, num_heads=num_heads, variant=variant, causal=causal,
                kv_chunk=TILE_KV if plan is None else plan.kv_chunk, host_table=host_table)
    return out, t


def _flash_new_and_tiled_past(q, k_new, v_new, kv: PagedKV, pools, table, past_len: int, out, *, tiled_opts: dict,
                              **launch) -> None:
    """new_pass="flash": the new tokens' causal pass by FlashAttention-2, the past's by the tiled kernel (past
    keys are all visible, so no mask), merged by LSE into out; no past: the flash pass alone."""
    o_new, lse_new = _flash_new(q, k_new, v_new, launch["scale"], launch["causal"])
    if past_len == 0:
        out.copy_(o_new)
        return
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    plan = _plan(past_len, q, kv.num_kv_heads, **tiled_opts)
    _launch(q, k_new, v_new, pools, table, past_len, variant="tiled", plan=plan, include_new=False, out_f32=o,
            lse_out=lse, **launch)
    _merge([(o_new, lse_new), (o, lse)], out, kv.num_kv_heads)


def _plan(keys: int, q: torch.Tensor, num_kv_heads: int, *, kv_chunk, num_splits, double_buffer) -> TiledPlan:
    """plan_tiled for `keys` keys per KV head on q's device."""
    q_len, num_heads, head_dim = q.shape
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    sms, smem = device_limits(device)
    return plan_tiled(keys, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=q.element_size(),
                      part_bytes_per_split=q_len * num_heads * (head_dim + 2) * 4, sms=sms, smem_optin=smem,
                      kv_chunk=kv_chunk, num_splits=num_splits, double_buffer=double_buffer)


def _launch(q, k_new, v_new, pools, table, past_len: int, *, variant: str, plan: TiledPlan | None, include_new: bool,
            causal: bool, scale: float, host_load: str, half_state: bool = False, out=None, out_f32=None,
            lse_out=None) -> None:
    """One kernel call on the current stream. pools: (host_k, host_v, hbm_k, hbm_v); table: int32 CUDA
    entries of the past pages (None when past_len is 0); out_f32 / lse_out (tiled only) instead of out."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, page_size = pools[0].shape[2], pools[0].shape[1]
    part_o = part_ml = None
    if plan is None:
        plan = TiledPlan(0, 0, 1, 4 * 32)
    else:
        state = q.dtype if half_state else torch.float32
        part_o = torch.empty(plan.num_splits, q_len, num_heads, head_dim, dtype=state, device=q.device)
        part_ml = torch.empty(plan.num_splits, q_len, num_heads, 2, dtype=torch.float32, device=q.device)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    build.load("prefill_attention").run(
        q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), *(t.data_ptr() for t in pools), ptr(table), ptr(out),
        ptr(out_f32), ptr(lse_out), ptr(part_o), ptr(part_ml), q_len, past_len, num_heads, num_kv_heads, head_dim,
        page_size, causal, include_new, VARIANTS.index(variant), plan.kv_chunk, plan.num_splits, plan.threads,
        plan.num_buffers, bool(half_state and plan.kv_chunk), scale, DTYPE_CODES[q.dtype], HOST_LOADS.index(host_load),
        torch.cuda.current_stream(q.device).cuda_stream,
    )  # fmt: skip


# --- stream variant -------------------------------------------------------------------------------


def _run_stream(q, k_new, v_new, kv: PagedKV, out, plan: PrefillStreamPlan, *, tiled_opts: dict, pass_kernel: str,
                merge: str = "kernel", ring: PrefillRing | None = None, **launch) -> None:
    """The new tokens' pass first (it needs no ring), then the ring passes (copy on the side stream, attend on
    the current one) and the HBM-page pass; each gives O and its LSE, folded as they come (RunningMerge) and
    merged by _merge. No host sync per chunk."""
    q_len, num_heads, _ = q.shape
    passes, tables, chunk_pages = plan.passes, plan.tables, plan.chunk_pages
    flash = pass_kernel == "flash"
    merged = merge_strided.RunningMerge(kernel=merge == "kernel")  # a long past's passes are not all held at once

    def add(part: tuple[torch.Tensor, torch.Tensor]) -> None:  # (O [q_len, Hq, D], LSE [q_len, Hq]), views allowed
        merged.add(*_grouped(part, kv.num_kv_heads))

    def tiled_pass(pools, tbl, past: int, include_new: bool) -> None:
        o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty((q_len, num_heads), dtype=torch.float32, device=q.device)
        keys = past + (q_len if include_new else 0)
        _launch(q, k_new, v_new, pools, tbl, past, variant="tiled", plan=_plan(keys, q, kv.num_kv_heads, **tiled_opts),
                include_new=include_new, out_f32=o, lse_out=lse, **launch)
        add((o, lse))

    main = torch.cuda.current_stream(q.device)
    skip = 0  # ring passes a prefetch already copied from these pools
    if any(p.ring for p in passes):
        if ring is None:
            ring_shape = (STREAM_SLOTS, chunk_pages, *kv.host_k.shape[1:])
            ring_k = torch.empty(ring_shape, dtype=q.dtype, device=q.device)
            ring_v = torch.empty(ring_shape, dtype=q.dtype, device=q.device)
            side, filled, freed = side_stream(q.device, STREAM_SLOTS)
        else:
            got = (ring.ring_k.shape[1], tuple(ring.ring_k.shape[2:]), ring.ring_k.dtype, ring.ring_k.device)
            check(got[0] >= chunk_pages and got[1:] == (tuple(kv.host_k.shape[1:]), q.dtype, q.device)
                  and ring.ring_k.is_contiguous() and ring.ring_v.is_contiguous(),
                  f"stream_ring holds {got[0]} pages of {got[1]} {got[2]} per slot on {got[3]}; the plan needs "
                  f"{chunk_pages} of {tuple(kv.host_k.shape[1:])} {q.dtype} on {q.device}")
            ring_k, ring_v, side, filled, freed = ring.ring_k, ring.ring_v, ring.side, ring.filled, ring.freed
            ahead, ring.prefetched = ring.prefetched, None
            if ahead is not None and ahead[0] is plan and ahead[1:3] == (kv.host_k.data_ptr(), kv.host_v.data_ptr()):
                skip = ahead[3]  # a prefetch of other pools or for another plan is redone after it (same stream)
        side.wait_stream(main)  # the ring's previous users and the pools' writers come first
        q_fold = _fold_gqa(q, kv.num_kv_heads) if flash else None
    # The new tokens' pass needs no ring, so it goes first (after side.wait_stream above, which must not wait
    # for it): it computes while the copy engine fills the first chunk, whose copy nothing overlapped before.
    # The merge does not care about the order.
    if flash:
        add(_flash_new(q, k_new, v_new, launch["scale"], launch["causal"]))
    else:
        tiled_pass((kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v), None, 0, True)
    for c, ps in enumerate(passes):
        if not ps.ring:
            tiled_pass((kv.host_k, kv.host_v, kv.hbm_k, kv.hbm_v), tables[c], ps.past_len, False)
            continue
        slot = c % ring_k.shape[0]  # ring chunks come first in stream_passes, so c counts them
        if c >= skip:
            copy_pass(plan, ring_k, ring_v, side, filled, freed, kv.host_k, kv.host_v, c)
        rings = (ring_k[slot], ring_v[slot])
        main.wait_event(filled[slot])
        if flash:
            for start, n in plan.runs[c]:
                add(_flash_past(q_fold, q_len, rings, start, n, launch["scale"]))
        else:
            tiled_pass((*rings, *rings), tables[c], ps.past_len, False)
        freed[slot].record(main)
    # Every row sees at least its first new token in the new tokens' pass, so no row's LSEs are all -inf.
    _merge(merged.parts, out, kv.num_kv_heads, merge)


def _grouped(part: tuple[torch.Tensor, torch.Tensor], num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pass (O `[q_len, Hq, D]` or `[q_len, Hkv, G, D]`, LSE without D) as `[q_len, Hkv, G, D]` views: flash
    passes' permuted views only hold in that form."""
    def group(t: torch.Tensor, dims: int) -> torch.Tensor:
        return t if t.dim() == dims else t.unflatten(1, (num_kv_heads, t.shape[1] // num_kv_heads))
    return group(part[0], 4), group(part[1], 3)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, num_kv_heads: int,
           merge: str = "kernel") -> None:
    """out `[q_len, Hq, D]` = the passes (see _grouped) merged by LSE: by merge_strided, one launch reading each
    pass once where it lies, or by the torch-op merge (an fp32 read-modify-write of the whole output per pass)
    when asked or for what the kernel does not take (an output with gaps)."""
    parts = [_grouped(p, num_kv_heads) for p in parts]
    if out.is_contiguous():
        merge_strided.merge_any(parts, out.view(*parts[0][0].shape), merge == "kernel")
    else:
        merge_strided.merge_passes(parts, out)


# torch's FlashAttention-2 forward; returns the LSE beside O, which stream's merge needs (F.sdpa does not)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q `[q_len, Hq, D]` -> `[1, Hkv, q_len * G, D]`: the G query heads of a KV head become G rows per token.
    Exact for attention with no mask (every row sees every key), and K/V are then read once per KV head."""
    q_len, num_heads, d = q.shape
    g = num_heads // num_kv_heads
    return q.view(q_len, num_kv_heads, g, d).permute(1, 0, 2, 3).reshape(1, num_kv_heads, q_len * g, d)


def _flash_past(q_fold, q_len: int, rings, start: int, n: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash pass of the folded queries over ring slots [start, start + n) (K/V read in place, no mask)."""
    _, hkv, rows, d = q_fold.shape
    k, v = (r.view(-1, hkv, d)[start : start + n].permute(1, 0, 2).unsqueeze(0) for r in rings)  # [1, Hkv, n, D]
    o, lse = _FLASH(q_fold, k, v, 0.0, False, False, scale=scale)[:2]
    g = rows // q_len
    # [q_len, Hkv, G, D] and [q_len, Hkv, G] views, no copies: the merges read them once
    o = o.view(hkv, q_len, g, d).permute(1, 0, 2, 3)
    lse = lse.reshape(hkv, -1)[:, :rows].view(hkv, q_len, g).permute(1, 0, 2)
    return o, lse.float()


def _flash_new(q, k_new, v_new, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash pass of the queries over the new tokens alone (causal: same length, so the diagonal aligns);
    GQA by repeating the new K/V, which are q_len tokens only."""
    q_len, num_heads, d = q.shape
    g = num_heads // k_new.shape[1]
    k, v = (t.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0) for t in (k_new, v_new))  # [1, Hq, q_len, D]
    o, lse = _FLASH(q.transpose(0, 1).unsqueeze(0), k, v, 0.0, causal, False, scale=scale)[:2]
    return o[0].transpose(0, 1), lse.reshape(num_heads, -1)[:, :q_len].transpose(0, 1).float()
