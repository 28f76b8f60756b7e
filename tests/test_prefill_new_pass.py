"""executor.prefill_new_pass: every system's path carries it (CPU), and on the GPU its flash pass serves what the
tiled kernel serves (test_gpu_executor's toy model and requests)."""

import pytest
import torch
from test_gpu_executor import SCHED, SPEC, _kv, _requests

from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import SystemPolicy
from directkv.errors import ConfigError


@pytest.mark.parametrize("name,variant", [("directkv", "tiled"), ("directkv", "naive"), ("hbm", ""), ("swap", ""),
                                          ("cpu_attn", ""), ("flexgen", "")])
def test_every_path_carries_the_prefill_new_pass(name, variant):
    """executor.prefill_new_pass reaches every system's path (all of them serve prompt chunks in _chunks)."""
    from directkv.engine.gpu.stepper import make_path

    policy = SystemPolicy(name, variant)
    path = make_path(policy, _kv(policy, _requests()), torch.device("cpu"), directkv_side_ctas=None,
                     prefill_new_pass="flash")
    assert path.prefill_new_pass == "flash"
    with pytest.raises(ConfigError, match=r"unknown prefill_new_pass 'sdpa'; valid: flash, kernel"):
        make_path(policy, _kv(policy, _requests()), torch.device("cpu"), directkv_side_ctas=None,
                  prefill_new_pass="sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,variant", [("swap", ""), ("directkv", "tiled"), ("directkv", "stream")])
def test_prefill_new_pass_flash_serves_what_the_kernel_serves(name, variant, monkeypatch):
    """executor.prefill_new_pass=flash in a real serving run (CUDA graphs on, chunked prompts with and without a
    past): every tiled prompt chunk's call gets new_pass="flash", and its output matches the same call with the
    new tokens in the tiled kernel (new_pass="kernel", recomputed beside it). Streamed chunks keep their own
    flash passes and get no new_pass. directkv's chunks with no past go to the kernel too (no_past_prefill="kernel";
    by default they are one SDPA call and never reach prefill), so both kinds are checked."""
    from directkv.engine.gpu.paths import ZeroCopyPath

    init, seen = ZeroCopyPath.__init__, []

    def checking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        prefill = self.prefill

        def both(q, k, v, kv, *, variant, **opts):
            got = prefill(q, k, v, kv, variant=variant, **opts)
            if opts.get("new_pass") == "flash":
                again = dict(opts, new_pass="kernel", out=torch.full_like(q, float("nan")))
                ref = prefill(q, k, v, kv, variant=variant, **again)[0]
                err = (got[0].float() - ref.float()).abs().max().item()
                seen.append((int(kv.seq_lens[0]), err))
            else:
                assert variant != "tiled", "a tiled prompt chunk was served without new_pass"
            return got

        self.prefill = both

    monkeypatch.setattr(ZeroCopyPath, "__init__", checking_init)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy(name, variant), SPEC, mem=mem, sched_cfg=SCHED, device="cuda",
                             cuda_graphs=True, prefill_new_pass="flash", no_past_prefill="kernel")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["prefill_new_pass"] == "flash"
    assert seen and any(past == 0 for past, _ in seen) and any(past > 0 for past, _ in seen)
    assert all(err < 2e-2 for _, err in seen), seen  # bf16 outputs; a NaN fails the comparison
