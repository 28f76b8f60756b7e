"""The staged systems (swap, cpu_attn's prompt chunks, flexgen) copy only the pages that hold tokens cached before
the step: a page of this step's new tokens alone gets a staging page, filled by the scatter of the new K/V, and no
copy from the host. Served on the CPU with the staging pool poisoned before every step, a page wrongly left
uncopied (or a new token not scattered) turns the outputs into NaN and fails against hbm's."""

import pytest
import torch
from test_gpu_executor import _requests, _serve, runner  # noqa: F401 - runner is a fixture

from directkv.engine.gpu.paths import _Stager
from directkv.engine.systems import SystemPolicy
from directkv.errors import ConfigError


def test_stager_copies_only_pages_holding_older_tokens():
    pool = torch.arange(12 * 2, dtype=torch.float32).reshape(12, 2)
    stager = _Stager(lambda layer: [pool], torch.device("cpu"))
    lists = [[5, 4, 3], [9, 8], [4]]
    tables = stager.plan(lists, [1, 2, 0])  # 5 of the first list and 9, 8 hold older tokens; 4 and 3 only new ones
    assert stager.pages.tolist() == [3, 4, 5, 8, 9]
    assert stager.dma_runs.tolist() == [[5, 2, 1], [8, 3, 2]]  # (host page, staging index, pages)
    assert stager.layer_bytes == 3 * 2 * 4
    for buf in stager._pool:
        buf[0].fill_(float("nan"))
    stager.issue(0)
    staged = stager.acquire(0)[0]
    for pages, table in zip(lists, tables, strict=True):
        for page, e in zip(pages, table[0].tolist(), strict=True):
            row = staged[-(e + 1)]
            assert torch.equal(row, pool[page]) if page in (5, 8, 9) else row.isnan().all()
    # a page older in one list and new in another (not made by the KV manager, but defined) is copied
    stager.plan([[3], [3]], [0, 1])
    assert stager.dma_runs.tolist() == [[3, 0, 1]]
    stager.plan([[3], [4]], [0, 0])
    assert stager.dma_runs.tolist() == [] and stager.layer_bytes == 0
    with pytest.raises(ConfigError, match=r"past_pages has 1 entries for 2 page lists"):
        stager.plan([[3], [4]], [0])


@pytest.mark.parametrize("name", ["swap", "cpu_attn"])
def test_staged_systems_serve_what_hbm_serves_from_a_poisoned_staging_pool(runner, name, monkeypatch):  # noqa: F811
    plan, skipped = _Stager.plan, []

    def poisoned(self, page_lists, past_pages=None):
        tables = plan(self, page_lists, past_pages)
        for pair in self._pool:
            for t in pair:
                t.fill_(float("nan"))
        skipped.append(len(self.pages) - int(self.dma_runs[:, 2].sum()))
        return tables

    monkeypatch.setattr(_Stager, "plan", poisoned)
    reqs = _requests()
    res, st = _serve(SystemPolicy(name), runner, reqs)
    monkeypatch.setattr(_Stager, "plan", plan)
    ref_res, ref = _serve(SystemPolicy("hbm"), runner, reqs)
    assert st.outputs == ref.outputs and len(st.outs) == len(ref.outs)
    for a, b in zip(st.outs, ref.outs, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any(skipped), skipped  # prompt chunks' new pages were staged without a copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hbm_prefill", ["kernel", "sdpa"])
def test_swap_on_the_gpu_attends_what_zero_copy_attends_from_a_poisoned_staging_pool(hbm_prefill, monkeypatch):
    """swap on the GPU (the CUDA kernels, bf16), its staging pool poisoned before every step: each layer's output
    against the zero-copy tiled kernels over the same host pools, and with its prompt chunks attended by SDPA too
    (executor.hbm_prefill=sdpa)."""
    import math

    from test_gpu_executor import SCHED, SPEC

    from directkv.engine.gpu.executor import run_gpu
    from directkv.engine.gpu.paths import StagedPath, ZeroCopyPath
    from directkv.engine.sim_executor import MemoryConfig

    plan, attend, errors = _Stager.plan, StagedPath.attend, []

    def poisoned(self, page_lists, past_pages=None):
        tables = plan(self, page_lists, past_pages)
        for pair in self._pool:
            for t in pair:
                t.fill_(float("nan"))
        self.stream.wait_stream(torch.cuda.current_stream())  # the step's copies land after the poison
        return tables

    def checked(self, layer, q, k, v):
        out = attend(self, layer, q, k, v)
        k_pool, v_pool = self.kv.pools(layer, "host")
        again = ZeroCopyPath.attention(self, self.plan, "host", q, k, v, k_pool, v_pool, self.plan.decode_table,
                                       self.plan.chunk_tables)
        errors.append(math.nan if out.isnan().any() else (out.float() - again.float()).abs().max().item())
        return out

    monkeypatch.setattr(_Stager, "plan", poisoned)
    monkeypatch.setattr(StagedPath, "attend", checked)
    mem = MemoryConfig(hbm_budget_bytes=8e9, host_budget_bytes=1e9, runtime_overhead_bytes=0, page_size=16)
    try:
        res, extra = run_gpu(_requests(), SystemPolicy("swap"), SPEC, mem=mem, sched_cfg=SCHED, device="cuda",
                             hbm_prefill=hbm_prefill)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert res.metrics["completed"] == 5 and extra["hbm_prefill"] == hbm_prefill
    assert errors and all(e < 2e-2 for e in errors), errors  # a NaN fails the comparison


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_growing_staging_pool_reserves_one_pair_not_every_size_it_had():
    """Swap's pool grows by a quarter as the step's pages grow; torch once kept every outgrown pair cached (an OPT-13B
    3 x 32K run reserved 15.8 GB for 7.4 GB of staging). The device's reserved memory must follow the pair held."""
    pool = torch.randn(200, 64, 1024).pin_memory()  # 256 KB pages
    stager = _Stager(lambda layer: [pool], torch.device("cuda"))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    sizes = []
    for pages in range(64, 201, 8):  # ~6 growths: 64, 80, 100, 125, 156, 195, 243
        stager.plan([list(range(pages))])
        sizes.append(stager.capacity)
    assert len(set(sizes)) >= 6, sizes
    held = stager.nbytes
    assert held == 2 * stager.capacity * pool[0].numel() * 4
    assert torch.cuda.memory_reserved() - base <= held + (8 << 20), (torch.cuda.memory_reserved() - base, held)
