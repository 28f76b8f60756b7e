"""executor.directkv_stream_slots: validated at setup (CPU), carried to directkv's path, and on the GPU a stream
decode ring of that many slots serves the toy requests and is recorded on the row."""

import pytest
import torch
from test_experiments import _compose
from test_gpu_executor import SCHED, SPEC, _kv, _requests

from directkv.engine.gpu.executor import run_gpu
from directkv.engine.sim_executor import MemoryConfig
from directkv.engine.systems import SystemPolicy
from directkv.errors import ConfigError
from experiments.common import setup


def test_setup_takes_the_slots_and_refuses_fewer_than_two():
    assert setup(_compose(["run_id=t", "device=cpu"])).stream_slots == 2
    assert setup(_compose(["run_id=t", "device=cpu", "executor.directkv_stream_slots=4"])).stream_slots == 4
    for bad in ("1", "true", "2.5", "four"):
        with pytest.raises(ConfigError, match=r"executor.directkv_stream_slots must be an int >= 2 \(.*\); got "):
            setup(_compose(["run_id=t", "device=cpu", f"executor.directkv_stream_slots={bad}"]))


def test_make_path_gives_directkv_its_slots():
    from directkv.engine.gpu.stepper import make_path

    policy = SystemPolicy("directkv", "tiled")
    path = make_path(policy, _kv(policy, _requests()), torch.device("cpu"), directkv_side_ctas=None, stream_slots=4)
    assert path.stream_slots == 4


def test_run_gpu_refuses_bad_slots_before_any_work():
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    with pytest.raises(ConfigError, match=r"stream_slots \(executor.directkv_stream_slots\) must be an int >= 2 \(.*\); got 1"):
        run_gpu(_requests(), SystemPolicy("directkv", "tiled"), SPEC, mem=mem, sched_cfg=SCHED, device="cpu",
                stream_slots=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_four_slot_ring_serves_and_is_recorded(monkeypatch):
    import directkv.engine.gpu.paths as paths

    plan_stream, rings = paths.plan_stream, []

    def recording(*args, **kwargs):
        plan = plan_stream(*args, **kwargs)
        rings.append(plan.ring_k.shape[0])
        return plan

    monkeypatch.setattr(paths, "plan_stream", recording)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy("directkv", "stream"), SPEC, mem=mem, sched_cfg=SCHED,
                             device="cuda", cuda_graphs=True, stream_slots=4)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["directkv_stream_slots"] == 4
    assert rings and set(rings) == {4}
