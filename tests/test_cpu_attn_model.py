"""cpu_attn's layer in the cost model (systems.cpu_attn_layer): cut decode-only steps overlap their two parts,
uncut steps add their GPU and CPU parts, a step too large for the graphs runs at the host's eager pace, and the
per-decode CPU time scales with the decodes."""

from dataclasses import replace

import pytest

from directkv.costmodel import CostModel
from directkv.engine.state import PrefillChunk, ReqState, Step
from directkv.engine.step_traffic import linear_layer_traffic
from directkv.engine.systems import SystemPolicy, step_cost
from directkv.host_time import GRAPH_MAX_TOKENS, HostTime
from directkv.specs import get_hardware, get_model
from workloads.request import Request

LLAMA = get_model("llama-3.1-8b")
L = LLAMA.num_layers
CPU = SystemPolicy("cpu_attn")
# no fitted fixed times and no host time, so each test sets the one it looks at
BARE = CostModel.for_hardware(get_hardware("h200-pcie5"))
BARE = replace(BARE, eff=replace(BARE.eff, cpu_attn_us_per_layer=0.0, cpu_attn_us_per_decode=0.0,
                                 dense_us_per_layer=0.0), host={})


def _decodes(n: int, context: int, first: int = 0) -> tuple:
    return tuple(ReqState(Request(first + i, context, 8), prefilled=context, generated=1) for i in range(n))


def _chunk(tokens: int) -> tuple:
    return (PrefillChunk(ReqState(Request(999, tokens, 8)), tokens, 0),)


def _cpu_s(cm: CostModel, decodes: tuple) -> float:
    """The CPU attention of `decodes` in one layer (the model's own formula)."""
    tokens = sum(Step(decodes, ()).decode_kv_lens)
    kvl = LLAMA.kv_bytes_per_token_per_layer()
    return cm.cpu_attention_time(tokens * kvl, tokens * LLAMA.num_heads)


def test_an_uncut_step_adds_the_cpu_attention_to_its_dense_work():
    """One decode (never cut): the next layer's dense work waits for the CPU's output, so a longer CPU attention
    adds to the step in full (an overlap would hide it under the dense work). H200, 2026-12-02: mixed steps took
    78 ms measured against 48 simulated as an overlap."""
    short, long = (step_cost(CPU, Step(_decodes(1, n), ()), LLAMA, BARE).time_s for n in (64, 4096))
    extra = _cpu_s(BARE, _decodes(1, 4096)) - _cpu_s(BARE, _decodes(1, 64))
    assert extra > 0 and long - short == pytest.approx(L * extra, rel=0.02)


def test_a_cut_decode_step_overlaps_one_part_s_cpu_attention_with_the_other_part_s_dense_work():
    """Decode-only steps of >= 2 decodes run as two parts: a layer is the longest of the GPU's sum, the CPU's sum
    and each part's own chain (dense, CPU, handoffs), less than running both parts in series."""
    h = 400.0
    cm = replace(BARE, eff=replace(BARE.eff, cpu_attn_us_per_layer=h))
    d = _decodes(8, 2048)
    got = step_cost(CPU, Step(d, ()), LLAMA, cm).time_s / L
    dense = cm.dense_time(linear_layer_traffic(LLAMA, 4))
    cpu = _cpu_s(cm, d[:4])
    assert got < 2 * (dense + cpu + h * 1e-6)  # the parts overlap
    assert got >= max(2 * dense, 2 * cpu, dense + cpu + h * 1e-6) - 1e-9
    assert got == pytest.approx(max(2 * dense, 2 * cpu, dense + cpu + h * 1e-6), rel=0.05)  # the store and Q / O are small


def test_the_per_decode_cpu_time_scales_with_the_decodes():
    k = 20.0
    cm = replace(BARE, eff=replace(BARE.eff, cpu_attn_us_per_decode=k))
    for n in (1, 9):  # one part of 1 (uncut); two parts of 4 / 5 whose CPU sum bounds the layer
        step = Step(_decodes(n, 16384), ())
        extra = step_cost(CPU, step, LLAMA, cm).time_s - step_cost(CPU, step, LLAMA, BARE).time_s
        assert extra == pytest.approx(L * n * k * 1e-6, rel=0.02)


def test_an_eager_mixed_step_runs_its_dense_work_at_the_host_s_issue_pace():
    """A mixed step above the graphs' largest bucket: the Q copy drains the GPU's queue each layer, so the layer's
    dense kernels run as the host issues them (hbm's eager issue time per layer, shared by the runner). With
    graphs the same step within the bucket does not pay it; with graphs off it does."""
    slow = replace(BARE, host={"hbm": HostTime(0.0, 0.0, 5000.0)})  # far above any dense time here
    big = Step(_decodes(2, 512), _chunk(GRAPH_MAX_TOKENS))  # 258 tokens: eager
    small = Step(_decodes(2, 512), _chunk(64))
    assert step_cost(CPU, big, LLAMA, slow).time_s > L * 5e-3
    assert step_cost(CPU, small, LLAMA, slow).time_s == pytest.approx(step_cost(CPU, small, LLAMA, BARE).time_s)
    assert step_cost(CPU, small, LLAMA, slow, graphs=False).time_s > L * 5e-3
    prompt_only = Step((), _chunk(1024))  # no decodes: no Q copy; its eager floor is the host time's (step_seconds)
    assert step_cost(CPU, prompt_only, LLAMA, slow).time_s == pytest.approx(
        step_cost(CPU, prompt_only, LLAMA, BARE).time_s)
    cut = Step(_decodes(600, 64), ())  # two parts of 300 rows: each issues eagerly after waiting on its CPU half
    assert step_cost(CPU, cut, LLAMA, slow).time_s > 2 * L * 5e-3


def test_the_simulation_hands_its_graphs_setting_to_the_layer_model():
    """CostModelStepper passes executor.cuda_graphs to step_cost: with graphs off, cpu_attn's small steps pay the
    eager pace in their layers (cpu_attn's own host time here has no floor, so only the layer model can add it)."""
    from directkv.engine.sim_executor import MemoryConfig, simulate
    from workloads import synthetic_workload

    cm = replace(BARE, host={"hbm": HostTime(0.0, 0.0, 5000.0), "cpu_attn": HostTime(0.0, 0.0, 0.0)})
    reqs = synthetic_workload(1, 256, 4).requests
    mem = MemoryConfig(hbm_budget_bytes=96e9, host_budget_bytes=100e9)
    on, off = (simulate(reqs, CPU, LLAMA, cm, mem=mem, cuda_graphs=g).metrics["mean_tpot_ms"] for g in (True, False))
    assert on < L * 5.0 <= off
