"""Closed-form traffic of the kernel schedules, for the cost model at real shapes.

Each function is derived from the math of the schedule in `directkv.kernels.reference` (not by running
it) and equals the counted Traffic of that schedule exactly, every field: link and HBM bytes and FLOPs.
Costs are O(1) per call (O(batch) for decode; O(log) for the causal tile-visibility sum).

Tiers: past K/V are assumed to sit in host pages unless `*_hbm_tokens` says how many of them sit in HBM
pages. Bytes do not depend on *which* pages are in HBM, only on how many tokens: every schedule reads
each cached token the same number of times.

Symbols: e = dtype_bytes; a token's K+V bytes over all KV heads `kv_tok = 2 * num_kv_heads * head_dim * e`;
a query row of Q or O `row = num_heads * head_dim * e`; a query row of the float32 partial O, m, l kept in
HBM by the K/V-stationary schedule `part = num_heads * (head_dim + 2) * 4`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from directkv.errors import check
from directkv.kernels.reference.common import ceil_div, check_tiles, check_variant, partial_bytes_per_row
from directkv.kernels.reference.decode import DECODE_VARIANTS
from directkv.kernels.reference.gemm import GEMM_VARIANTS
from directkv.kernels.reference.prefill import PREFILL_VARIANTS
from directkv.kernels.reference.proj_attention import PROJ_VARIANTS
from directkv.kernels.traffic import TIERS, Traffic

# HBM the `stream` variants (beyond the paper) may hold for their copy-engine rings, whatever the context
STREAM_RING_BYTES = 64 << 20
STREAM_SLOTS = 2  # ring slots: one is filled by the copy engine while the kernel reads the other
STREAM_CHUNK_BYTES = STREAM_RING_BYTES // (2 * STREAM_SLOTS)  # per slot, of K (V the same): 16 MiB
# Serving's rings (executor.directkv_stream_slots) hold more, up to 12 slots of that size (384 MiB; the decode ring
# was cut into slots of that size until 2026-12-02, so the numbers here are of that cut): in a step
# mixing decodes with a prompt chunk the copy engine then stages the next layer's decode K/V during the chunk's
# attention and dense work, as swap stages whole layers. H200, 2026-12-01, Llama-3.1-8B batch 4 at 16K: 2 slots
# 1.13x swap's TPOT, 4 slots 0.99x, 8 slots 0.97x (results/h200/README.md, seventeenth session). 12 slots hold a
# whole layer's read of more steps (OPT-13B's 16K decode: 10 chunks of 16 MiB of K): H200, 2026-12-02, stream / swap
# TPOT with 8 / 12 slots: OPT-13B 3 x 16K 1.009-1.012 / 0.969-0.971 (both orders each), Llama batch 4 16K 0.994-1.000
# / 0.999, 32K 0.978-0.983 (nineteenth session) / 0.934; GPU memory the same within 0.1 GB (twentieth session).
SERVING_STREAM_SLOTS = 12
# The decode ring keeps that HBM (slots x 32 MiB) but is cut into fewer, larger slots
# (executor.directkv_stream_chunk_mib of K each): a layer's decode read then takes fewer ring chunks, each with its
# own kernel, copy event and merge part; and a small read takes 3 slots of HBM, not 12. H200, 2026-12-02, stream /
# swap TPOT (sdpa prompt chunks), 64 against 16 MiB slots in one process (a Hydra multirun): ShareGPT 10 req/s
# 0.868 against 0.989 (stream 15% faster, swap 3%; 0.84 GB less GPU memory), Llama batch 4 32K 0.997 against 1.025;
# in earlier calls of the day 32K 0.981 / 0.983 (both orders) against 1.015, 16K 1.024 / 1.012 (1.031 / 1.032 in
# the twenty-second session), OPT-13B 3 x 16K 1.053 / 1.049 (1.042 / 1.053 in the twenty-first): no better there
# (twenty-fourth session; the ShareGPT and 32K pairs ran swap first, and in the one process 64 after 16).
SERVING_STREAM_CHUNK_MIB = 64
# executor.directkv_stream_slots=auto (the config's default): a model whose K and V per token per layer exceed
# WIDE_KV_BYTES (no GQA: OPT-6.7B 16 KiB, OPT-13B 20 KiB, against Llama-3.1-8B's 4 KiB) reads 4-5x the bytes per
# decode per layer, and its decode ring takes twice the slots so a step's decodes of the next layer are copied during
# a prompt chunk's dense work. H200, 2026-12-02, stream / swap TPOT in one process (swap with SDPA prompt chunks):
# OPT-13B 3 x 16K 1.042 (12) / 1.002 (24); 3 x 32K 1.134 (12, another process) / 0.993 (24) / 1.007 (36), +1.0 GB
# with 24; Llama batch 4 32K 1.016 / 1.040 and 1.004 / 1.030 with 12 / 24 (both orders: 24 is slower there, which
# the cost model, flat between them, does not explain).
WIDE_KV_BYTES = 8 << 10  # the Python APIs (simulate, run_gpu, profile) keep 12 by default; auto is the config's
STREAM_SLOTS_AUTO = "auto"


def auto_stream_slots(kv_bytes_per_token_per_layer: int) -> int:
    """The stream rings' slot count `auto` takes for a model with this many K and V bytes per token per layer."""
    return 2 * SERVING_STREAM_SLOTS if kv_bytes_per_token_per_layer > WIDE_KV_BYTES else SERVING_STREAM_SLOTS


# A min_chunks cut stops at ring slots this small (each chunk costs launches; decode's equal chunks may come out
# smaller, prefill's do not); serving also reads a prompt chunk's past this small in place (stream_reads_in_place).
STREAM_MIN_CHUNK_BYTES = 2 << 20


def stream_ring_bytes(slots: int, read_bytes: int | None = None, *, floor: int = STREAM_MIN_CHUNK_BYTES,
                      chunk_bytes: int = STREAM_CHUNK_BYTES) -> int:
    """HBM a stream ring of `slots` slots holds, K and V: with `read_bytes` (a layer's K and V read through it)
    each slot holds min(chunk_bytes, max(the read's K, floor)) of K and as much of V, as plan_stream sizes
    a decode ring (a prefill ring's floor is 0), before a ring's growth by a quarter; 0 for no read. Without
    `read_bytes`: the most it may hold, plan_stream's cap."""
    if read_bytes is None:
        return 2 * slots * chunk_bytes
    return 2 * slots * min(chunk_bytes, max(read_bytes // 2, floor)) if read_bytes > 0 else 0


def decode_ring(slots: int, chunk_mib: int) -> tuple[int, int]:
    """(slots, K bytes per slot) of serving's stream decode ring: the HBM of `slots` 16 MiB slots
    (executor.directkv_stream_slots) cut into slots of `chunk_mib` MiB (executor.directkv_stream_chunk_mib);
    a ConfigError where that makes fewer than 2 (check_stream_chunk_mib)."""
    check_stream_chunk_mib(chunk_mib, slots)
    return slots * (STREAM_CHUNK_BYTES >> 20) // chunk_mib, chunk_mib << 20


def prefill_ring_slots(chunks: int, slots: int) -> int:
    """Slots of a prompt chunk's prefill ring for a past cut into `chunks` ring chunks when the ring may hold
    `slots` (serving's executor.directkv_stream_slots): one per chunk up to `slots`, never below STREAM_SLOTS.
    Each slot holds a chunk, so a past of up to `slots` chunks is copied ahead of its attention whole, during the
    dense work before it, as swap stages a whole layer; a new ring allocates no slot no chunk would use (a kept
    ring keeps its slots). H200, 2026-12-02, OPT-13B 3 x 16K: with 2 slots the step of a prompt's tail over a 16K
    past (11 chunks per layer) copied 9 of them inside the attention and took ~1,075 ms against swap's ~715."""
    return max(STREAM_SLOTS, min(slots, chunks))


def resolve_stream_slots(slots, kv_bytes_per_token_per_layer: int, name: str = "stream_slots") -> int:
    """`slots` as a slot count: "auto" -> auto_stream_slots for the model, else check_stream_slots (whose error
    names "auto" too)."""
    if slots == STREAM_SLOTS_AUTO:
        return auto_stream_slots(kv_bytes_per_token_per_layer)
    return check_stream_slots(slots, name, auto=True)


def check_stream_slots(slots, name: str = "stream_slots", *, auto: bool = False) -> int:
    """`slots` if it is a ring slot count (an int >= 2; not a bool), else a ConfigError naming `name`: the config
    key, the executor's argument and the serving path all take it."""
    also = f" or {STREAM_SLOTS_AUTO!r} (by the model's K/V bytes per token)" if auto else ""
    check(isinstance(slots, int) and not isinstance(slots, bool) and slots >= 2,
          f"{name} must be an int >= 2 (the copy engine fills one slot while a kernel reads another){also}; "
          f"got {slots!r}")
    return slots


def check_stream_chunk_mib(chunk_mib, slots: int, name: str = "stream_chunk_mib") -> int:
    """`chunk_mib` if the decode ring's `slots` x 16 MiB of K cut into slots of that many MiB make >= 2 slots of at
    least STREAM_MIN_CHUNK_BYTES, else a ConfigError naming `name` and the allowed range."""
    low, high = STREAM_MIN_CHUNK_BYTES >> 20, slots * (STREAM_CHUNK_BYTES >> 20) // 2
    check(isinstance(chunk_mib, int) and not isinstance(chunk_mib, bool) and low <= chunk_mib <= high,
          f"{name} must be an int in {low}..{high} (MiB of K per decode ring slot: the ring's {slots} x 16 MiB "
          f"of K, from the stream slots, must make >= 2 slots; fewer slots need a smaller chunk); got {chunk_mib!r}")
    return chunk_mib


# A prompt's tail (a chunk of at most STREAM_TAIL_NEW_TOKENS new tokens, left by a step's token budget) is read in
# place up to twice the past of other chunks, STREAM_TAIL_IN_PLACE_BYTES of K: like a decode it reads each past byte
# once, and at 4 MiB (K and V: ~0.16 ms per Llama layer at the SM rate) that costs less than a ring's passes, merge and
# copies queued behind the decodes'. H200, 2026-12-02, Llama-3.1-8B batch 4 at 2K: a step of 3 decodes and a 4-token
# tail over a 2,044-token past (4 MiB of K) took 31.6-48.9 ms streamed (swap's 22.8-26.1), 22.1-23.1 in place
# (swap's 21.6-27.7).
# A longer past is streamed, on the reasoning that an in-place read runs after the step's other work while a ring's
# copy can overlap it; measured, neither way won clearly there (4K: a 2-token tail over 4,094 tokens beside a 2,045-
# token chunk, 8-12 ms over swap's step in place, 0-20 streamed; OPT-13B 3 x 16K: ~1,110 ms in place, ~1,075
# streamed, swap ~715; results/h200/README.md, nineteenth session).
STREAM_TAIL_NEW_TOKENS = 16
STREAM_TAIL_IN_PLACE_BYTES = 2 * STREAM_MIN_CHUNK_BYTES


def stream_reads_in_place(past_len: int, new_len: int, page_size: int, k_page_bytes: int) -> bool:
    """Whether directkv `stream` serving reads a prompt chunk's past in place with the tiled kernel instead of
    through a prefill ring: when its host pages hold at most STREAM_MIN_CHUNK_BYTES of K (1,024 Llama-3.1-8B
    tokens), or STREAM_TAIL_IN_PLACE_BYTES (2,048) for a chunk of at most STREAM_TAIL_NEW_TOKENS new tokens (a
    prompt's tail). Below that the passes and merge around a ring cost more than the read (ShareGPT-like steps,
    H200, 2026-12-01: in place, pasts of a few hundred tokens, stream went 1.30x -> 1.18x swap). Above it the ring
    wins: a step's first chunk is copied during the dense work before it (prefetched), while the tiled kernel
    reads at the SM rate after it (Llama 4 x 16K, the same day: chunks of 2K tokens read in place up to 8K of past
    took 4-13 ms more per step than swap's, streamed ones 6-10 ms less). ShareGPT's prompts are at most 1,024
    tokens (conf/workload), so there every chunk is read in place. The executor (ZeroCopyPath) and the
    simulation both ask this, so they stay in step."""
    limit = STREAM_TAIL_IN_PLACE_BYTES if new_len <= STREAM_TAIL_NEW_TOKENS else STREAM_MIN_CHUNK_BYTES
    return -(-past_len // page_size) <= limit // k_page_bytes


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum_{i=0}^{n-1} floor((a*i + b) / m) for n >= 0, m >= 1, a, b >= 0, in O(log(a + m)) steps.

    With a, b < m the sum counts lattice points under a line; counting them by rows instead of columns
    swaps the roles of a and m, as in Euclid's algorithm.
    """
    if n <= 0:
        return 0
    total = (a // m) * (n * (n - 1) // 2) + (b // m) * n
    a, b = a % m, b % m
    top = (a * (n - 1) + b) // m  # the largest term
    if top == 0:
        return total
    # sum_i floor((a i + b)/m) = sum_{j=1}^{top} #{i < n : a i >= j m - b} = n*top - sum_j ceil((j m - b)/a)
    return total + n * top - floor_sum(top, a, m, m - b + a - 1)


@dataclass(frozen=True)
class _NewTileSums:
    """Sums over Q tiles i of the new K/V tiles each one sees (v_i of them, covering tokens_i tokens).

    New K/V tile j (positions j*tile_kv..) is seen by Q tile i iff j*tile_kv < q1_i (its row end) under
    causal masking, else always; so v_i = ceil(q1_i / tile_kv) and tokens_i = min(v_i * tile_kv, q_len).
    """

    tiles: int  # sum_i v_i
    rows_tiles: int  # sum_i rows_i * v_i: query rows times visits
    tokens: int  # sum_i tokens_i
    rows_tokens: int  # sum_i rows_i * tokens_i: (query, key) pairs computed

    @classmethod
    def of(cls, q_len: int, tile_q: int, tile_kv: int, causal: bool) -> _NewTileSums:
        nq, nk = ceil_div(q_len, tile_q), ceil_div(q_len, tile_kv)
        last_rows = q_len - (nq - 1) * tile_q
        overhang = nk * tile_kv - q_len  # padding of the last new tile; only Q tiles seeing it are short
        if causal:
            # Q tiles 0..nq-2 end at (i+1)*tile_q; the last ends at q_len and sees all nk tiles.
            tiles = floor_sum(nq - 1, tile_kv, tile_q, tile_q + tile_kv - 1) + nk
            first_full = (nk - 1) * tile_kv // tile_q  # first Q tile that sees the last new tile
            tail_tiles, tail_rows = nq - first_full, q_len - first_full * tile_q
        else:
            tiles, tail_tiles, tail_rows = nq * nk, nq, q_len
        rows_tiles = tile_q * tiles - (tile_q - last_rows) * nk  # the last Q tile has last_rows rows
        return cls(
            tiles=tiles,
            rows_tiles=rows_tiles,
            tokens=tile_kv * tiles - overhang * tail_tiles,
            rows_tokens=tile_kv * rows_tiles - overhang * tail_rows,
        )


@dataclass(frozen=True)
class _Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        check(
            min(self.num_heads, self.num_kv_heads, self.head_dim, self.dtype_bytes) >= 1
            and self.num_heads % self.num_kv_heads == 0,
            f"need positive sizes and num_heads % num_kv_heads == 0; got num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype_bytes={self.dtype_bytes}",
        )

    @property
    def kv_tok(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def row(self) -> int:
        return self.num_heads * self.head_dim * self.dtype_bytes

    @property
    def part(self) -> int:
        return partial_bytes_per_row(self.num_heads, self.head_dim)


def _check_split(name: str, hbm_tokens: int, tokens: int) -> None:
    check(0 <= hbm_tokens <= tokens, f"{name} must be in 0..{tokens}; got {hbm_tokens}")


def decode_traffic(
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    variant: str,
    hbm_tokens: Sequence[int] | None = None,
) -> Traffic:
    """Traffic of `decode_attention` over sequences of seq_lens[b] >= 1 cached tokens.

    hbm_tokens[b]: how many of sequence b's tokens sit in HBM pages (default none). The K/V tile size
    does not enter: every cached token is read once per reader whatever the tiling.
    """
    check_variant("decode_attention", variant, DECODE_VARIANTS)
    heads = _Heads(num_heads, num_kv_heads, head_dim, dtype_bytes)
    check(all(n >= 1 for n in seq_lens), f"decode needs seq_lens >= 1; got {list(seq_lens)}")
    hbm = list(hbm_tokens) if hbm_tokens is not None else [0] * len(seq_lens)
    check(len(hbm) == len(seq_lens), f"hbm_tokens has {len(hbm)} entries for {len(seq_lens)} sequences")
    for n, h in zip(seq_lens, hbm, strict=True):
        _check_split("hbm_tokens", h, n)
    copies = num_heads // num_kv_heads if variant == "naive" else 1  # naive: one reader per query head
    total, total_hbm, batch = sum(seq_lens), sum(hbm), len(seq_lens)
    return Traffic(
        link_read_bytes=copies * (total - total_hbm) * heads.kv_tok,
        hbm_read_bytes=copies * total_hbm * heads.kv_tok + batch * heads.row,
        hbm_write_bytes=batch * heads.row,
        flops=4 * head_dim * num_heads * total,
    )


def _attention(
    heads: _Heads,
    q_len: int,
    past_len: int,
    past_hbm_tokens: int,
    *,
    kv_outer: bool,
    causal: bool,
    tile_q: int,
    tile_kv: int,
    new_kv: str,
    new_hbm_tokens: int = 0,
) -> Traffic:
    """One sequence's attention. new_kv: where the new K/V are read from: "hbm" (dense, just projected),
    "pages" (read back from their cache pages) or "projected" (fused: produced in the loop, not read)."""
    sums = _NewTileSums.of(q_len, tile_q, tile_kv, causal)
    past_host = past_len - past_hbm_tokens
    flops = 4 * heads.head_dim * heads.num_heads * (q_len * past_len + sums.rows_tokens)
    if not kv_outer:  # Q tile outer: past and visible new K/V streamed per Q tile; Q read, O written once
        nq = ceil_div(q_len, tile_q)
        return Traffic(
            link_read_bytes=nq * past_host * heads.kv_tok,
            hbm_read_bytes=(nq * past_hbm_tokens + sums.tokens) * heads.kv_tok + q_len * heads.row,
            hbm_write_bytes=q_len * heads.row,
            flops=flops,
        )
    # K/V tile outer: a Q tile is visited (loaded) once per past tile and per new tile it sees; partial
    # state is written after every visit but the last and read before every visit but the first.
    visit_rows = ceil_div(past_len, tile_kv) * q_len + sums.rows_tiles
    partial = (visit_rows - q_len) * heads.part
    new_host, new_hbm = {"hbm": (0, q_len), "pages": (q_len - new_hbm_tokens, new_hbm_tokens)}.get(
        new_kv, (0, 0)
    )
    return Traffic(
        link_read_bytes=(past_host + new_host) * heads.kv_tok,
        hbm_read_bytes=(past_hbm_tokens + new_hbm) * heads.kv_tok + visit_rows * heads.row + partial,
        hbm_write_bytes=q_len * heads.row + partial,
        flops=flops,
    )


def prefill_traffic(
    q_len: int,
    past_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    variant: str,
    causal: bool = True,
    tile_q: int = 64,
    tile_kv: int = 64,
    past_hbm_tokens: int = 0,
) -> Traffic:
    """Traffic of `prefill_attention`: q_len >= 1 new tokens (Q, K, V in HBM) over past_len cached tokens,
    past_hbm_tokens of which sit in HBM pages."""
    check_variant("prefill_attention", variant, PREFILL_VARIANTS)
    check_tiles(tile_q=tile_q, tile_kv=tile_kv)
    check(q_len >= 1 and past_len >= 0, f"need q_len >= 1 and past_len >= 0; got {q_len}, {past_len}")
    _check_split("past_hbm_tokens", past_hbm_tokens, past_len)
    heads = _Heads(num_heads, num_kv_heads, head_dim, dtype_bytes)
    return _attention(
        heads, q_len, past_len, past_hbm_tokens, kv_outer=variant == "tiled", causal=causal,
        tile_q=tile_q, tile_kv=tile_kv, new_kv="hbm",
    )  # fmt: skip


# stream prefill: passes whose O are held before they are folded into one fp32 pass (merge_strided.RunningMerge).
# Held to the end, a prompt chunk's passes grow with its past: OPT-13B, 8,192 new tokens over a 24K past made 16
# flash outputs of 84 MB (1.3 GB, at the step's peak of GPU memory). H200, 2026-12-03, OPT-13B 3 x 32K with 8 held:
# the allocated peak 0.49 GB lower, the reserved one 0.17 GB (24 slots; results/h200/README.md, twenty-eighth
# session); TPOT 1.009x swap's (0.993-1.007x before, within swap's own spread there).
STREAM_HELD_PASSES = 8


def fold_count(passes: int, held: int = STREAM_HELD_PASSES) -> int:
    """Folds of `passes` passes merged as they come with at most `held` held (merge_strided.RunningMerge): the
    first once held + 1 have come, then one per held - 1 more."""
    check(held >= 2 and passes >= 0, f"need held >= 2 and passes >= 0; got held={held}, passes={passes}")
    return 0 if passes <= held else ceil_div(passes - held, held - 1)


def stream_prefill_traffic(
    q_len: int,
    past_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    causal: bool = True,
    chunk_bytes: int = STREAM_CHUNK_BYTES,
) -> Traffic:
    """Traffic of the prefill `stream` variant as serving runs it (pass_kernel "flash", every past token on the
    host): the copy engine writes the past into an HBM ring in chunks of chunk_bytes of K (and as much V); one
    FlashAttention pass per chunk reads Q and the chunk and writes its O, a causal pass over the new tokens reads
    Q and the new K/V and writes its O, and the merge reads every pass's O and writes the output; past
    STREAM_HELD_PASSES passes each fold (fold_count) writes an fp32 running O that the next fold or the merge
    reads. No partial state per KV tile, where the tiled kernel's closed form (prefill_traffic) has one. (What made
    the simulation's stream chunks slow was their FLOP rate rather than these bytes:
    costmodel.Efficiency.flash_attention.)"""
    heads = _Heads(num_heads, num_kv_heads, head_dim, dtype_bytes)
    check(q_len >= 1 and past_len >= 0, f"need q_len >= 1 and past_len >= 0; got {q_len}, {past_len}")
    chunk_tokens = max(1, chunk_bytes // (num_kv_heads * head_dim * dtype_bytes))
    passes = 1 + ceil_div(past_len, chunk_tokens)
    sums = _NewTileSums.of(q_len, 64, 64, causal)
    flops = 4 * head_dim * num_heads * (q_len * past_len + sums.rows_tokens)
    past, new, out = past_len * heads.kv_tok, q_len * heads.kv_tok, q_len * heads.row
    merge = 0 if passes == 1 else passes * out  # each pass's O read once by the merge (a single pass is the output)
    running = fold_count(passes) * q_len * num_heads * head_dim * 4  # the folds' fp32 O, written and read once each
    return Traffic(
        link_read_bytes=past,
        hbm_read_bytes=passes * out + past + new + merge + running,  # Q per pass, the ring, the new K/V, the merge
        hbm_write_bytes=past + passes * out + (out if passes > 1 else 0) + running,  # + each pass's O, the output
        flops=flops,
    )


def sdpa_chunk_traffic(q_len: int, past_len: int, *, num_heads: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> Traffic:
    """HBM bytes and FLOPs of one serving prompt chunk attended by torch SDPA over HBM pages
    (engine.gpu.hbm_prefill.sdpa_chunk; none on the link): with a past, the buffer's fill reads the past and
    the new K/V and writes them (none without: the new K/V are attended where they are); the call reads Q and
    all K/V once and writes O (FlashAttention's schedule, K/V re-reads from L2 not counted); the FLOPs of the past
    and of the new tokens' causal triangle."""
    heads = _Heads(num_heads, num_kv_heads, head_dim, dtype_bytes)
    check(q_len >= 1 and past_len >= 0, f"need q_len >= 1 and past_len >= 0; got {q_len}, {past_len}")
    kv_tok, row, keys = heads.kv_tok, heads.row, past_len + q_len
    fill = keys * kv_tok if past_len else 0
    return Traffic(hbm_read_bytes=fill + keys * kv_tok + q_len * row, hbm_write_bytes=fill + q_len * row,
                   flops=4 * head_dim * num_heads * (q_len * past_len + q_len * (q_len + 1) // 2))


def proj_attention_traffic(
    q_len: int,
    past_len: int,
    *,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    variant: str,
    causal: bool = True,
    tile_q: int = 64,
    tile_kv: int = 64,
    past_hbm_tokens: int = 0,
    new_hbm_tokens: int = 0,
) -> Traffic:
    """Traffic of `proj_attention` (x `[q_len, hidden]`); new_hbm_tokens of the new tokens' cache slots sit
    in HBM pages (default: all host). RoPE adds no bytes and its FLOPs are not counted."""
    check_variant("proj_attention", variant, PROJ_VARIANTS)
    check_tiles(tile_q=tile_q, tile_kv=tile_kv)
    check(
        q_len >= 1 and past_len >= 0 and hidden >= 1,
        f"need q_len >= 1, past_len >= 0, hidden >= 1; got {q_len}, {past_len}, {hidden}",
    )
    _check_split("past_hbm_tokens", past_hbm_tokens, past_len)
    _check_split("new_hbm_tokens", new_hbm_tokens, q_len)
    heads = _Heads(num_heads, num_kv_heads, head_dim, dtype_bytes)
    e, q_cols, kv_cols = dtype_bytes, num_heads * head_dim, num_kv_heads * head_dim
    fused = variant == "fused"
    attention = _attention(
        heads, q_len, past_len, past_hbm_tokens, kv_outer=True, causal=causal, tile_q=tile_q,
        tile_kv=tile_kv, new_kv="projected" if fused else "pages", new_hbm_tokens=new_hbm_tokens,
    )  # fmt: skip
    nq, nk = ceil_div(q_len, tile_q), ceil_div(q_len, tile_kv)
    if fused:  # Q projected per Q tile; K/V per new K/V tile inside the loop: x is read twice
        weight_reads = nq * q_cols + nk * 2 * kv_cols
        x_reads = 2 * q_len
    else:  # one projection kernel: per row tile, x rows once and all three weights
        weight_reads = nq * (q_cols + 2 * kv_cols)
        x_reads = q_len
    projection = Traffic(
        link_write_bytes=(q_len - new_hbm_tokens) * heads.kv_tok,
        hbm_read_bytes=(x_reads + weight_reads) * hidden * e,
        hbm_write_bytes=q_len * heads.row + new_hbm_tokens * heads.kv_tok,
        flops=2 * q_len * hidden * (q_cols + 2 * kv_cols),
    )
    return attention + projection


# stream (CUDA only): B staged by the copy engine into an HBM ring panel by panel, each panel multiplied by
# cuBLAS. Its closed form is here; the reference backend has no stream loop to count.
GEMM_TRAFFIC_VARIANTS = (*GEMM_VARIANTS, "stream", "ring")
RING_TILE_M, RING_TILE_N = 256, 128  # gemm variant ring: C rows x columns a tile


def gemm_traffic(
    m: int,
    n: int,
    k: int,
    *,
    dtype_bytes: int,
    variant: str,
    b_tier: str = "host",
    tile_m: int = 128,
    tile_n: int = 128,
    tile_k: int = 64,
    panel_cols: int | None = None,
    panel_rows: int | None = None,
    c_bytes: int | None = None,
) -> Traffic:
    """Traffic of `gemm`: A `[m, k]` in HBM, B `[k, n]` in b_tier, C `[m, n]` of c_bytes per element
    (default: A's dtype_bytes).

    stream (the tiles do not apply; exactly one of panel_cols, B columns per panel, or panel_rows, B rows per
    panel, is required and belongs to it alone): B crosses the link once, by the copy engine (from HBM when
    b_tier is "hbm"), is written into the ring and read back from it by cuBLAS. Column panels: A is read
    once per panel (cuBLAS's own tiling inside a panel is left to L2), C written once. Row panels: each
    panel reads its own columns of A, so A once in all; C is written by every panel and read back by every
    panel after the first (beta = 1).

    ring (the tiles do not apply): B crosses the link once, by SM loads, into an HBM ring (whole units of 64 k
    rows x one strip, padded with zeros) from which every RING_TILE_M-row tile reads it back; A is read once per
    RING_TILE_N-column strip, C written once.
    """
    check_variant("gemm", variant, GEMM_TRAFFIC_VARIANTS)
    check(b_tier in TIERS, f"unknown b_tier {b_tier!r}; valid: {', '.join(TIERS)}")
    check_tiles(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k)
    check(min(m, n, k, dtype_bytes) >= 1, f"need m, n, k, dtype_bytes >= 1; got {m}, {n}, {k}, {dtype_bytes}")
    e = dtype_bytes
    ce = e if c_bytes is None else c_bytes
    check(isinstance(ce, int) and ce >= 1, f"c_bytes must be a positive int; got {c_bytes!r}")
    if variant == "stream":
        given = [p for p in (panel_cols, panel_rows) if p is not None]
        check(len(given) == 1 and isinstance(given[0], int) and given[0] >= 1, f"gemm variant 'stream' needs "
              f"exactly one of panel_cols / panel_rows, a positive int; got {panel_cols!r} / {panel_rows!r}")
        b_bytes = k * n * e
        if panel_cols is not None:
            a_reads, c_passes = ceil_div(n, panel_cols) * m * k * e, 1
        else:
            a_reads, c_passes = m * k * e, ceil_div(k, panel_rows)
        traffic = Traffic(hbm_read_bytes=b_bytes + a_reads + (c_passes - 1) * m * n * ce,
                          hbm_write_bytes=b_bytes + c_passes * m * n * ce, flops=2 * m * n * k)
        if b_tier == "host":
            traffic.link_read_bytes += b_bytes
        else:
            traffic.hbm_read_bytes += b_bytes
        return traffic
    check(panel_cols is None and panel_rows is None, f"panel_cols / panel_rows are options of gemm variant "
          f"'stream'; got {panel_cols!r} / {panel_rows!r} for {variant!r}")
    if variant == "ring":  # the tiles do not apply: the kernel's own are RING_TILE_M x RING_TILE_N
        # B crosses the link once into the HBM ring and is read back by every row tile; A is read once per column
        # strip (L2 serves the band's other strips, which this does not count); C is written once. The ring holds
        # whole units of 64 k rows x one strip, zeros past k and n included
        b_bytes = k * n * e
        ring_bytes = ceil_div(k, 64) * 64 * ceil_div(n, RING_TILE_N) * RING_TILE_N * e
        traffic = Traffic(hbm_read_bytes=ceil_div(n, RING_TILE_N) * m * k * e + ceil_div(m, RING_TILE_M) * ring_bytes,
                          hbm_write_bytes=ring_bytes + m * n * ce, flops=2 * m * n * k)
        if b_tier == "host":
            traffic.link_read_bytes += b_bytes
        else:
            traffic.hbm_read_bytes += b_bytes
        return traffic
    b_reads = k * n * e * (ceil_div(m, tile_m) if variant == "naive" else 1)
    hbm_read = m * k * e * ceil_div(n, tile_n)  # A is re-read for every column of C tiles in both orders
    hbm_write = m * n * ce
    if (
        variant != "naive"
    ):  # float32 partial C written after every k step but the last, read before all but the first
        partial = (ceil_div(k, tile_k) - 1) * m * n * 4
        hbm_read += partial
        hbm_write += partial
    traffic = Traffic(hbm_read_bytes=hbm_read, hbm_write_bytes=hbm_write, flops=2 * m * n * k)
    if b_tier == "host":
        traffic.link_read_bytes += b_reads
    else:
        traffic.hbm_read_bytes += b_reads
    return traffic
