import pytest
import torch

from directkv.costmodel import CostModel
from directkv.engine.scheduler import Scheduler, SchedulerConfig
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.state import ReqState
from directkv.engine.systems import SYSTEMS, SystemPolicy
from directkv.errors import ConfigError, KVCapacityError
from directkv.kernels.traffic_model import stream_ring_bytes
from directkv.memory import KVCacheManager
from directkv.metrics import summarize
from directkv.specs import get_hardware, get_model
from workloads import synthetic_workload, with_arrivals

LLAMA = get_model("llama-3.1-8b")
CM = CostModel.for_hardware(get_hardware("h200-pcie5"))
MEM = MemoryConfig(hbm_budget_bytes=96e9, host_budget_bytes=100e9)


def _policies():
    return [SystemPolicy(n, "tiled" if n == "directkv" else "") for n in SYSTEMS]


def test_scheduler_respects_token_budget_and_finishes_everything():
    kv = KVCacheManager(LLAMA, hbm_budget_bytes=0, host_budget_bytes=1e12)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_batched_tokens=300), kv, "host")
    reqs = synthetic_workload(5, 700, 9, dist="uniform", spread=0.5, seed=1).requests
    states = [ReqState(r) for r in reqs]
    for s in states:
        sched.add(s)
    t, steps = 0.0, 0
    while not sched.idle:
        step = sched.schedule(t)
        assert 0 < step.num_tokens <= 300
        assert len({s.req_id for s in step.decodes} | {c.state.req_id for c in step.prefills}) == \
            len(step.decodes) + len(step.prefills)  # a request appears once per step
        t += 1.0
        sched.complete(step, t)
        steps += 1
    assert all(s.status == "done" and len(s.token_times) == s.req.output_len for s in states)
    assert all(s.prefilled == s.req.prompt_len for s in states)
    assert kv.stats().host_bytes == 0  # everything freed


def test_request_that_can_never_fit_is_oom_and_others_still_run():
    kv = KVCacheManager(LLAMA, hbm_budget_bytes=0, host_budget_bytes=2000 * LLAMA.kv_bytes_per_token())
    sched = Scheduler(SchedulerConfig(), kv, "host")
    big, small = synthetic_workload(1, 5000, 4).requests[0], synthetic_workload(1, 100, 4).requests[0]
    states = [ReqState(big), ReqState(small)]
    for s in states:
        sched.add(s)
    t = 0.0
    while not sched.idle:
        step = sched.schedule(t)
        t += 1
        sched.complete(step, t)
    assert states[0].status == "oom" and "budget" in states[0].error
    assert states[1].status == "done"


def test_simulation_orders_systems_as_the_mechanisms_imply():
    reqs = synthetic_workload(8, 8192, 16).requests
    res = {p.name: simulate(reqs, p, LLAMA, CM, mem=MEM) for p in _policies()}
    for r in res.values():
        assert r.metrics["completed"] == 8
    # HBM-resident attention is fastest; every offloader keeps KV out of HBM and uses far less memory
    assert all(res["hbm"].metrics["mean_tpot_ms"] < r.metrics["mean_tpot_ms"] for n, r in res.items() if n != "hbm")
    one_request_kv = 8208 * LLAMA.kv_bytes_per_token()
    assert res["hbm"].gpu_mem_bytes - res["directkv"].gpu_mem_bytes >= one_request_kv
    assert res["directkv"].gpu_mem_bytes < LLAMA.weight_bytes() + 2e9  # weights, activations, runtime only
    assert res["directkv"].host_pinned_bytes >= one_request_kv  # peak KV held in the pinned tier
    assert res["hbm"].host_pinned_bytes == 0
    # FlexGen's 4-bit cache holds ~28% of the bf16 bytes
    assert res["flexgen"].host_pinned_bytes == pytest.approx(0.28125 * res["directkv"].host_pinned_bytes, rel=0.01)
    # zero-copy decode reads every cached byte over the link each step: at least KV x output steps
    assert res["directkv"].traffic.link_read_bytes > 8 * 8192 * LLAMA.kv_bytes_per_token() * 14


def test_naive_directkv_reads_more_than_tiled():
    reqs = synthetic_workload(4, 4096, 8).requests
    naive = simulate(reqs, SystemPolicy("directkv", "naive"), LLAMA, CM, mem=MEM)
    tiled = simulate(reqs, SystemPolicy("directkv", "tiled"), LLAMA, CM, mem=MEM)
    assert naive.traffic.link_read_bytes > 1.5 * tiled.traffic.link_read_bytes
    assert naive.metrics["mean_tpot_ms"] > tiled.metrics["mean_tpot_ms"]


def test_directkv_stream_moves_tiled_bytes_by_copy_engine_into_a_small_ring():
    """stream's bytes are tiled's, timed at the copy engine's rate (faster than SM loads on PCIe), and its
    GPU memory holds two rings on top of tiled's at the peak: the decodes' and the first prompt chunk's (64 MiB: a
    slot per 16 MiB chunk of its past's K, at least 2), in the steps where one request decodes beside another's
    later chunk whose past is streamed. The decodes' ring is sized to their read: by default 3 slots of up to
    64 MiB of K, so ~32 MiB each for one 16K decode; cut into 16 MiB slots, 12 full ones (384 MiB)."""
    reqs = synthetic_workload(4, 16384, 8).requests
    tiled = simulate(reqs, SystemPolicy("directkv", "tiled"), LLAMA, CM, mem=MEM)
    stream = simulate(reqs, SystemPolicy("directkv", "stream"), LLAMA, CM, mem=MEM)
    assert stream.traffic.link_read_bytes == tiled.traffic.link_read_bytes
    assert CM.hw.link_ce_h2d_gbps > CM.hw.link_sm_read_gbps
    assert stream.metrics["mean_tpot_ms"] < tiled.metrics["mean_tpot_ms"]
    kvl = LLAMA.kv_bytes_per_token_per_layer()
    one_decode = {stream_ring_bytes(3, (16384 + k) * kvl, chunk_bytes=64 << 20) + (64 << 20) for k in range(1, 9)}
    assert stream.gpu_mem_bytes - tiled.gpu_mem_bytes in one_decode
    sixteen = simulate(reqs, SystemPolicy("directkv", "stream"), LLAMA, CM, mem=MEM, stream_chunk_mib=16)
    assert sixteen.gpu_mem_bytes - tiled.gpu_mem_bytes == (384 << 20) + (64 << 20)


def test_directkv_stream_reads_a_small_past_in_place():
    """A prompt chunk of a small past (<= 2 MiB of K) is read by the tiled kernel (SM rate, no ring): with
    1,024-token prompts and 2,048 tokens a step a split prompt's past is < 1,024 tokens (< 2 MiB of K per layer),
    so only the decodes' ring is held: 3 slots of each decode step's K and V (~8 MiB of K; slots are sized to the
    read, as plan_stream sizes them)."""
    reqs = synthetic_workload(4, 1024, 8).requests
    tiled = simulate(reqs, SystemPolicy("directkv", "tiled"), LLAMA, CM, mem=MEM)
    stream = simulate(reqs, SystemPolicy("directkv", "stream"), LLAMA, CM, mem=MEM)
    assert stream.traffic.link_read_bytes == tiled.traffic.link_read_bytes
    kvl = LLAMA.kv_bytes_per_token_per_layer()
    ring = stream.gpu_mem_bytes - tiled.gpu_mem_bytes
    low, high = (stream_ring_bytes(3, 4 * n * kvl, chunk_bytes=64 << 20) for n in (1024, 1024 + 8))
    assert low <= ring <= high < 384 << 20


def test_stream_step_of_in_place_chunks_costs_what_tiled_does(monkeypatch):
    """A step of prompt chunks read in place and no decodes runs no streamed kernel (none is charged) and
    holds no ring: it costs what tiled's step does. The simulation asks the rule with the run's page size and
    each chunk's past and new tokens: two 4,096-token prompts in chunks of the step's token budget."""
    from dataclasses import replace

    import directkv.engine.systems as systems
    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import step_cost
    from workloads.request import Request

    prompt = tuple(PrefillChunk(ReqState(Request(i, 4096, 8), prefilled=1024), 512, 1024) for i in range(2))
    step = Step((), prompt)
    tiled = step_cost(SystemPolicy("directkv", "tiled"), step, LLAMA, CM)
    stream = step_cost(SystemPolicy("directkv", "stream"), step, LLAMA, CM)
    assert stream.time_s == pytest.approx(tiled.time_s, rel=1e-12) and stream.staging_bytes == 0
    asked = []
    rule = systems.stream_reads_in_place
    monkeypatch.setattr(systems, "stream_reads_in_place",
                        lambda past, new, ps, page: asked.append((past, new, ps)) or rule(past, new, ps, page))
    simulate(synthetic_workload(2, 4096, 4).requests, SystemPolicy("directkv", "stream"), LLAMA, CM,
             mem=replace(MEM, page_size=32))
    assert asked and {ps for _, _, ps in asked} == {32}
    # every chunk's new tokens, not its page size or past: per prompt they add up to its 4,096 tokens
    chunks = sorted({(past, new) for past, new, _ in asked})
    assert all(new >= 1 for _, new in chunks) and sum(new for past, new in chunks) == 2 * 4096, chunks


def _decodes(n: int, context: int) -> tuple:
    """n running requests of `context` cached tokens, each decoding its second token."""
    from workloads.request import Request

    return tuple(ReqState(Request(i, context, 8), prefilled=context, generated=1) for i in range(n))


@pytest.mark.parametrize("context", [256, 1024, 2048, 32768])
@pytest.mark.parametrize("chunk", [False, True])
def test_directkv_stream_layer_is_bounded_by_its_link_and_its_work(context, chunk):
    """stream's per-layer time is the dense work plus stream_attention: never below the link time of its
    streamed bytes nor below the dense work + the kernels' math; a short read is copied entirely while the GPU
    does the dense work, so its link costs nothing; more decode ring slots never make a step slower. A prompt
    chunk of a past of <= 2 MiB of K (here 256 and 1024 tokens) is read in place at the SM rate and has no ring,
    its time added to the streamed decodes'; 2,048 tokens (4 MiB of K) are streamed."""
    from directkv.engine import step_traffic as st
    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import step_cost, stream_attention
    from directkv.kernels.traffic import Traffic
    from directkv.kernels.traffic_model import stream_reads_in_place
    from workloads.request import Request

    policy = SystemPolicy("directkv", "stream")
    prompt = (PrefillChunk(ReqState(Request(9, 2 * context, 8), prefilled=context), 256, context),) if chunk else ()
    step = Step(_decodes(4, context), prompt)
    t_lin = CM.dense_time(st.linear_layer_traffic(LLAMA, step.num_tokens))
    kvl = LLAMA.kv_bytes_per_token_per_layer()
    in_place = chunk and stream_reads_in_place(context, 256, 16, 16 * kvl // 2)  # MemoryConfig's 16-token pages
    assert in_place == (chunk and context <= 1024)
    launch = CM.hw.launch_us * 1e-6
    t_attn, staging, _ = stream_attention(step, LLAMA, CM, policy, t_lin, 16, 8, 16)
    streamed = Step(step.decodes, () if in_place else prompt)
    # the streamed part's new K/V are stored (SM writes) before its kernels; an in-place chunk is timed as tiled
    store = CM.terms(Traffic(link_write_bytes=st.attention_traffic(streamed, LLAMA, "stream", policy)
                             .link_write_bytes), link="sm")["link_write"]
    t_tiled = CM.time(st.attention_traffic(Step((), prompt), LLAMA, "tiled", policy), link="sm") if in_place else 0.0
    # the decodes' kernel per 16 MiB ring chunk of their K (four reads of context + 1 tokens: 17 chunks at 32K, 2 at
    # 2K, as plan_stream cuts 8,196 and 516 pages of 32 KiB), a streamed chunk's
    decode_k = sum(step.decode_kv_lens) * kvl // 2
    kernels = -(-decode_k // min(16 << 20, max(decode_k, 2 << 20))) + (chunk and not in_place)
    assert kernels - (chunk and not in_place) == {32768: 17, 2048: 2}.get(context, 1)
    terms = CM.terms(st.attention_traffic(streamed, LLAMA, "stream", policy), link="ce")
    math_t = max(terms["compute"], terms["hbm"])
    assert t_attn - t_tiled >= max(terms["link_read"] - t_lin, store + math_t) + kernels * launch - 1e-12
    if context == 256 and not chunk:  # 4 x 257 tokens: 4 MiB, copied within the dense work
        assert terms["link_read"] < t_lin and t_attn == pytest.approx(store + math_t + launch, rel=1e-9)
    if context == 32768:  # 512 MiB of decode K/V, twice the ring: the link bounds the layer
        assert t_attn == pytest.approx(terms["link_read"] - t_lin + kernels * launch, rel=1e-9)
    times = [stream_attention(step, LLAMA, CM, policy, t_lin, 16, n, 16)[0] for n in (2, 4, 8)]
    assert times[0] >= times[1] >= times[2] == pytest.approx(t_attn)
    # the chunk's ring: a slot per 16 MiB of its past's K, at least 2 (32K past: 64 MiB of K, 4 slots)
    chunk_slots = 4 if context == 32768 else 2
    assert staging == stream_ring_bytes(8, sum(step.decode_kv_lens) * kvl) + stream_ring_bytes(
        chunk_slots, 0 if in_place or not chunk else context * kvl, floor=0)
    t_head = CM.time(st.lm_head_traffic(LLAMA, step.num_logits), flops_kind="matmul")
    want = LLAMA.num_layers * (t_lin + times[2]) + t_head
    assert step_cost(policy, step, LLAMA, CM, stream_chunk_mib=16).time_s == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "opt-13b", "opt-30b"])
def test_stream_in_place_rule_is_the_plans(model):
    """The executor and the simulation ask stream_reads_in_place which prompt chunks skip the ring: those whose
    past pages hold at most STREAM_MIN_CHUNK_BYTES of K (1,024 Llama tokens), i.e. exactly those a ring of such
    chunks would copy in one chunk (pages, not bytes, are rounded: checked around the edge), and for a prompt's
    tail of <= STREAM_TAIL_NEW_TOKENS tokens twice that."""
    from directkv.kernels.cuda.prefill_stream import plan_prefill_stream
    from directkv.kernels.paged import PagedKV
    from directkv.kernels.traffic_model import STREAM_MIN_CHUNK_BYTES, stream_reads_in_place

    spec, ps = get_model(model), 16
    shape = (1, ps, spec.num_kv_heads, spec.head_dim)
    page = ps * spec.num_kv_heads * spec.head_dim * 2  # bytes of K per page, bf16
    edge = STREAM_MIN_CHUNK_BYTES // page * ps  # the most tokens read in place
    assert model != "llama-3.1-8b" or edge == 1024
    # Llama-3.1-8B tails: a 2,048-token past in place (4 MiB of K), a 2,049-token one streamed
    assert model != "llama-3.1-8b" or (stream_reads_in_place(2048, 4, ps, page)
                                       and not stream_reads_in_place(2049, 4, ps, page))
    pool = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    for past in (0, 1, edge - ps, edge - 1, edge, edge + 1, edge + 6, edge + ps, 3 * edge):
        pages = -(-past // ps)
        kv = PagedKV(pool, pool, pool[:0], pool[:0], torch.arange(max(pages, 1), dtype=torch.int32)[None],
                     torch.tensor([past], dtype=torch.int32))
        rings = sum(p.ring for p in plan_prefill_stream(kv, chunk_bytes=STREAM_MIN_CHUNK_BYTES, device="cpu").passes)
        assert stream_reads_in_place(past, 17, ps, page) == (rings <= 1), (model, past, rings)
        # a chunk of a few new tokens (a prompt's tail) reads in place what a ring of twice such chunks copies in
        # one chunk
        for p in (past, past + edge):
            pages = -(-p // ps)
            kv = PagedKV(pool, pool, pool[:0], pool[:0], torch.arange(max(pages, 1), dtype=torch.int32)[None],
                         torch.tensor([p], dtype=torch.int32))
            twice = plan_prefill_stream(kv, chunk_bytes=2 * STREAM_MIN_CHUNK_BYTES, device="cpu").passes
            for tail in (1, 16):
                assert stream_reads_in_place(p, tail, ps, page) == (sum(q.ring for q in twice) <= 1), (model, p, tail)


@pytest.mark.parametrize("past", [2044, 4094])
@pytest.mark.parametrize("tail", [4, 16, 17])
def test_stream_reads_a_prompt_tail_in_place_in_the_simulation(tail, past):
    """A step of 3 decodes beside a prompt's last `tail` tokens over a past of 2,044 tokens (4 MiB of K per layer)
    or 4,094 (8 MiB): the simulation charges a tail of <= 16 tokens over the 2,044 as the tiled kernel's in-place
    read, with no chunk ring in its staging, and streams the rest through a ring."""
    from dataclasses import replace

    from directkv.engine import step_traffic as st
    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import sm_store_time, stream_attention
    from workloads.request import Request

    policy = SystemPolicy("directkv", "stream")
    step = Step(_decodes(3, 2048), (PrefillChunk(ReqState(Request(9, past + tail, 8), prefilled=past), tail, past),))
    t_lin = CM.dense_time(st.linear_layer_traffic(LLAMA, step.num_tokens))
    t_attn, staging, _ = stream_attention(step, LLAMA, CM, policy, t_lin, 16, 8, 16)
    kvl = LLAMA.kv_bytes_per_token_per_layer()
    decode_ring = stream_ring_bytes(8, sum(step.decode_kv_lens) * kvl)
    if tail <= 16 and past == 2044:
        assert staging == decode_ring
        t_decodes, _, _ = stream_attention(Step(step.decodes, ()), LLAMA, CM, policy, t_lin, 16, 8, 16)
        tiled = st.attention_traffic(Step((), step.prefills), LLAMA, "tiled", policy)  # its store, then the kernel
        in_place = sm_store_time(CM, tiled.link_write_bytes) + CM.time(replace(tiled, link_write_bytes=0), link="sm")
        assert t_attn == pytest.approx(t_decodes + in_place, rel=1e-9)
    else:
        assert staging == decode_ring + stream_ring_bytes(2, past * kvl, floor=0) > decode_ring


def test_pipelining_columns_follow_the_row():
    """Measured directkv rows always say whether they were pipelined; simulated ones only when they were
    simulated pipelined; other systems' rows carry none."""
    from directkv.engine.systems import Pipelining

    on, off = Pipelining(True, 24, 8.0, False), Pipelining()
    tiled = SystemPolicy("directkv", "tiled")
    assert off.row_columns(tiled, measured=True) == {"directkv_pipelined": False}
    assert off.row_columns(tiled, measured=False) == {}
    want = {"directkv_pipelined": True, "directkv_side_ctas": 24, "directkv_pipeline_min_kv_mb": 8.0,
            "directkv_pipeline_mixed": False}
    assert on.row_columns(tiled, measured=True) == on.row_columns(tiled, measured=False) == want
    assert on.row_columns(SystemPolicy("swap"), measured=True) == {}


def test_pipelining_cuts_the_steps_the_measured_executor_cuts():
    """Pipelining.cut, shared by GPUStepper.split and the simulation: halves of decode-only steps, decodes |
    chunks of mixed ones (directkv with mixed on), none below the host K/V guard (directkv only)."""
    from dataclasses import replace

    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import NO_PIPELINING, Pipelining
    from workloads.request import Request

    on, dkv, cpu = Pipelining(True), SystemPolicy("directkv", "tiled"), SystemPolicy("cpu_attn")
    kvl = LLAMA.kv_bytes_per_token_per_layer()  # 4 KiB: the 32 MB guard is ~7800 tokens
    chunk = (PrefillChunk(ReqState(Request(99, 4096, 8)), 2048, 0),)
    assert on.cut(dkv, Step(_decodes(5, 4096), ()), kvl) == 2
    assert on.cut(dkv, Step(_decodes(5, 4096), chunk), kvl) == 5
    assert replace(on, mixed=False).cut(dkv, Step(_decodes(5, 4096), chunk), kvl) is None
    assert on.cut(dkv, Step(_decodes(1, 16384), ()), kvl) is None  # one decode: nothing to cut
    assert on.cut(dkv, Step(_decodes(4, 1024), ()), kvl) is None  # 16 MB per layer: under the guard
    assert on.cut(cpu, Step(_decodes(4, 1024), ()), kvl) == 2  # cpu_attn: always, decode-only steps only
    assert on.cut(cpu, Step(_decodes(4, 1024), chunk), kvl) is None
    assert NO_PIPELINING.cut(dkv, Step(_decodes(4, 4096), ()), kvl) is None
    assert NO_PIPELINING.cut(cpu, Step(_decodes(4, 4096), ()), kvl) == 2  # Neo's pipeline is cpu_attn's own


@pytest.mark.parametrize("mixed_step", [False, True])
def test_pipelined_directkv_step_overlaps_one_part_attention_with_the_other_part_dense_work(mixed_step):
    """A cut directkv step: per layer the longest of both parts' dense work, both parts' attention, and each
    part's own dense + attention; every part reads the weights again. Slower parts than one batch show up too:
    the second weight read is paid."""
    from dataclasses import replace

    from directkv.engine import step_traffic as st
    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import Pipelining, step_cost
    from workloads.request import Request

    policy = SystemPolicy("directkv", "tiled")
    chunk = (PrefillChunk(ReqState(Request(99, 8192, 8)), 2048, 4096),) if mixed_step else ()
    step = Step(_decodes(4, 4096), chunk)
    parts = [Step(step.decodes, ()), Step((), chunk)] if mixed_step else [Step(step.decodes[:2], ()), Step(step.decodes[2:], ())]
    dense = [CM.dense_time(st.linear_layer_traffic(LLAMA, p.num_tokens)) for p in parts]
    # each part's store of its new K/V by SM writes on the main stream (with the dense work), its kernel on the side
    traffic = [st.attention_traffic(p, LLAMA, "tiled", policy) for p in parts]
    store = [t.link_write_bytes / (CM.hw.link_sm_write_gbps * 1e9 * CM.eff.link_sm) for t in traffic]
    attn = [CM.time(replace(t, link_write_bytes=0), link="sm") for t in traffic]
    main = [d + s for d, s in zip(dense, store, strict=True)]
    assert min(store) > 0
    layer = max(main[0] + main[1], attn[0] + attn[1], main[0] + attn[0], main[1] + attn[1])
    head = CM.time(st.lm_head_traffic(LLAMA, step.num_logits), flops_kind="matmul")
    piped = step_cost(policy, step, LLAMA, CM, Pipelining(True))
    assert piped.time_s == pytest.approx(LLAMA.num_layers * layer + head, rel=1e-9)
    one = step_cost(policy, step, LLAMA, CM)
    assert piped.time_s < one.time_s  # here the overlap wins
    weights = LLAMA.layer_params() * LLAMA.dtype_bytes * LLAMA.num_layers
    assert piped.traffic.hbm_read_bytes - one.traffic.hbm_read_bytes == pytest.approx(weights, rel=1e-6)
    assert step_cost(policy, step, LLAMA, CM, Pipelining(False)) == one


def test_simulation_is_deterministic_and_queues_under_load():
    wl = with_arrivals(synthetic_workload(40, 512, 32, dist="uniform", spread=0.5), rate=20.0, seed=3)
    a = simulate(wl.requests, SystemPolicy("swap"), LLAMA, CM, mem=MEM)
    b = simulate(wl.requests, SystemPolicy("swap"), LLAMA, CM, mem=MEM)
    assert a.metrics == b.metrics
    slow = with_arrivals(synthetic_workload(40, 512, 32, dist="uniform", spread=0.5), rate=200.0, seed=3)
    c = simulate(slow.requests, SystemPolicy("swap"), LLAMA, CM, mem=MEM)
    assert c.metrics["mean_ttft_ms"] > a.metrics["mean_ttft_ms"]  # more load, more queueing


def test_weights_that_do_not_fit_raise():
    with pytest.raises(KVCapacityError):
        simulate(synthetic_workload(1, 10, 2).requests, SystemPolicy("hbm"), get_model("opt-30b"), CM,
                 mem=MemoryConfig(hbm_budget_bytes=40e9, host_budget_bytes=1e9))


def test_bad_policy_names():
    with pytest.raises(ConfigError, match="valid: cpu_attn, directkv, flexgen, hbm, swap"):
        SystemPolicy("vllm")
    with pytest.raises(ConfigError, match="naive, tiled, fused"):
        SystemPolicy("directkv", "magic")


def test_metrics_match_hand_computation():
    from workloads.request import Request

    s = ReqState(Request(0, 10, 4, arrival_s=1.0))
    s.token_times, s.status = [1.5, 1.7, 2.0, 2.1], "done"
    m = summarize([s], duration_s=1.1)
    assert m["mean_ttft_ms"] == pytest.approx(500.0)
    assert m["mean_e2el_ms"] == pytest.approx(1100.0)
    assert m["mean_tpot_ms"] == pytest.approx((1100.0 - 500.0) / 3)
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["output_throughput"] == pytest.approx(4 / 1.1)


def test_dense_floor_adds_to_every_small_step_and_leaves_big_ones():
    """With dense_us_per_layer fitted, a layer's dense part takes at least that: a small hbm decode step is
    layers x the floor (its attention is tiny), directkv's link-bound attention comes on top of it (the two
    run one after the other), and prompt-sized steps keep their roofline."""
    from dataclasses import replace

    # the host time per step (host_time.py) apart: this test is the dense floor's alone
    none = replace(CM, eff=replace(CM.eff, dense_us_per_layer=0.0), host={})
    floor = replace(CM, eff=replace(CM.eff, dense_us_per_layer=300.0), host={})
    small = synthetic_workload(1, 64, 8).requests
    a = simulate(small, SystemPolicy("hbm"), LLAMA, none, mem=MEM).metrics["mean_tpot_ms"]
    b = simulate(small, SystemPolicy("hbm"), LLAMA, floor, mem=MEM).metrics["mean_tpot_ms"]
    assert a < LLAMA.num_layers * 0.3 < b < LLAMA.num_layers * 0.3 * 1.05
    long = synthetic_workload(1, 16384, 8).requests
    c = simulate(long, SystemPolicy("directkv", "tiled"), LLAMA, none, mem=MEM).metrics["mean_tpot_ms"]
    d = simulate(long, SystemPolicy("directkv", "tiled"), LLAMA, floor, mem=MEM).metrics["mean_tpot_ms"]
    from directkv.engine.step_traffic import linear_layer_traffic

    t_lin = none.time(linear_layer_traffic(LLAMA, 1), flops_kind="matmul") * 1e3  # ms, below the floor
    assert t_lin < 0.3 and d - c == pytest.approx(LLAMA.num_layers * (0.3 - t_lin), rel=1e-6)
    prompt = synthetic_workload(1, 2048, 1).requests  # one 2048-token prefill step: far above the floor
    e = simulate(prompt, SystemPolicy("hbm"), LLAMA, none, mem=MEM).metrics["mean_ttft_ms"]
    f = simulate(prompt, SystemPolicy("hbm"), LLAMA, floor, mem=MEM).metrics["mean_ttft_ms"]
    assert e == f


@pytest.mark.parametrize("system", ["flexgen", "cpu_attn"])
def test_system_overhead_per_layer_adds_to_each_decode_step(system):
    """flexgen_us_per_layer / cpu_attn_us_per_layer: a fitted fixed time per layer of that system's steps
    (cpu_attn: of steps with decodes, whose handoffs it stands for); other systems do not pay it."""
    from dataclasses import replace

    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import step_cost
    from workloads.request import Request

    none = replace(CM, eff=replace(CM.eff, flexgen_us_per_layer=0.0, cpu_attn_us_per_layer=0.0))
    some = replace(CM, eff=replace(CM.eff, **{f"{system}_us_per_layer": 1000.0}))
    decode = Step(_decodes(1, 64), ())
    prompt = Step((), (PrefillChunk(ReqState(Request(1, 64, 8)), 64, 0),))

    def extra(step, name):
        return step_cost(SystemPolicy(name), step, LLAMA, some).time_s - step_cost(SystemPolicy(name), step, LLAMA,
                                                                                     none).time_s
    assert extra(decode, system) == pytest.approx(LLAMA.num_layers * 1e-3, rel=1e-6)
    assert extra(prompt, system) == (pytest.approx(LLAMA.num_layers * 1e-3, rel=1e-6) if system == "flexgen" else 0)
    assert extra(decode, "swap") == extra(decode, "hbm") == 0


def test_simulate_refuses_pipelining_the_stream_variant():
    from directkv.engine.systems import Pipelining

    with pytest.raises(ConfigError, match="executor.directkv_pipelined runs directkv variants naive and tiled; "
                                          "got variant 'stream'"):
        simulate(synthetic_workload(2, 256, 4).requests, SystemPolicy("directkv", "stream"), LLAMA, CM, mem=MEM,
                 pipelining=Pipelining(True))


def test_stream_layer_traffic_charges_chunks_read_in_place_as_tiled():
    """A prompt chunk of a small past is read in place by the tiled kernel: the step's traffic holds tiled's bytes
    for it, not a ring's (written and read back in HBM), and its FLOPs either way."""
    from directkv.engine import step_traffic as st
    from directkv.engine.state import PrefillChunk, Step
    from directkv.engine.systems import step_cost, stream_parts
    from workloads.request import Request

    chunk = PrefillChunk(ReqState(Request(9, 2048, 8), prefilled=256), 256, 256)  # 256 past tokens: 0.5 MiB of K
    step = Step(_decodes(2, 4096), (chunk,))
    streamed, in_place = stream_parts(step, LLAMA, 16)
    assert streamed.prefills == () and in_place.prefills == (chunk,) and streamed.decodes == step.decodes
    stream = step_cost(SystemPolicy("directkv", "stream"), step, LLAMA, CM).traffic
    tiled = step_cost(SystemPolicy("directkv", "tiled"), step, LLAMA, CM).traffic
    assert stream.link_read_bytes == tiled.link_read_bytes and stream.flops == tiled.flops
    ring = st.attention_traffic(Step(step.decodes, ()), LLAMA, "stream", SystemPolicy("directkv", "stream"))
    dec_tiled = st.attention_traffic(Step(step.decodes, ()), LLAMA, "tiled", SystemPolicy("directkv", "tiled"))
    assert ring == dec_tiled  # the decodes' part is charged as tiled's closed form by both
    assert stream.hbm_read_bytes == tiled.hbm_read_bytes
