"""The systems under test, as policies: where KV lives, how attention reaches it, and what it costs.

Each system is one frozen policy (FlexGen style: all knobs in one object). The simulation executor asks a
system for the time of a step on a cost model and for its GPU memory; the GPU executor (issue 4) will run
the same policies for real.

* ``hbm``      SGLang-like: all KV in HBM, attention from HBM.
* ``directkv`` KV in pinned host memory, attention kernels read it zero-copy (variant naive | tiled | fused),
  or (variant stream, beyond the paper) through small HBM rings filled by the copy engine (the decodes' 384 MiB
  at most by default, in 3 slots of 64 MiB of K and as much V; the first prompt chunk's in up to 12 slots of 16
  MiB), filled ahead of their readers while
  the GPU does the dense work and other attention math (stream_attention).
* ``swap``     Pie-like: KV in host memory; each layer's KV is copied by the copy engine into an HBM staging
               buffer (double-buffered) while the previous layer computes.
* ``cpu_attn`` Neo-like: decode attention runs on the CPU over host KV, overlapped with the GPU's linear
               layers; prefill runs on the GPU with past KV copied in.
* ``flexgen``  FlexGen-like: KV stored 4-bit group-wise (group 64, fp16 min/max) in host memory, copied in,
               dequantised and attended in HBM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from directkv.costmodel import CostModel
from directkv.engine import step_traffic as st
from directkv.engine.state import Step
from directkv.errors import ConfigError, check, unknown_name
from directkv.host_time import eager
from directkv.kernels.reference.common import ceil_div
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import (
    SERVING_STREAM_CHUNK_MIB,
    SERVING_STREAM_SLOTS,
    STREAM_CHUNK_BYTES,
    STREAM_MIN_CHUNK_BYTES,
    decode_ring,
    prefill_ring_slots,
    sdpa_chunk_traffic,
    stream_reads_in_place,
    stream_ring_bytes,
)
from directkv.specs import ModelSpec

SYSTEMS = ("directkv", "hbm", "swap", "cpu_attn", "flexgen")
DIRECTKV_VARIANTS = ("naive", "tiled", "fused", "stream")
FLEXGEN_BITS, FLEXGEN_GROUP = 4, 64


# How cpu_attn's decode attention runs on the CPU (measured serving): "native" attends every decode of the
# layer in one OpenMP call (directkv.kernels.cpu_decode_attention); "flash" calls torch's CPU flash-attention
# kernel once per run of pages of every decode (a dozen torch calls per decode per layer). native is the
# default: on the H200 host it served Alpaca at 30 req/s at 71 ms per token against flash's 604 (2026-11-29).
CPU_ATTN_KERNELS = ("native", "flash")
DEFAULT_CPU_ATTN_KERNEL = "native"
# a prompt chunk over HBM pages (hbm's cache; the staged systems' staging pool): our tiled kernel, or torch SDPA
# (executor.hbm_prefill; engine.gpu.hbm_prefill), measured and simulated alike (hbm_attention)
HBM_PREFILLS = ("kernel", "sdpa")
# what attends a directkv prompt chunk with no past (executor.directkv_no_past_prefill): its K/V are the
# projection's output in HBM, so SDPA (FlashAttention) needs no gather; the kernel is the paper's path. sdpa is
# the default: on the H200 it took OPT-13B 3 x 16K from 632.0 / 630.0 to 621.7 / 619.7 ms per token and its TTFT
# from ~3.24 to ~2.99 s (stream, one process each, both orders; 2026-12-02); no loss on ShareGPT 10 req/s (34.6
# against 35.3 ms, inside that point's run-to-run spread). Measured with stream only; tiled / naive take it too
NO_PAST_PREFILLS = ("kernel", "sdpa")
DEFAULT_NO_PAST_PREFILL = "sdpa"
# CTAs of directkv's side-stream decode kernel when pipelined: fewer leave SMs to the other part's dense
# layers (H200, 4K x 4: 32 CTAs 53.9 ms per token, 64 53.1, 128 57.0, uncapped 60.4)
DEFAULT_DIRECTKV_SIDE_CTAS = 64
# Pipelining cuts a step only when its decodes read at least this many MB of host K/V per layer: each part
# reads all of the layer's weights again (~0.3 ms per layer and part with graphs on the H200), which costs
# more than the link time it hides when that is short. H200, Llama-3.1-8B batch 4 (2026-11-29): at 1K
# (16 MB per layer) pipelined took 19.7-29.9 ms per token against 20.8-21.4 as one batch; at 4K (64 MB) it
# gained 3-7%. With this guard, one batch vs pipelined in one call: 4K 56.5 vs 51.1, 2K (32 MB) 32.8 vs 28.9,
# 1K (whole steps) 20.9 vs 20.3.
DEFAULT_PIPELINE_MIN_KV_MB = 32.0


@dataclass(frozen=True)
class SystemPolicy:
    name: str
    variant: str = ""  # kernel variant for directkv
    tile_q: int = 64
    tile_kv: int = 128  # see conf/exp/kernel_ablation.yaml: the SMEM filter of the paper

    def __post_init__(self) -> None:
        if self.name not in SYSTEMS:
            raise unknown_name("system", self.name, SYSTEMS)
        if self.name == "directkv" and self.variant not in DIRECTKV_VARIANTS:
            raise ConfigError(f"unknown directkv variant {self.variant!r}; valid: {', '.join(DIRECTKV_VARIANTS)}")

    @property
    def kv_tier(self) -> str:
        return "hbm" if self.name == "hbm" else "host"

    def kv_bytes_per_token(self, model: ModelSpec) -> int:
        if self.name != "flexgen":
            return model.kv_bytes_per_token()
        values = model.num_layers * 2 * model.kv_dim
        # 4-bit codes plus an fp16 min and max per group of 64 values
        return values * FLEXGEN_BITS // 8 + (values // FLEXGEN_GROUP) * 2 * 2

    @property
    def label(self) -> str:
        return f"{self.name}-{self.variant}" if self.variant else self.name


def stream_parts(step: Step, model: ModelSpec, page_size: int) -> tuple[Step, Step]:
    """directkv `stream`'s step as the executor splits it: (the decodes and the prompt chunks it streams, the
    chunks of a small past it reads in place with the tiled kernel; stream_reads_in_place)."""
    page_bytes = page_size * model.kv_bytes_per_token_per_layer() // 2  # of K
    small = [stream_reads_in_place(c.past_len, c.chunk_len, page_size, page_bytes) for c in step.prefills]
    return (Step(step.decodes, tuple(c for c, s in zip(step.prefills, small, strict=True) if not s)),
            Step((), tuple(c for c, s in zip(step.prefills, small, strict=True) if s)))


def stream_attention(step: Step, model: ModelSpec, cm: CostModel, policy: SystemPolicy, t_lin: float,
                     page_size: int, stream_slots: int, stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB,
                     no_past_prefill: str = DEFAULT_NO_PAST_PREFILL) -> tuple[float, int, Traffic]:
    """(seconds of one layer's attention, HBM its rings hold, its traffic) for directkv `stream`, as the executor
    runs a layer:
    dense work (`t_lin`), the new K/V stored to host by SM writes, the decodes' kernel, then the prompt chunks'.
    The copy engine moves the tiled kernel's bytes into rings of bounded size, ahead of their readers by at most
    what a ring holds: the first prompt chunk's ring fills during the dense work and the store (its slots are
    busy during its own attention), the decodes' ring during those and the attention's math (the next layer's
    decode copies are queued at the step's start). A chunk's past beyond its ring is read while its math runs;
    the decodes' beyond theirs stalls their kernel; and no layer beats its link time. So a larger decode ring
    helps a step whose prompt chunk's attention is long (measured on the H200: steps of 2 decodes + a
    2,046-token chunk at 16K took 1.24x swap's time with 2 slots, 0.98x with 8; seventeenth session), and the
    first chunk's ring, of as many slots up to one per 16 MiB chunk of its past's K (prefill_ring_slots), one
    whose past is long beside a large chunk's dense work (OPT-13B 3 x 16K). A prompt
    chunk of a small past (twice as long for a prompt's short tail) is read in place by the tiled kernel at the SM
    rate (stream_reads_in_place). The decode ring holds stream_slots x 16 MiB of K in slots of stream_chunk_mib
    (decode_ring); each ring chunk of a layer's decode read is a kernel of its own, charged a launch, so fewer,
    larger slots cost less (H200, 2026-12-02, Llama batch 4 32K: stream's step 121.0 ms with 16 MiB slots, 16-17
    chunks per layer, 118.3 with 64 MiB, 4-5; 12 launches x 32 layers at 5 us are 1.9 ms of that). The host time
    each chunk also costs (on ShareGPT the host's queueing per step fell 4.9 ms with the same change) is not
    modelled. no_past_prefill "sdpa": a chunk with no past is one SDPA call over its own K/V (zero_copy_attention)."""
    kvl = model.kv_bytes_per_token_per_layer()
    streamed, in_place = stream_parts(step, model, page_size)
    chunks = streamed.prefills
    first = chunks[0].past_len * kvl if chunks and chunks[0] is step.prefills[0] else 0  # the kept ring's chunk
    reads = [sum(step.decode_kv_lens) * kvl, first]
    # the kept ring holds a slot per ring chunk of that past (whole pages of up to 16 MiB of K, as
    # prefill_stream cuts them), up to stream_slots, so that many are copied ahead of the attention
    chunk_pages = STREAM_CHUNK_BYTES // (page_size * kvl // 2)
    first_chunks = ceil_div(ceil_div(chunks[0].past_len, page_size), chunk_pages) if first else 0
    decode_slots, decode_chunk = decode_ring(stream_slots, stream_chunk_mib)
    sizes = [stream_ring_bytes(decode_slots, reads[0], chunk_bytes=decode_chunk),
             stream_ring_bytes(prefill_ring_slots(first_chunks, stream_slots), first, floor=0)]
    t, traffic = 0.0, Traffic()  # a part with no kernel to run is charged nothing
    if step.decodes or chunks:
        decode_traffic = st.attention_traffic(Step(step.decodes, ()), model, "stream", policy)
        chunk_traffic = st.attention_traffic(Step((), chunks), model, "stream", policy)
        traffic = decode_traffic + chunk_traffic
        terms = cm.terms(traffic, link="ce")
        # the chunks' passes are FlashAttention's (flash_attention), the decodes' kernel ours (attention)
        terms["compute"] = (cm.terms(decode_traffic)["compute"]
                            + cm.terms(chunk_traffic, flops_kind="flash_attention")["compute"])
        link = terms.pop("link_read")
        terms.pop("link_write")  # the store of their new K/V: SM writes through the view, before the kernels
        store = cm.terms(Traffic(link_write_bytes=traffic.link_write_bytes), link="sm")["link_write"]
        link_chunks = cm.terms(chunk_traffic, link="ce")["link_read"]
        math_t = max(terms.values())  # the kernels' math and HBM traffic
        ahead_chunk = min(t_lin + store, cm.copy_time(min(reads[1], sizes[1]), launch=False))
        left_chunks = max(0.0, link_chunks - ahead_chunk)
        # the copy engine is free for the decodes' ring when it is not filling the chunk's: during the dense work
        # and the store, and during the chunks' math once their remaining past is copied
        free = t_lin + store - ahead_chunk + max(0.0, math_t - left_chunks)
        left_decodes = max(0.0, link - link_chunks - min(free, cm.copy_time(min(reads[0], sizes[0]), launch=False)))
        # the decodes' kernel per ring chunk of their read (slots sized as plan_stream sizes them), a chunk's one
        decode_k = reads[0] // 2
        decode_chunks = ceil_div(decode_k, min(decode_chunk, max(decode_k, STREAM_MIN_CHUNK_BYTES))) if decode_k else 0
        kernels = decode_chunks + len(chunks)
        t = max(store + left_decodes + max(math_t, left_chunks), link - t_lin) + kernels * cm.hw.launch_us * 1e-6
    # the chunks it reads in place timed as directkv tiled times them (so a step of in-place chunks costs what
    # tiled's does), their bytes tiled's, not a ring's; those with no past by SDPA under no_past_prefill sdpa
    in_place_traffic, store_t, kernels_t = zero_copy_attention(in_place, model, cm, policy, "tiled", no_past_prefill)
    return t + store_t + kernels_t, sum(sizes), traffic + in_place_traffic


def check_hbm_prefill(name: object) -> str:
    """`name` if it is one of HBM_PREFILLS, else the one-line ConfigError naming the valid ones."""
    if name not in HBM_PREFILLS:
        raise unknown_name("executor.hbm_prefill", name, HBM_PREFILLS)
    return str(name)


def check_no_past_prefill(name: object) -> str:
    """`name` if it is one of NO_PAST_PREFILLS, else the one-line ConfigError naming the valid ones."""
    if name not in NO_PAST_PREFILLS:
        raise unknown_name("executor.directkv_no_past_prefill", name, NO_PAST_PREFILLS)
    return str(name)


def sm_store_time(cm: CostModel, nbytes: int) -> float:
    """Seconds of storing `nbytes` of new K/V into host memory by SM writes through a zero-copy view, as every
    system with a host tier stores each layer's new K/V on the GPU's main stream (scatter_rows; FlexGen's codes by
    indexed assignment into the view, after its quantisation, which is not charged here), before the layer's
    attention: charged in series with it, not inside its roofline, where it hid behind the kernel's reads or math,
    which on the H200 it does not (OPT-13B 3 x 16K, 2026-12-02: a step of an 8K chunk over an 8K past took 181-192
    ms more than one with no past in both systems, the past's attention alone)."""
    return cm.terms(Traffic(link_write_bytes=nbytes), link="sm")["link_write"] if nbytes else 0.0


def hbm_attention(step: Step, model: ModelSpec, cm: CostModel, policy: SystemPolicy,
                  hbm_prefill: str = "kernel", *, store_bytes: int = 0) -> tuple[Traffic, float]:
    """(traffic, seconds) of one layer's attention over HBM pages (hbm's cache, the staged systems' staging pool),
    as the GPU executor runs it: our tiled kernel; with hbm_prefill "sdpa" the prompt chunks by one SDPA call
    each (sdpa_chunk_traffic, at FlashAttention's fitted efficiency, with the store of the chunk's new K/V that
    the kernel's traffic holds) beside the decodes' kernel. store_bytes: more HBM written by the store of the
    step's new K/V (hbm), charged with the kernel (with the decodes' under sdpa)."""
    check_hbm_prefill(hbm_prefill)
    store = Traffic(hbm_write_bytes=store_bytes)
    if hbm_prefill == "kernel" or not step.prefills:
        attn = st.to_hbm(st.attention_traffic(step, model, "tiled", policy)) + store
        return attn, cm.time(attn)
    total = store  # the decodes' kernel, with the store
    if step.decodes:
        total = total + st.to_hbm(st.attention_traffic(Step(step.decodes, ()), model, "tiled", policy))
    t = cm.time(total) if step.decodes or store_bytes else 0.0
    return sdpa_chunks(step.prefills, model, cm, total, t, store_link=False)


def sdpa_chunks(chunks: tuple, model: ModelSpec, cm: CostModel, total: Traffic, t: float, *,
                store_link: bool) -> tuple[Traffic, float]:
    """(total, t) with one SDPA call per prompt chunk added, each timed alone at FlashAttention's fitted
    efficiency, and the store of the chunk's new K/V in `total`: to HBM, in the call's roofline, or over the link
    by SM writes (store_link: directkv's host tier), which `t` leaves to the caller (sm_store_time)."""
    shape, kvl = st.head_shape(model), model.kv_bytes_per_token_per_layer()
    for c in chunks:
        store = c.chunk_len * kvl
        chunk = sdpa_chunk_traffic(c.chunk_len, c.past_len, **shape) + (
            Traffic(link_write_bytes=store) if store_link else Traffic(hbm_write_bytes=store))
        total, t = total + chunk, t + cm.time(replace(chunk, link_write_bytes=0), flops_kind="flash_attention")
    return total, t


def split_no_past(step: Step, no_past_prefill: str) -> tuple[Step, tuple]:
    """(the step without its prompt chunks that have no past, those chunks) where no_past_prefill is "sdpa" (they
    are attended by SDPA: zero_copy_attention); else (the step, ())."""
    no_past = tuple(c for c in step.prefills if c.past_len == 0) if no_past_prefill == "sdpa" else ()
    if not no_past:
        return step, ()
    return Step(step.decodes, tuple(c for c in step.prefills if c.past_len)), no_past


def zero_copy_attention(step: Step, model: ModelSpec, cm: CostModel, policy: SystemPolicy, variant: str,
                        no_past_prefill: str) -> tuple[Traffic, float, float]:
    """(traffic, seconds of the store, seconds of the kernels) of one layer's attention of `step` by directkv's
    zero-copy kernel `variant`, as the executor runs it: the store of the step's new K/V to the host tier by SM
    writes first (sm_store_time), then the kernel over the rest of the step, then, under no_past_prefill sdpa, one
    SDPA call per chunk with no past over its own K/V (FlashAttention's fitted efficiency, as hbm_attention charges
    it; split_no_past). The kernel's one roofline for the step lets the decodes' link reads overlap a chunk's math
    where SDPA's calls come after them, so beside decodes the model may call sdpa the slower of the two."""
    rest, no_past = split_no_past(step, no_past_prefill)
    traffic, kernels = Traffic(), 0.0  # no kernel to run is charged nothing
    if rest.decodes or rest.prefills:
        traffic = st.attention_traffic(rest, model, variant, policy)
        kernels = cm.time(replace(traffic, link_write_bytes=0), link="sm")
    traffic, kernels = sdpa_chunks(no_past, model, cm, traffic, kernels, store_link=True)
    return traffic, sm_store_time(cm, traffic.link_write_bytes), kernels


def directkv_row_columns(policy: SystemPolicy, stream_slots: int, stream_chunk_mib: int, no_past_prefill: str) -> dict:
    """The columns a directkv result row carries, measured or simulated: what attended its prompt chunks with no
    past; a `stream` row also the slots its rings' HBM is counted in and the K per decode ring slot."""
    if policy.name != "directkv":
        return {}
    stream = {"directkv_stream_slots": stream_slots, "directkv_stream_chunk_mib": stream_chunk_mib}
    return (stream if policy.variant == "stream" else {}) | {"directkv_no_past_prefill": no_past_prefill}


@dataclass(frozen=True)
class StepCost:
    time_s: float
    traffic: Traffic  # summed over layers: link/HBM bytes the step moved
    staging_bytes: int  # HBM staging buffer this step needed (swap / flexgen / cpu_attn prefill)


def step_cost(policy: SystemPolicy, step: Step, model: ModelSpec, cm: CostModel,
              pipelining: Pipelining | None = None, *, page_size: int = 16,
              stream_slots: int = SERVING_STREAM_SLOTS, stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB,
              hbm_prefill: str = "kernel", no_past_prefill: str = DEFAULT_NO_PAST_PREFILL,
              graphs: bool = True) -> StepCost:
    """Time of one engine step for `policy`, by layer: linear work + the system's attention path. With
    `pipelining` enabled, directkv's steps that the measured executor cuts run as two parts
    (pipelined_step_cost). page_size: tokens per KV page (directkv stream's in-place rule counts pages).
    stream_slots: directkv stream's rings' HBM in 16 MiB slots of K (executor.directkv_stream_slots), which bounds
    how much of a layer's decode K/V is copied while the GPU does other work (stream_attention); the decode ring
    holds it in slots of stream_chunk_mib MiB of K (executor.directkv_stream_chunk_mib; decode_ring). hbm_prefill: what attends
    prompt chunks over HBM pages in hbm, swap, flexgen and cpu_attn (executor.hbm_prefill; hbm_attention).
    no_past_prefill: what attends directkv's prompt chunks with no past (executor.directkv_no_past_prefill:
    its kernel, or one SDPA call each, zero_copy_attention). graphs: the executor's CUDA graphs
    (executor.cuda_graphs), which cpu_attn's layer needs: a part above the graphs issues eagerly (cpu_attn_layer)."""
    if pipelining is not None and policy.name == "directkv":
        cut = pipelining.cut(policy, step, model.kv_bytes_per_token_per_layer())
        if cut is not None:
            return pipelined_step_cost(policy, step, cut, model, cm, no_past_prefill)
    L = model.num_layers
    lin = st.linear_layer_traffic(model, step.num_tokens)
    t_lin = cm.dense_time(lin)
    head = st.lm_head_traffic(model, step.num_logits)
    t_head = cm.time(head, flops_kind="matmul")
    kvl = model.kv_bytes_per_token_per_layer()
    new_kv = step.num_tokens * kvl  # K/V of this step's tokens, one layer
    past = st.past_kv_tokens(step) * kvl  # K/V bytes of cached tokens the step attends to, one layer

    name = policy.name
    if name == "hbm":
        attn, t_attn = hbm_attention(step, model, cm, policy, hbm_prefill, store_bytes=new_kv)
        layer_t, layer_traffic, staging = t_lin + t_attn, lin + attn, 0
    elif name == "directkv":
        if policy.variant == "stream":
            attn_t, staging, attn = stream_attention(step, model, cm, policy, t_lin, page_size, stream_slots,
                                                      stream_chunk_mib, no_past_prefill)
        else:
            attn, store_t, kernels_t = zero_copy_attention(step, model, cm, policy, policy.variant, no_past_prefill)
            attn_t, staging = store_t + kernels_t, 0
        layer_t, layer_traffic = t_lin + attn_t, lin + attn
    elif name in ("swap", "flexgen"):
        ratio = policy.kv_bytes_per_token(model) / model.kv_bytes_per_token()  # < 1 for FlexGen's 4-bit KV
        stored, new_stored = int(past * ratio), int(new_kv * ratio)
        copy_in = cm.copy_time(stored, "h2d")
        attn, t_attn = hbm_attention(step, model, cm, policy, hbm_prefill)
        t_gpu = t_lin + sm_store_time(cm, new_stored) + t_attn  # the store: SM writes before the attention
        if name == "flexgen":  # unfused dequantisation: read codes, write bf16, in HBM
            t_gpu += cm.time(Traffic(hbm_read_bytes=stored, hbm_write_bytes=past), hbm_eff=cm.eff.dequant_hbm)
            t_gpu += cm.layer_overhead("flexgen")
        layer_t = max(copy_in, t_gpu)  # the copy of layer i+1 overlaps the compute of layer i
        layer_traffic = lin + attn + Traffic(link_read_bytes=stored, link_write_bytes=new_stored)
        staging = 2 * stored + (2 * past if name == "flexgen" else 0)
    elif name == "cpu_attn":
        cut = (pipelining or NO_PIPELINING).cut(policy, step, kvl)
        layer_t, layer_traffic, staging = cpu_attn_layer(step, cut, model, cm, policy, hbm_prefill, graphs)
    else:  # pragma: no cover - SystemPolicy validates names
        raise AssertionError(name)
    return StepCost(L * layer_t + t_head, layer_traffic.scaled(L) + head, staging)


def cpu_attn_layer(step: Step, cut: int | None, model: ModelSpec, cm: CostModel, policy: SystemPolicy,
                   hbm_prefill: str, graphs: bool = True) -> tuple[float, Traffic, int]:
    """cpu_attn's (Neo-like) layer: (seconds, traffic, HBM staging bytes). Decode attention runs on the CPU over the
    host pages, each decode's Q and O crossing the link; a prompt chunk attends on the GPU over its past, copied in
    (staged like swap's) during the layer.

    A decode-only step the executor cuts (`cut`: the first part's rows, Pipelining.cut) runs as two parts
    (runner.forward_pipelined): the GPU does both parts' dense work, the CPU worker both parts' attention, and each
    part waits for its own attention, with its handoffs (Q to the host, the worker's wake-up, O back:
    Efficiency.cpu_attn_us_per_layer), before its next layer, so a layer takes the longest of those four sums.
    Any other step is one batch (CpuAttnPath.attend): the host's blocking copy of the decodes' Q returns after the
    layer's dense work and store, then queues the prompt chunk's GPU attention, which runs while the CPU attends,
    and O goes back after both; the next layer's dense work waits for it, so the parts add up rather than overlap
    (H200, 2026-12-02, ShareGPT 10 req/s: mixed steps of ~42 decodes and ~244 prompt tokens took 78 ms measured
    against 48 simulated as an overlap). Waiting on the CPU drains the GPU's queue, so a part with decodes too
    large for the CUDA graphs (host_time.GRAPH_MAX_TOKENS rows, or `graphs` off) runs its dense kernels only as
    fast as the host issues them (the runner's eager issue time per layer, hbm's fit: every system shares the
    runner)."""
    kvl = model.kv_bytes_per_token_per_layer()
    h = cm.layer_overhead("cpu_attn")

    def part(decodes: tuple, prefills: tuple) -> tuple[float, float, Traffic]:
        """(GPU seconds before the CPU can start, CPU seconds, traffic) of one part's layer."""
        p = Step(decodes, prefills)
        lin = st.linear_layer_traffic(model, p.num_tokens)
        dec_tokens = sum(p.decode_kv_lens)
        qo = len(decodes) * 2 * model.q_dim * model.dtype_bytes  # Q out and O back
        new_kv = p.num_tokens * kvl
        gpu = cm.dense_time(lin) + sm_store_time(cm, new_kv) + cm.copy_time(qo)
        if decodes and eager(p.num_tokens, graphs):
            gpu = max(gpu, cm.runner_eager_s)
        cpu = (cm.cpu_attention_time(dec_tokens * kvl, dec_tokens * model.num_heads)
               + len(decodes) * cm.eff.cpu_attn_us_per_decode * 1e-6)
        return gpu, cpu, lin + Traffic(link_read_bytes=qo // 2, link_write_bytes=new_kv + qo // 2)

    if cut is not None:
        (g0, c0, t0), (g1, c1, t1) = part(step.decodes[:cut], ()), part(step.decodes[cut:], ())
        return max(g0 + g1, c0 + c1, g0 + c0 + h, g1 + c1 + h), t0 + t1, 0
    gpu, cpu, traffic = part(step.decodes, step.prefills)
    # prefill attention stays on the GPU, its past staged in HBM by copies that overlap the layer
    pre, t_pre = hbm_attention(st.only_prefills(step), model, cm, policy, hbm_prefill)
    pre_past = st.past_kv_tokens(st.only_prefills(step)) * kvl
    attend = h + max(cpu, t_pre) if step.decodes else t_pre
    layer_t = max(gpu + attend, cm.copy_time(pre_past, "h2d"))
    return layer_t, traffic + pre + Traffic(link_read_bytes=pre_past), 2 * pre_past


def pipelined_step_cost(policy: SystemPolicy, step: Step, cut: int, model: ModelSpec, cm: CostModel,
                        no_past_prefill: str = DEFAULT_NO_PAST_PREFILL) -> StepCost:
    """directkv's step as two parts, rows [0, cut) and the rest (Pipelining.cut): each part's projections and
    MLP (reading all the weights again) run on the main stream while the other part's zero-copy attention runs
    on a side stream. Per layer the main stream does both parts' dense work and stores, the link both parts' attention,
    and each part waits for its own attention before its next dense work, so a layer takes the longest of
    those four sums. no_past_prefill "sdpa": the second part's chunks with no past by SDPA (zero_copy_attention)."""
    # a mixed step is cut at its last decode (Pipelining.cut), so its chunks all go to the second part
    parts = [Step(step.decodes[:cut], ()), Step(step.decodes[cut:], step.prefills)]
    lin = [st.linear_layer_traffic(model, p.num_tokens) for p in parts]
    dense = [cm.dense_time(t) for t in lin]
    # each part's store of its new K/V runs on the main stream (attend_async) before its attention goes to the
    # side stream: with the dense work there, and before its own attention
    attn, store, t_attn = zip(*(zero_copy_attention(p, model, cm, policy, policy.variant, no_past_prefill)
                                for p in parts), strict=True)
    main = [d + s for d, s in zip(dense, store, strict=True)]
    layer_t = max(sum(main), sum(t_attn), main[0] + t_attn[0], main[1] + t_attn[1])
    head = st.lm_head_traffic(model, step.num_logits)
    t_head = cm.time(head, flops_kind="matmul")
    layer_traffic = lin[0] + lin[1] + attn[0] + attn[1]
    return StepCost(model.num_layers * layer_t + t_head, layer_traffic.scaled(model.num_layers) + head, 0)


def gpu_memory_bytes(model: ModelSpec, *, kv_hbm_peak: int, staging_peak: int,
                     activation_peak: int, runtime_overhead: int) -> int:
    """GPU memory a system holds: weights + KV in HBM + staging buffers + activations + runtime."""
    return model.weight_bytes() + kv_hbm_peak + staging_peak + activation_peak + runtime_overhead


@dataclass(frozen=True)
class Pipelining:
    """How directkv's steps run as two parts (executor.directkv_pipelined and the knobs beside it): one part's
    zero-copy attention on a side stream while the other part's dense layers run; measured by the GPU executor
    and simulated by pipelined_step_cost (side_ctas is not modelled). Validated here, once, wherever the
    values enter (config, run_gpu's and simulate's callers, the profiler)."""

    enabled: bool = False
    side_ctas: int | None = DEFAULT_DIRECTKV_SIDE_CTAS  # about this many CTAs per side-stream kernel (None: all SMs)
    min_kv_mb: float = DEFAULT_PIPELINE_MIN_KV_MB  # steps whose decodes read less host K/V per layer run as one batch
    # steps mixing decodes and prompt chunks cut as decodes | chunks too (False: only decode-only steps are cut).
    # The chunks' prefill workspace is then allocated on the side stream, whose allocator pool the main
    # stream's cannot reuse: measured on the H200 (Llama 16K) as 1.4 GB of pipelining's extra reserved memory,
    # with the same peak of allocated memory. At OPT-13B 32K (8192-token chunks) pipelining with mixed steps
    # reserved 43.5 GB against one batch's 29.0 (False not yet run there).
    mixed: bool = True

    def __post_init__(self) -> None:
        check(isinstance(self.enabled, bool),
              f"executor.directkv_pipelined must be true or false; got {self.enabled!r}")
        ctas = self.side_ctas
        check(ctas is None or (isinstance(ctas, int) and not isinstance(ctas, bool) and ctas >= 1),
              f"executor.directkv_side_ctas must be an integer >= 1 or null (the kernel's own plan); got {ctas!r}")
        mb = self.min_kv_mb
        check(isinstance(mb, int | float) and not isinstance(mb, bool) and 0 <= mb < float("inf"),
              f"executor.directkv_pipeline_min_kv_mb must be a number >= 0; got {mb!r}")
        check(isinstance(self.mixed, bool),
              f"executor.directkv_pipeline_mixed must be true or false; got {self.mixed!r}")

    @classmethod
    def from_config(cls, executor) -> Pipelining:
        """From the config's `executor` group; a key it lacks takes the default above."""
        d = cls()
        return cls(executor.get("directkv_pipelined", d.enabled), executor.get("directkv_side_ctas", d.side_ctas),
                   executor.get("directkv_pipeline_min_kv_mb", d.min_kv_mb),
                   executor.get("directkv_pipeline_mixed", d.mixed))

    def check_system(self, policy: SystemPolicy) -> None:
        """Pipelining runs directkv's zero-copy kernels; the stream variant has its own side stream."""
        check(not (self.enabled and policy.name == "directkv" and policy.variant not in ("naive", "tiled", "")),
              f"executor.directkv_pipelined runs directkv variants naive and tiled; got variant {policy.variant!r}")

    def cut(self, policy: SystemPolicy, step: Step, kv_bytes_per_token_per_layer: int) -> int | None:
        """Row where the measured executor cuts `step` into two software-pipelined parts, or None to run it as
        one batch (GPUStepper.split, and the simulation of the same steps).

        cpu_attn, and directkv when enabled, cut decode-only steps of >= 2 sequences in halves. directkv also
        cuts steps that mix decodes and prompt chunks into decodes | chunks (unless `mixed` is off): the
        decodes' link-bound attention then overlaps the chunks' dense layers, which dominate such steps; and it
        cuts only steps whose decodes read at least min_kv_mb of host K/V per layer: below that the second
        pass over the weights costs more than it hides.
        """
        if not self.runs_parts(policy):
            return None
        directkv = policy.name == "directkv"
        if directkv and sum(step.decode_kv_lens) * kv_bytes_per_token_per_layer < self.min_kv_mb * 1e6:
            return None
        d = len(step.decodes)
        if not step.prefills:
            return d // 2 if d >= 2 else None
        return d if d and directkv and self.mixed else None

    def runs_parts(self, policy: SystemPolicy) -> bool:
        """Whether the measured executor may run this system's steps as two parts (GPUStepper.split):
        cpu_attn always (Neo's pipeline), directkv when enabled."""
        return policy.name == "cpu_attn" or (self.enabled and policy.name == "directkv")

    def row_columns(self, policy: SystemPolicy, *, measured: bool) -> dict:
        """The pipelining columns a result row of `policy` carries: every measured directkv row (pipelined or
        not, it says which), a simulated one only when pipelining is on (it was then simulated pipelined)."""
        if policy.name != "directkv" or not (measured or self.enabled):
            return {}
        return self.as_dict()

    def as_dict(self) -> dict:
        """The settings as result columns (see row_columns for which rows carry them)."""
        if not self.enabled:
            return {"directkv_pipelined": False}
        return {"directkv_pipelined": True, "directkv_side_ctas": self.side_ctas,
                "directkv_pipeline_min_kv_mb": float(self.min_kv_mb), "directkv_pipeline_mixed": self.mixed}


NO_PIPELINING = Pipelining()  # the measured executor's default: every step as one batch (cpu_attn aside)
