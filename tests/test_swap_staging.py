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
