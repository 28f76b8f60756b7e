"""A CPU run on a machine with a GPU stays on the CPU. On the H200, 18 CPU tests of the executor failed under plain
pytest: the kernels, the host arena's pinning and flexgen's zero-copy views were picked by CUDA's presence, not by the
run's device. Here CUDA is made to look present and any touch of it fails, so this machine (no GPU) checks it too."""

import pytest
import torch
from test_gpu_executor import SCHED, SPEC, _requests

import directkv.kernels.cuda.zero_copy as zero_copy
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import SystemPolicy


@pytest.fixture
def cuda_looks_present(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a real GPU is present: the CPU tests themselves check this there")

    def touched(*args, **kwargs):
        raise AssertionError("a CPU run touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", touched)  # any CUDA tensor, stream, event or device query
    monkeypatch.setattr(zero_copy, "pinned_empty", touched)  # host_buffer pins through these
    monkeypatch.setattr(zero_copy, "device_view", touched)


@pytest.mark.parametrize("name,variant", [("hbm", ""), ("directkv", "tiled"), ("directkv", "naive"), ("swap", ""),
                                          ("cpu_attn", ""), ("flexgen", "")])
def test_every_system_serves_on_the_cpu_when_cuda_is_present(cuda_looks_present, name, variant):
    mem = MemoryConfig(hbm_budget_bytes=2e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    res, _ = run_gpu(_requests(), SystemPolicy(name, variant), SPEC, mem=mem, sched_cfg=SCHED, device="cpu")
    assert res.metrics["completed"] == 5


def test_the_fixture_catches_a_cuda_touch(cuda_looks_present):
    with pytest.raises(AssertionError, match="a CPU run touched CUDA"):
        torch.empty(4, device="cuda")
