"""merge_strided.RunningMerge (the prefill stream's passes merged as they come) on the CPU, through the torch-op
merge: the same output as one merge of every pass, never more than `held` passes alive, and the folds
traffic_model.fold_count counts. The CUDA kernel's folds are checked on the GPU (test_cuda_merge_strided)."""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda import merge_strided as ms
from directkv.kernels.traffic_model import STREAM_HELD_PASSES, fold_count


def _passes(n: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n passes of O [5, 2, 3, 8] (bf16 and fp32 alternating, the flash and tiled passes' dtypes) and LSEs spread
    over orders of magnitude; about a third of (pass, row) pairs unseen (-inf LSE, NaN O that must not be read),
    and row (4, 1, 2) unseen by every pass."""
    parts = []
    for p in range(n):
        o = torch.randn(5, 2, 3, 8, generator=gen).to(torch.bfloat16 if p % 2 else torch.float32)
        lse = 4 * torch.randn(5, 2, 3, generator=gen)
        unseen = torch.rand(5, 2, 3, generator=gen) < 0.3
        unseen[4, 1, 2] = True
        if p == 0:
            unseen[0] = False
        lse[unseen], o[unseen] = -math.inf, math.nan
        parts.append((o, lse))
    return parts


def _float64(parts) -> torch.Tensor:
    lse = torch.stack([lse.double() for _, lse in parts])
    w = torch.softmax(lse, dim=0).nan_to_num(0.0)[..., None]
    return (torch.where(w > 0, torch.stack([o.double() for o, _ in parts]), 0.0) * w).sum(0)


@pytest.mark.parametrize("held", [2, 3, STREAM_HELD_PASSES])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 16, 23])
def test_running_merge_equals_one_merge_of_every_pass(n, held):
    gen = torch.Generator().manual_seed(n * 10 + held)
    parts = _passes(n, gen)
    running, alive, folds = ms.RunningMerge(held, kernel=False), [], 0
    for o, lse in parts:
        before = running.parts[0][1] if running.parts else None
        running.add(o, lse)
        folds += before is not None and running.parts[0][1] is not before  # a fold puts a new LSE first
        alive.append(len(running.parts))
    assert max(alive) <= held and folds == fold_count(n, held)
    out = torch.full((5, 2, 3, 8), math.nan)
    ms.merge_any(running.parts, out, kernel=False)
    want = _float64(parts)
    assert torch.equal(out[4, 1, 2], torch.zeros(8))  # seen by no pass: zeros, and its LSE stays -inf
    if n > held:
        assert running.parts[0][1][4, 1, 2] == -math.inf and running.parts[0][0].dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_running_merge_keeps_a_nan_lse_in_its_row():
    """A broken pass (NaN LSE) still makes its row NaN after it was folded away; the other rows are unharmed."""
    gen = torch.Generator().manual_seed(7)
    parts = _passes(5, gen)
    parts[1][1][2, 0, 1] = math.nan
    running = ms.RunningMerge(2, kernel=False)
    for part in parts:
        running.add(*part)
    out = torch.empty(5, 2, 3, 8)
    ms.merge_any(running.parts, out, kernel=False)
    assert out[2, 0, 1].isnan().all() and not out[0].isnan().any()


def test_fold_count_by_hand_and_bad_arguments():
    assert [fold_count(n, 8) for n in (0, 8, 9, 15, 16, 22, 23)] == [0, 0, 1, 1, 2, 2, 3]
    assert [fold_count(n, 2) for n in (2, 3, 4, 5)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="held=1"):
        fold_count(5, 1)
    for held in (1, ms.MAX_PARTS + 1):
        with pytest.raises(ConfigError, match=rf"RunningMerge holds 2\.\.32 passes \(the kernel merges at most 32\); got held={held}"):
            ms.RunningMerge(held)
