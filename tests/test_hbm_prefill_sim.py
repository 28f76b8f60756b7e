"""The simulation of executor.hbm_prefill: with `sdpa`, the prompt chunks of hbm and of the staged systems are charged
as one SDPA call each (sdpa_chunk_traffic at FlashAttention's fitted efficiency), as the GPU executor runs them;
the decodes keep the tiled kernel, and nothing changes on the link."""

from dataclasses import replace
from pathlib import Path

import pytest

from directkv.costmodel import CostModel
from directkv.engine import step_traffic as st
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.state import PrefillChunk, ReqState, Step
from directkv.engine.systems import SystemPolicy, hbm_attention, step_cost
from directkv.errors import ConfigError
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import sdpa_chunk_traffic
from directkv.specs import get_hardware, get_model
from workloads.request import Request
from workloads.synthetic import synthetic_workload

LLAMA = get_model("llama-3.1-8b")
CM = CostModel.for_hardware(get_hardware("h200-pcie5"))
SHAPE = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)


def _step(decodes: int, chunks: list[tuple[int, int]]) -> Step:
    """`decodes` decodes at 4K and prompt chunks of (new tokens, past tokens)."""
    dec = tuple(ReqState(Request(i, 4096, 8), prefilled=4096, generated=1) for i in range(decodes))
    pre = tuple(PrefillChunk(ReqState(Request(100 + i, past + new, 8), prefilled=past), new, past)
                for i, (new, past) in enumerate(chunks))
    return Step(dec, pre)


def test_sdpa_charges_each_chunk_as_one_flash_call_beside_the_decodes_kernel():
    step, policy = _step(3, [(2048, 16384), (37, 0)]), SystemPolicy("swap")
    traffic, t = hbm_attention(step, LLAMA, CM, policy, "sdpa", store_bytes=1000)
    dec = st.to_hbm(st.attention_traffic(_step(3, []), LLAMA, "tiled", policy)) + Traffic(hbm_write_bytes=1000)
    # each chunk: SDPA's bytes and FLOPs, and the store of its new K/V into HBM pages (K and V, 4 KiB a token)
    chunks = [sdpa_chunk_traffic(2048, 16384, **SHAPE) + Traffic(hbm_write_bytes=2048 * 4096),
              sdpa_chunk_traffic(37, 0, **SHAPE) + Traffic(hbm_write_bytes=37 * 4096)]
    assert traffic == dec + chunks[0] + chunks[1]
    assert t == pytest.approx(CM.time(dec) + sum(CM.time(c, flops_kind="flash_attention") for c in chunks))
    # no chunk, or the kernel: the tiled kernel's one roofline, the store inside it, as before the option
    for step_, name in [(_step(3, []), "sdpa"), (step, "kernel")]:
        whole = st.to_hbm(st.attention_traffic(step_, LLAMA, "tiled", policy)) + Traffic(hbm_write_bytes=1000)
        assert hbm_attention(step_, LLAMA, CM, policy, name, store_bytes=1000) == (whole, CM.time(whole))
    # a prompt-only step has no decode kernel to charge
    alone, t_alone = hbm_attention(_step(0, [(2048, 16384)]), LLAMA, CM, policy, "sdpa")
    assert alone == chunks[0] and t_alone == pytest.approx(CM.time(chunks[0], flops_kind="flash_attention"))
    # the kernel's traffic of a chunk holds the same store: only the attention's bytes and FLOPs differ
    kernel_chunk = st.to_hbm(st.attention_traffic(_step(0, [(2048, 16384)]), LLAMA, "tiled", policy))
    assert kernel_chunk.hbm_write_bytes >= 2048 * 4096
    with pytest.raises(ConfigError, match=r"unknown executor.hbm_prefill 'Kernel'; valid: kernel, sdpa"):
        hbm_attention(step, LLAMA, CM, policy, "Kernel")


@pytest.mark.parametrize("name", ["hbm", "swap"])
def test_the_kernel_path_costs_what_it_did_before_the_option(name):
    """The default: the tiled kernel's one roofline per layer; hbm's store of the new K/V charged on top of the
    kernel's traffic (as step_cost did before hbm_attention), swap's layer the longer of its copy in and its GPU
    work, which holds the store of the new K/V to host memory by SM writes (scatter_rows, before the attention)."""
    step, policy = _step(2, [(2048, 16384)]), SystemPolicy(name)
    cost = step_cost(policy, step, LLAMA, CM)
    lin = st.linear_layer_traffic(LLAMA, step.num_tokens)
    head = st.lm_head_traffic(LLAMA, step.num_logits)
    attn = st.to_hbm(st.attention_traffic(step, LLAMA, "tiled", policy))
    kvl = LLAMA.kv_bytes_per_token_per_layer()
    if name == "hbm":
        attn.hbm_write_bytes += step.num_tokens * kvl
        layer_t = CM.dense_time(lin) + CM.time(attn)
    else:
        past = st.past_kv_tokens(step) * kvl
        store = step.num_tokens * kvl / (CM.hw.link_sm_write_gbps * 1e9 * CM.eff.link_sm)
        layer_t = max(CM.copy_time(past, "h2d"), CM.dense_time(lin) + store + CM.time(attn))
    assert cost.time_s == pytest.approx(LLAMA.num_layers * layer_t + CM.time(head, flops_kind="matmul"))
    assert cost.traffic.hbm_write_bytes == (lin + attn).scaled(LLAMA.num_layers).hbm_write_bytes + head.hbm_write_bytes

@pytest.mark.parametrize("name", ["hbm", "swap", "flexgen", "cpu_attn"])
def test_the_option_reaches_every_system_with_hbm_prompt_chunks(name):
    """A 2,048-token chunk over a 16K past: the measured SDPA path is faster than the kernel there (H200,
    2026-12-02, swap at Llama-3.1-8B 32K: prompt steps ~10% shorter), and the model says so; link bytes equal."""
    step, policy = _step(2, [(2048, 16384)]), SystemPolicy(name)
    kernel, sdpa = (step_cost(policy, step, LLAMA, CM, hbm_prefill=h) for h in ("kernel", "sdpa"))
    assert sdpa.time_s < kernel.time_s


def test_simulate_takes_and_checks_the_option():
    reqs = synthetic_workload(2, 4096, 4).requests
    mem = MemoryConfig(hbm_budget_bytes=96e9, host_budget_bytes=400e9)
    kernel, sdpa = (simulate(reqs, SystemPolicy("swap"), LLAMA, CM, mem=mem, hbm_prefill=h) for h in ("kernel", "sdpa"))
    assert sdpa.duration_s < kernel.duration_s  # the prompt steps over a past: FlashAttention's fitted rate
    with pytest.raises(ConfigError, match=r"unknown executor.hbm_prefill 'flash'; valid: kernel, sdpa"):
        simulate(reqs, SystemPolicy("swap"), LLAMA, CM, mem=mem, hbm_prefill="flash")


def test_simulated_rows_say_which_prompt_attention_they_model(tmp_path):
    import pandas as pd
    from test_experiments import _compose

    from experiments.run import run_experiment

    rows = {}
    for h in ("kernel", "sdpa"):
        cfg = _compose(["+exp=context_sweep", "run_id=t", "progress=false", "render=false", "device=cpu",
                        "contexts=[4096]", "batch_size=2", "output_len=4", "system.names=[swap]",
                        f"executor.hbm_prefill={h}"])
        rows[h] = pd.read_parquet(run_experiment(cfg, tmp_path / h)).iloc[0]
    assert (rows["kernel"]["hbm_prefill"], rows["sdpa"]["hbm_prefill"]) == ("kernel", "sdpa")
    assert rows["sdpa"]["tpot_ms"] < rows["kernel"]["tpot_ms"]


def test_a_measured_sdpa_row_has_no_twin_in_a_simulation_that_modelled_the_kernel():
    """plots.compare pairs a measured row with the simulated row of its options; simulated rows from before they
    said hbm_prefill modelled the kernel, so they pair with kernel rows of the HBM-page systems only."""
    import pandas as pd

    from plots.compare import _twin

    old_sim = pd.DataFrame([{"system": "swap", "mode": "simulated", "tpot_ms": 1.0}])
    new_sim = pd.DataFrame([{"system": "swap", "mode": "simulated", "tpot_ms": 2.0, "hbm_prefill": "sdpa"}])
    sdpa = pd.Series({"system": "swap", "mode": "measured", "hbm_prefill": "sdpa"})
    kernel = pd.Series({"system": "swap", "mode": "measured", "hbm_prefill": "kernel"})
    assert _twin(old_sim, sdpa).empty and _twin(old_sim, kernel)["tpot_ms"].tolist() == [1.0]
    assert _twin(new_sim, sdpa)["tpot_ms"].tolist() == [2.0] and _twin(new_sim, kernel).empty
    # directkv's numbers never depended on it
    dkv = pd.Series({"system": "directkv", "mode": "measured", "hbm_prefill": "sdpa"})
    assert _twin(old_sim.assign(system="directkv"), dkv)["tpot_ms"].tolist() == [1.0]


def test_resimulate_leaves_the_column_out_for_a_run_from_before_the_key():
    from experiments.resimulate import resimulate

    runs = Path(__file__).resolve().parents[1] / "results" / "h200" / "context_sweep"
    old = resimulate(runs / "20261201-213142")  # before executor.hbm_prefill: the kernel, no column
    assert "hbm_prefill" not in old.columns
    new = resimulate(runs / "20261202-051145")  # OPT-13B 16K with hbm_prefill=sdpa
    assert set(new["hbm_prefill"]) == {"sdpa"}


def test_a_store_to_host_memory_is_charged_before_the_kernel_not_inside_its_roofline():
    # the executor stores a layer's new K/V by SM writes (scatter_rows) and then runs the kernel, on one stream:
    # the store cannot hide behind the kernel's reads or math, in any system with a host tier
    from directkv.engine.systems import sm_store_time, zero_copy_attention

    step, policy = _step(2, [(2048, 16384)]), SystemPolicy("directkv", "tiled")
    traffic = st.attention_traffic(step, LLAMA, "tiled", policy)
    assert traffic.link_write_bytes == step.num_tokens * LLAMA.kv_bytes_per_token_per_layer()
    store = sm_store_time(CM, traffic.link_write_bytes)
    assert store == pytest.approx(traffic.link_write_bytes / (CM.hw.link_sm_write_gbps * 1e9 * CM.eff.link_sm))
    alone = CM.time(replace(traffic, link_write_bytes=0), link="sm")
    got, store_t, kernels_t = zero_copy_attention(step, LLAMA, CM, policy, "tiled", "kernel")
    assert got == traffic and store_t == pytest.approx(store) and kernels_t == pytest.approx(alone)
    assert store_t + kernels_t > CM.time(traffic, link="sm")  # where the roofline hid it
    assert sm_store_time(CM, 0) == 0.0


@pytest.mark.parametrize("system", [("swap", ""), ("flexgen", ""), ("cpu_attn", ""), ("directkv", "tiled"),
                                    ("directkv", "stream"), ("hbm", "")])
def test_every_host_tier_system_waits_for_its_store_and_hbm_does_not(system):
    # a prompt chunk with no past: nothing to copy in, so the store lies on the GPU's critical path wherever the
    # executor stores to host memory (scatter_rows before the attention); with SM writes made (nearly) free the
    # step gets faster by exactly the stores' time; hbm stores into HBM and does not move
    from directkv.engine.systems import sm_store_time

    policy, step = SystemPolicy(*system), _step(0, [(4096, 0)])
    fast = CostModel(replace(CM.hw, link_sm_write_gbps=1e12), CM.eff)
    with_store, without = (step_cost(policy, step, LLAMA, cm, hbm_prefill="sdpa") for cm in (CM, fast))
    stored = policy.kv_bytes_per_token(LLAMA) * 4096 // LLAMA.num_layers if system[0] == "flexgen" else \
        4096 * LLAMA.kv_bytes_per_token_per_layer()
    expected = 0.0 if system[0] == "hbm" else LLAMA.num_layers * sm_store_time(CM, stored)
    assert with_store.time_s - without.time_s == pytest.approx(expected, rel=1e-3, abs=1e-6)
