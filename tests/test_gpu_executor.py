"""The GPU executor's KV paths, run on the CPU with the reference kernels at toy sizes.

Every system must generate exactly the tokens of the HBM-resident system (greedy decoding is a sharp
check: one wrong K/V slot, stale staging buffer or mis-mapped page changes the argmax), except FlexGen,
whose 4-bit cache is lossy and is checked through its measured attention error instead.
"""

from dataclasses import replace

import pytest
import torch

from directkv.engine.gpu.executor import run_gpu
from directkv.engine.gpu.stepper import GPUStepper
from directkv.engine.loop import serve
from directkv.engine.scheduler import SchedulerConfig
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.state import ReqState, Step
from directkv.engine.systems import NO_PIPELINING, Pipelining, SystemPolicy
from directkv.errors import ConfigError
from directkv.memory import KVCacheManager
from directkv.model.runner import ModelRunner
from directkv.model.weights import init_weights
from directkv.specs import ModelSpec
from workloads import synthetic_workload, with_arrivals
from workloads.request import Request

# tiny but with head_dim 64 so FlexGen's group of 64 applies
SPEC = ModelSpec("toy", "llama", 2, 128, 4, 2, 64, 256, 512, 4096)
SCHED = SchedulerConfig(max_num_seqs=4, max_batched_tokens=48)  # forces chunked prefill and mixed steps


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(SPEC, init_weights(SPEC, device="cpu", dtype=torch.float32, seed=1))


# toy layers hold a few KB of K/V: a real-size cut threshold would leave every toy step whole
TOY_PIPELINING = Pipelining(True, min_kv_mb=0.0)


def _kv(policy, requests):
    kv_tokens = sum(r.prompt_len + r.output_len for r in requests) + 64
    tier_bytes = kv_tokens * policy.kv_bytes_per_token(SPEC)
    kv = KVCacheManager(SPEC, page_size=16, hbm_budget_bytes=tier_bytes if policy.kv_tier == "hbm" else 0,
                        host_budget_bytes=tier_bytes if policy.kv_tier == "host" else 0,
                        bytes_per_token=policy.kv_bytes_per_token(SPEC), materialize=policy.name != "flexgen",
                        dtype=torch.float32, hbm_device="cpu")
    return kv


def _serve(policy, runner, requests, *, cpu_attn_kernel="flash", pipelining=NO_PIPELINING, **path_options):
    """Serve on the CPU with poisoned caches; path_options: GPUStepper's (hbm_prefill=, no_past_prefill=, ...)."""
    kv = _kv(policy, requests)
    if kv.arena is not None:  # poison: a read of a slot nobody wrote turns into NaN and fails the test
        for t in (kv.arena.k, kv.arena.v, kv.hbm_k, kv.hbm_v):
            t.fill_(float("nan"))
    stepper = GPUStepper(policy, runner, kv, torch.device("cpu"), seed=7, cpu_attn_kernel=cpu_attn_kernel,
                         pipelining=pipelining, **path_options)
    if policy.name == "flexgen":
        for t in stepper.path.shadow:
            t.fill_(float("nan"))
    attend, stepper.outs = stepper.path.attend, []

    def recording(layer, q, k, v):  # every layer's attention output of every step, for comparison
        out = attend(layer, q, k, v)
        stepper.outs.append(out.clone())
        return out

    stepper.path.attend = recording
    stepper.pipelined_layers = stepper.mixed_layers = 0  # layers run as two parts; those of decodes | chunks
    if hasattr(stepper.path, "attend_async"):  # cpu_attn's two-part steps: record each layer's whole batch
        start, first_part = stepper.path.attend_async, {}

        def recording_async(layer, rows, q, k, v):
            wait = start(layer, rows, q, k, v)

            def recorded():
                out = wait()
                if rows.start == 0:
                    first_part[layer] = out.clone()
                else:  # parts finish in layer order, A before B
                    stepper.outs.append(torch.cat([first_part.pop(layer), out]))
                    stepper.pipelined_layers += 1
                    stepper.mixed_layers += bool(stepper.path.plan.chunks)
                return out

            return recorded

        stepper.path.attend_async = recording_async
    res = serve(requests, stepper, kv, policy.kv_tier, SPEC, sched_cfg=SCHED)
    return res, stepper


def _requests():
    wl = synthetic_workload(5, 70, 6, dist="uniform", spread=0.6, seed=2)
    return with_arrivals(wl, rate=1e4, seed=2).requests


@pytest.mark.parametrize("name,variant,option", [("directkv", "tiled", ""), ("directkv", "naive", ""),
                                                 ("directkv", "tiled", "pipelined"),
                                                 ("directkv", "tiled", "pipelined:decode-only"), ("swap", "", ""),
                                                 ("cpu_attn", "", "flash"), ("cpu_attn", "", "native")])
def test_every_path_generates_what_hbm_generates(runner, name, variant, option):
    reqs = _requests()
    ref_res, ref = _serve(SystemPolicy("hbm"), runner, reqs)
    pipelining = {"pipelined": TOY_PIPELINING, "pipelined:decode-only": replace(TOY_PIPELINING, mixed=False)}
    res, st = _serve(SystemPolicy(name, variant), runner, reqs, cpu_attn_kernel=option or "flash",
                     pipelining=pipelining.get(option, NO_PIPELINING))
    assert res.metrics["completed"] == ref_res.metrics["completed"] == len(reqs)
    assert st.outputs == ref.outputs
    assert len(st.outs) == len(ref.outs)
    for a, b in zip(st.outs, ref.outs, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all(len(st.outputs[r.req_id]) == r.output_len for r in reqs)
    assert res.traffic.link_read_bytes > 0 and ref_res.traffic.link_read_bytes == 0
    if name == "cpu_attn" or option.startswith("pipelined"):  # steps ran as two parts, and matched all the same
        assert st.pipelined_layers > 0
        # directkv also cuts steps of decodes and prompt chunks (decodes | chunks) unless told not to; cpu_attn
        # only decode-only ones
        assert (st.mixed_layers > 0) == (option == "pipelined")
    else:
        assert st.pipelined_layers == 0


def test_directkv_cuts_only_steps_whose_decodes_read_enough_host_kv(runner):
    """Pipelining's guard: a step is cut only when its decodes attend to >= min_kv_mb of host K/V per layer;
    cpu_attn (Neo's pipeline) cuts whatever it reads."""
    reqs = [Request(i, 120, 4) for i in range(3)]
    tokens = 100  # threshold, in tokens of K/V per layer
    pipelining = Pipelining(True, min_kv_mb=tokens * SPEC.kv_bytes_per_token_per_layer() / 1e6)

    def decodes(*contexts):
        return Step(tuple(ReqState(r, prefilled=c, generated=1) for r, c in zip(reqs, contexts, strict=False)), ())

    dkv = GPUStepper(SystemPolicy("directkv", "tiled"), runner, _kv(SystemPolicy("directkv", "tiled"), reqs),
                     torch.device("cpu"), pipelining=pipelining)
    assert dkv.split(decodes(40, 57)) is None  # each decode attends to its context + 1: 41 + 58 = 99 tokens
    assert dkv.split(decodes(40, 59)) == 1  # 41 + 60 = 101
    assert dkv.split(decodes(30, 30, 30)) is None  # 93
    assert dkv.split(decodes(40, 30, 30)) == 1  # 103: three decodes, cut after the first
    cpu = GPUStepper(SystemPolicy("cpu_attn"), runner, _kv(SystemPolicy("cpu_attn"), reqs), torch.device("cpu"),
                     cpu_attn_kernel="flash", pipelining=pipelining)
    assert cpu.split(decodes(3, 3)) == 1
    off = GPUStepper(SystemPolicy("directkv", "tiled"), runner, _kv(SystemPolicy("directkv", "tiled"), reqs),
                     torch.device("cpu"))
    assert off.split(decodes(400, 400)) is None


@pytest.mark.parametrize("kwargs,message", [
    ({"enabled": "yes"}, "executor.directkv_pipelined must be true or false; got 'yes'"),
    ({"side_ctas": 0}, "executor.directkv_side_ctas must be an integer >= 1 or null (the kernel's own plan); got 0"),
    ({"side_ctas": True}, "executor.directkv_side_ctas must be an integer >= 1 or null (the kernel's own plan); got True"),
    ({"min_kv_mb": -1.0}, "executor.directkv_pipeline_min_kv_mb must be a number >= 0; got -1.0"),
    ({"min_kv_mb": float("inf")}, "executor.directkv_pipeline_min_kv_mb must be a number >= 0; got inf"),
    ({"mixed": 1}, "executor.directkv_pipeline_mixed must be true or false; got 1"),
])
def test_pipelining_refuses_bad_values(kwargs, message):
    with pytest.raises(ConfigError) as e:
        Pipelining(**kwargs)
    assert str(e.value) == message


def test_cpu_attn_native_without_a_compiler_names_the_other_kernel(runner, monkeypatch):
    from directkv.engine.gpu import cpu_attn_path

    monkeypatch.setattr(cpu_attn_path.build, "can_build", lambda op: False)
    with pytest.raises(ConfigError, match=r"'native' needs a C\+\+ compiler .* executor.cpu_attn_kernel=flash"):
        _serve(SystemPolicy("cpu_attn"), runner, _requests(), cpu_attn_kernel="native")


def test_flexgen_is_close_and_reports_its_error(runner):
    reqs = _requests()
    res, st = _serve(SystemPolicy("flexgen"), runner, reqs)
    assert res.metrics["completed"] == len(reqs)
    errs = st.path.errors
    assert errs and 0 < max(errs) < 0.2  # 4-bit group-64 KV: a few percent, never exact
    packed = sum(t.numel() * t.element_size() for t in st.path.host.values())
    assert packed < 0.3 * st.path.kv.capacity_pages["host"] * 16 * SPEC.kv_bytes_per_token()


def test_run_gpu_entry_on_cpu():
    mem = MemoryConfig(hbm_budget_bytes=2e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    res, extra = run_gpu(_requests(), SystemPolicy("directkv", "tiled"), SPEC, mem=mem, sched_cfg=SCHED,
                         device="cpu")
    assert res.metrics["completed"] == 5 and res.host_pinned_bytes > 0 and "pin_s" in extra
    # each step's time beside the host's time to queue it, over the run's steps (not the warm-up's)
    assert 0 < extra["host_prep_ms_mean"] < extra["host_queue_ms_mean"] <= extra["step_ms_mean"]
    assert extra["host_bound_step_share"] != extra["host_bound_step_share"]  # NaN off a GPU: the host is the device
    assert 0 < extra["step_ms_mean"] * res.steps <= res.duration_s * 1e3 * (1 + 1e-9)  # the steps fill the engine's time
    # the run's garbage collections, counted and timed with what existed before it frozen (GcGuard)
    assert extra["gc_collections"] >= extra["gc_oldest_collections"] >= 0 and extra["gc_pause_ms"] >= 0


def test_step_time_columns_mean_and_count_host_bound_steps():
    from directkv.engine.gpu.executor import step_time_columns

    cols = step_time_columns([(0.010, 0.002, 0.001), (0.020, 0.019, 0.002), (0.030, 0.027, 0.006)])
    assert cols["step_ms_mean"] == pytest.approx(20.0) and cols["host_queue_ms_mean"] == pytest.approx(16.0)
    assert cols["host_prep_ms_mean"] == pytest.approx(3.0)
    assert cols["host_bound_step_share"] == pytest.approx(2 / 3)  # 19 of 20 ms and 27 of 30 ms: >= 90%
    assert all(v != v for v in step_time_columns([]).values())  # no steps: NaN, not 0
    off_gpu = step_time_columns([(0.010, 0.002, 0.001)], device=False)
    assert off_gpu["step_ms_mean"] == pytest.approx(10.0) and off_gpu["host_bound_step_share"] != off_gpu["host_bound_step_share"]


def test_directkv_stream_refused_on_a_cpu_run(runner):
    with pytest.raises(ConfigError, match="directkv variant 'stream' needs a CUDA device \\(a GPU\\); this run is on "
                                          "cpu; valid there: naive, tiled"):
        _serve(SystemPolicy("directkv", "stream"), runner, _requests())


def test_run_gpu_refuses_cuda_graphs_without_a_gpu():
    mem = MemoryConfig(hbm_budget_bytes=2e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    with pytest.raises(ConfigError, match="CUDA graphs need the model on a CUDA device; it is on cpu"):
        run_gpu(_requests(), SystemPolicy("hbm"), SPEC, mem=mem, sched_cfg=SCHED, device="cpu", cuda_graphs=True)


def test_stager_copies_runs_of_host_pages_whatever_the_request_order():
    """Pages given out in descending order still stage as one copy per run of consecutive host pages."""
    from directkv.engine.gpu.paths import _Stager

    pool = torch.arange(12 * 2, dtype=torch.float32).reshape(12, 2)
    stager = _Stager(lambda layer: [pool], torch.device("cpu"))
    tables = stager.plan([[5, 4, 3], [9, 8], [4]])
    assert stager.dma_runs.tolist() == [[3, 0, 3], [8, 3, 2]]  # (host page, staging index, pages)
    stager.issue(0)
    staged = stager.acquire(0)[0]
    for pages, table in zip([[5, 4, 3], [9, 8], [4]], tables, strict=True):
        rows = [-(int(e) + 1) for e in table[0]]  # staging entries are HBM pages -(i + 1)
        assert torch.equal(staged[rows], pool[pages])


def test_stager_keeps_its_pool_across_steps_and_grows_by_a_quarter():
    from directkv.engine.gpu.paths import _Stager

    pool = torch.zeros(64, 2)
    stager = _Stager(lambda layer: [pool], torch.device("cpu"))
    stager.plan([list(range(8))])
    held, ptr = stager.nbytes, stager.buffers[0][0].data_ptr()
    stager.plan([[3, 4, 5]])  # a smaller step reuses the same memory
    assert stager.nbytes == held and stager.buffers[0][0].data_ptr() == ptr and len(stager.buffers[0][0]) == 3
    stager.plan([list(range(9))])  # 9 > 8 pages: grows to max(9, 8 * 5 // 4 = 10)
    assert stager.capacity == 10 and len(stager.buffers[1][0]) == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_torch_decode_attention_matches_float64(dtype, group):
    """cpu_attn's flash path: scattered pages, a partial last page, runs long enough to be cut into pieces
    (and a remainder), GQA groups: against a float64 softmax over the gathered keys."""
    from directkv.engine.gpu import cpu_attn_path
    from directkv.kernels.paged import sequence_runs

    torch.manual_seed(group)
    hkv, d, ps = 2, 64, 16
    k_pool = torch.randn(200, ps, hkv, d).to(dtype)
    v_pool = torch.randn(200, ps, hkv, d).to(dtype)
    pages = list(range(40, 110)) + [3, 150, 151] + list(range(10, 30))  # runs of 70, 1, 2 and 20 pages
    n = (len(pages) - 1) * ps + 5
    q = torch.randn(hkv * group, d).to(dtype)
    out = cpu_attn_path.torch_decode_attention(q, k_pool, v_pool, sequence_runs(pages, n, ps), threads=8)
    k = k_pool[pages].reshape(-1, hkv, d)[:n].double()
    v = v_pool[pages].reshape(-1, hkv, d)[:n].double()
    qq = q.double().view(hkv, group, d)
    p = torch.softmax(torch.einsum("hgd,nhd->hgn", qq, k) * d**-0.5, dim=-1)
    want = torch.einsum("hgn,nhd->hgd", p, v).reshape(hkv * group, d)
    assert out.dtype == torch.float32 and out.shape == (hkv * group, d)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("system", ["directkv", "directkv:stream", "directkv:pipelined", "hbm", "swap", "cpu_attn",
                                    "cpu_attn:native", "flexgen"])
def test_every_system_serves_on_the_gpu_with_and_without_cuda_graphs(system):
    """The real executor on the GPU at toy size (bf16, the CUDA kernels): every request completes with the
    dense layer parts eager and as CUDA graphs, and the rows say which."""
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    system, _, option = system.partition(":")  # directkv's variant or pipelining, or cpu_attn's CPU kernel
    cpu_kernel = option if system == "cpu_attn" else ""
    pipelined = option == "pipelined"
    policy = SystemPolicy(system, ("tiled" if pipelined else option or "tiled") if system == "directkv" else "")
    try:
        for graphs in (False, True):
            res, extra = run_gpu(_requests(), policy, SPEC, mem=mem, sched_cfg=SCHED, device="cuda",
                                 cuda_graphs=graphs, cpu_attn_kernel=cpu_kernel or "flash",
                                 pipelining=TOY_PIPELINING if pipelined else NO_PIPELINING)
            assert res.metrics["completed"] == 5 and extra["cuda_graphs"] is graphs
            assert extra.get("cpu_attn_kernel") == ((cpu_kernel or "flash") if system == "cpu_attn" else None)
            assert extra.get("directkv_pipelined") == (pipelined if system == "directkv" else None)
            assert ("graph_capture_s" in extra) is graphs
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # run_gpu capped it at the point's budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs,side_ctas", [(False, None), (True, None), (True, 8)])
def test_directkv_pipelined_parts_on_the_side_stream_match_the_main_stream(graphs, side_ctas, monkeypatch):
    """Each part's attention (some decodes, or a step's prompt chunks), run on the side stream while the main
    stream goes on, equals the same kernels run afterwards on the main stream over copies of its inputs: a
    side stream that read K/V before the new tokens' store, or inputs overwritten by the next layer, would
    differ."""
    from directkv.engine.gpu.paths import ZeroCopyPath

    start, checked, mismatches = ZeroCopyPath.attend_async, [], []

    def attend_async(self, layer, rows, q, k, v):
        q_copy, k_copy, v_copy = q.clone(), k.clone(), v.clone()
        wait = start(self, layer, rows, q, k, v)

        def checked_wait():
            out = wait()
            p = self.plan
            k_pool, v_pool = self.kv.pools(layer, self.tier)
            if rows.start == p.num_decodes:  # the prompt chunks' part of a decodes | chunks step
                again = torch.empty_like(q_copy)
                self._chunks(p, self.tier, self.variant, q_copy, k_copy, v_copy, k_pool, v_pool, p.chunk_tables,
                             again, base=rows.start)
            else:
                paged = self._paged(self.tier, k_pool, v_pool, p.decode_table[rows], p.decode_lens[rows])
                again, _ = self.decode(q_copy, paged, variant=self.variant,
                                       num_splits=self.side_splits(q_copy, k_pool.shape[2],
                                                                   p.decode_table.shape[1], k_pool.shape[1]))
            checked.append("chunks" if rows.start == p.num_decodes else "decodes")
            if not torch.equal(out, again):
                mismatches.append((layer, rows.start, (out.float() - again.float()).abs().max().item()))
            return out

        return checked_wait

    monkeypatch.setattr(ZeroCopyPath, "attend_async", attend_async)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy("directkv", "tiled"), SPEC, mem=mem, sched_cfg=SCHED,
                             device="cuda", cuda_graphs=graphs,
                             pipelining=Pipelining(True, side_ctas, min_kv_mb=0.0))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["directkv_pipelined"] is True
    assert extra["directkv_side_ctas"] == side_ctas
    assert set(checked) == {"chunks", "decodes"} and not mismatches, mismatches[:5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_bytes,slots", [(None, 2), (8 << 10, 2), (8 << 10, 4)])
def test_directkv_stream_prefetch_reads_what_tiled_reads(chunk_bytes, slots, monkeypatch):
    """directkv stream queues every layer's decode copies at the step's start (and prefetches the first prompt
    chunk's one layer ahead), so they run during the dense work before each attention: every layer's output
    must equal tiled's over the same pools. The host arena is poisoned, so a copy made before the step's new
    token was stored into its page would give NaN unless the token reached the ring as last_kv. 8 KiB chunks
    (two toy pages) make many chunks per layer, and prompt chunks' pasts span several ring chunks, so they are
    streamed too (with the default chunks and in-place rule, 2 MiB of K, they are read in place); with the
    default chunks each layer is one chunk, so the next layer's is copied while this one's is read. The prompt
    ring's first prefetch of a step waits for the main stream, the later ones only for their slots' readers.
    With 4 decode ring slots the copies run further ahead of the kernels (16 MiB slots, or the small chunks). A
    mixed step's two rings share one copy stream. The check itself reads each output back (a sync per layer), so it cannot catch a copy
    racing a reader:
    test_cuda_decode's lagging-reader tests do."""
    from functools import partial

    import directkv.engine.gpu.paths as paths
    import directkv.kernels.cuda.decode_attention as dec
    import directkv.kernels.cuda.prefill_stream as pre
    from directkv.engine.gpu.paths import ZeroCopyPath
    from directkv.kernels.traffic_model import STREAM_CHUNK_BYTES

    if chunk_bytes is not None:  # the decode ring's chunks are set on the path (poisoned_init), the prompt ring's here
        monkeypatch.setattr(pre, "plan_prefill_stream", partial(pre.plan_prefill_stream, chunk_bytes=chunk_bytes))
        # the in-place rule at the same chunk size: pasts of more than two toy pages are streamed, whatever the
        # chunk's new tokens (the toy prompts' tails are short)
        monkeypatch.setattr(paths, "stream_reads_in_place",
                            lambda past, new, ps, page: -(-past // ps) <= chunk_bytes // page)
    init, attend, prefetch, prefetch_chunk = (ZeroCopyPath.__init__, ZeroCopyPath.attend, dec.prefetch_stream,
                                              pre.prefetch_prefill_stream)
    issued, issued_chunk, errors, chunks = [], [], [], []  # chunks: (past_len, streamed) of each layer's
    many = []  # per decode plan: more than one ring chunk per layer
    shared = []  # per step with both rings: do they share the path's one copy stream?

    def poisoned_init(self, kv, *args, **kwargs):
        init(self, kv, *args, **kwargs)
        self.stream_slots = self.decode_slots = slots  # both rings' slots
        self.decode_chunk_bytes = chunk_bytes or STREAM_CHUNK_BYTES  # 2 x 16 MiB: the decode ring of 2 slots
        if kv.arena is not None:
            for t in (*kv.arena.k, *kv.arena.v):
                t.fill_(float("nan"))

    def checked_attend(self, layer, q, k, v):
        chunks.extend((c.past_len, streamed) for c, streamed in zip(self.plan.chunks, self.chunk_streamed, strict=True))
        if layer == 0 and self.decode_plan is not None and self.chunk_ring is not None:
            shared.append(self.decode_plan.side is self.chunk_ring.side is self._side)
        out = attend(self, layer, q, k, v)
        k_pool, v_pool = self.kv.pools(layer, self.tier)
        self.variant = "tiled"
        try:
            again = self.attention(self.plan, self.tier, q, k, v, k_pool, v_pool, self.plan.decode_table,
                                   self.plan.chunk_tables)
        finally:
            self.variant = "stream"
        errors.append(float("nan") if out.isnan().any() else (out.float() - again.float()).abs().max().item())
        return out

    monkeypatch.setattr(ZeroCopyPath, "__init__", poisoned_init)
    monkeypatch.setattr(ZeroCopyPath, "attend", checked_attend)

    def checked_prefetch(plan, pools):  # once per step with decodes, over every layer's pools in order
        assert len(pools) == SPEC.num_layers and len({k.data_ptr() for k, _ in pools}) == SPEC.num_layers
        many.append(len(plan.copies) > 1)
        issued.append(prefetch(plan, pools))
        return issued[-1]

    monkeypatch.setattr(dec, "prefetch_stream", checked_prefetch)
    run_stream, used = dec._run_stream, []

    def checked_run_stream(q, kv, plan, *args):  # was this call queued, with these pools?
        pools = (kv.host_k.data_ptr(), kv.host_v.data_ptr())
        used.append(plan.call < len(plan.queue) and plan.queue[plan.call] == pools)
        return run_stream(q, kv, plan, *args)

    monkeypatch.setattr(dec, "_run_stream", checked_run_stream)
    waits_chunk = []

    def checked_prefetch_chunk(*a, after_stream=True):
        waits_chunk.append(after_stream)
        issued_chunk.append(prefetch_chunk(*a, after_stream=after_stream))
        return issued_chunk[-1]

    monkeypatch.setattr(pre, "prefetch_prefill_stream", checked_prefetch_chunk)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, _ = run_gpu(_requests(), SystemPolicy("directkv", "stream"), SPEC, mem=mem, sched_cfg=SCHED,
                         device="cuda", cuda_graphs=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5
    assert errors and all(e < 2e-2 for e in errors), errors  # a NaN fails the comparison
    assert used and all(used), used  # every layer's decode call was queued, with its own pools
    # a clean chunk per ring slot was copied ahead: of layer 0, or of layers 0 and 1 (and 2, 3)
    assert issued and max(issued) == slots
    layers = SPEC.num_layers
    if chunk_bytes:  # many decode chunks per layer; and prompt chunks' past, when it spans several ring chunks
        assert any(many) and max(issued_chunk) >= 1 and any(streamed for _, streamed in chunks)
        assert waits_chunk == [True, *[False] * (layers - 1)] * (len(waits_chunk) // layers), waits_chunk
        assert shared and all(shared), shared  # mixed steps streamed both rings, through one copy stream
    else:  # a past of <= 2 MiB of K is read in place by the tiled kernel: no ring, nothing copied ahead
        assert not issued_chunk and not any(streamed for _, streamed in chunks)
    assert any(past > 0 for past, _ in chunks)  # chunks with a past were served, streamed or in place


@pytest.mark.parametrize("name,variant", [("directkv", "tiled"), ("swap", ""), ("flexgen", "")])
def test_attention_gets_host_copies_equal_to_the_device_tables(runner, name, variant, monkeypatch):
    """Each step's attention is handed CPU copies of its decode and chunk tables (the CUDA kernels read their
    Traffic from them instead of syncing to read the device tables back); they must be the tables it attends
    with: swap's and flexgen's remapped staging tables, directkv's own."""
    from directkv.engine.gpu.paths import ZeroCopyPath

    seen = []
    inner = ZeroCopyPath.attention

    def attention(self, p, tier, q, k, v, k_pool, v_pool, decode_table, chunk_tables, *, tables_cpu=None):
        seen.append((p, decode_table, chunk_tables, tables_cpu))
        return inner(self, p, tier, q, k, v, k_pool, v_pool, decode_table, chunk_tables, tables_cpu=tables_cpu)

    monkeypatch.setattr(ZeroCopyPath, "attention", attention)
    _serve(SystemPolicy(name, variant), runner, _requests())
    assert seen and any(p.num_decodes for p, *_ in seen) and any(p.chunks for p, *_ in seen)
    for p, table, chunk_tables, ((host_table, host_lens), host_chunks) in seen:
        if p.num_decodes:
            assert torch.equal(host_table, table.cpu()) and torch.equal(host_lens, p.decode_lens.cpu())
        assert len(host_chunks) == len(chunk_tables)
        assert all(torch.equal(h, t.cpu()) for h, t in zip(host_chunks, chunk_tables, strict=True))


@pytest.mark.parametrize("name,variant,kernel,pipelining", [("cpu_attn", "", "flash", NO_PIPELINING),
                                                            ("cpu_attn", "", "native", NO_PIPELINING),
                                                            ("directkv", "tiled", "flash", TOY_PIPELINING)])
def test_prompt_chunks_get_host_copies_equal_to_their_tables(runner, name, variant, kernel, pipelining, monkeypatch):
    """The prompt chunks' attention (_chunks) is handed CPU copies of the chunk tables it attends with: cpu_attn's
    staging tables, and directkv's own when a pipelined step queues its chunks on the side stream."""
    from directkv.engine.gpu.paths import ZeroCopyPath

    seen = []
    inner = ZeroCopyPath._chunks

    def chunks(self, p, tier, variant, q, k, v, k_pool, v_pool, chunk_tables, out, **kw):
        seen.append((chunk_tables, kw.get("chunk_tables_cpu")))
        return inner(self, p, tier, variant, q, k, v, k_pool, v_pool, chunk_tables, out, **kw)

    monkeypatch.setattr(ZeroCopyPath, "_chunks", chunks)
    _serve(SystemPolicy(name, variant), runner, _requests(), cpu_attn_kernel=kernel, pipelining=pipelining)
    assert any(tables for tables, _ in seen)
    for tables, cpu in seen:
        assert cpu is not None and len(cpu) == len(tables)
        assert all(torch.equal(h, t.cpu()) for h, t in zip(cpu, tables, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,variant", [("directkv", "tiled"), ("directkv", "stream"), ("swap", "")])
def test_a_serving_steps_attention_calls_do_not_sync(name, variant, monkeypatch):
    """Every layer's attend of a real serving run (CUDA graphs on, prompt chunks and decodes) runs under torch's
    sync debug mode, which raises on a synchronising operation: a sync there would stall the copies queued
    ahead (stream) or the staging of the next layer (swap) until the host caught up. The step's planning
    (begin) is outside. The control, in the first call, must raise, so the check can fail."""
    from directkv.engine.gpu.paths import StagedPath, ZeroCopyPath

    cls = StagedPath if name == "swap" else ZeroCopyPath
    attend, calls = cls.attend, []

    def strict(self, layer, q, k, v):
        torch.cuda.set_sync_debug_mode("error")
        try:
            if not calls:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    q.float().sum().item()
            out = attend(self, layer, q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(layer)
        return out

    monkeypatch.setattr(cls, "attend", strict)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, _ = run_gpu(_requests(), SystemPolicy(name, variant), SPEC, mem=mem, sched_cfg=SCHED, device="cuda",
                         cuda_graphs=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and len(calls) >= 5 * SPEC.num_layers  # at least the 5 requests' steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_serving_steps_inputs_reach_the_runner_without_a_sync(monkeypatch):
    """The runner checks each step's token ids, positions and logit rows, then moves them to the GPU: the
    executor hands them over on the host, where the check is free (on the GPU it read them back, a device
    sync per step before any layer was queued). Runs under torch's sync debug mode; the control, in the first
    call, must raise, so the check can fail."""
    from directkv.model.runner import ModelRunner

    inputs, calls = ModelRunner._inputs, []

    def strict(self, tokens, positions, logits_rows):
        torch.cuda.set_sync_debug_mode("error")
        try:
            if not calls:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    torch.ones(1, device="cuda").sum().item()
            out = inputs(self, tokens, positions, logits_rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(tokens.device)
        return out

    monkeypatch.setattr(ModelRunner, "_inputs", strict)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, _ = run_gpu(_requests(), SystemPolicy("swap", ""), SPEC, mem=mem, sched_cfg=SCHED, device="cuda",
                         cuda_graphs=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and len(calls) >= 5 and all(d.type == "cpu" for d in calls)

