"""merge_stacked (one CUDA launch merging stacked attention passes by their LSE) against a float64 softmax."""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.merge_stacked import merge_stacked

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def reference(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """float64: weights softmax over passes, 0 for a pass of -inf LSE and for a row no pass saw."""
    lse64 = lse.double()
    w = torch.softmax(lse64, dim=0).nan_to_num(0.0)
    return (torch.where(w[..., None] > 0, o.double(), 0.0) * w[..., None]).sum(0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("parts,batch,heads,head_dim", [(1, 3, 4, 64), (2, 5, 32, 128), (3, 7, 8, 128), (6, 1, 2, 4)])
def test_merge_stacked_matches_a_float64_softmax_over_the_passes(dtype, parts, batch, heads, head_dim):
    """Random O and LSE (scaled so the weights differ by orders of magnitude); some (pass, row) pairs have -inf
    LSE with NaN O (a pass that saw none of the row's keys and never wrote it: it must not be read) and one row
    has -inf in every pass (zeros). out is a slice of a poisoned buffer: the rows after it must stay NaN."""
    gen = torch.Generator(device="cuda").manual_seed(parts * 1000 + batch)
    o = torch.randn(parts, batch, heads, head_dim, device="cuda", generator=gen)
    lse = 4 * torch.randn(parts, batch, heads, device="cuda", generator=gen)
    unseen = torch.rand(parts, batch, heads, device="cuda", generator=gen) < 0.3
    unseen[0] &= ~unseen.all(0)  # keep some rows seen by some pass ...
    unseen[:, -1, 0] = True  # ... and one row seen by none
    lse[unseen] = -math.inf
    o[unseen] = math.nan
    buf = torch.full((batch + 2, heads, head_dim), math.nan, dtype=dtype, device="cuda")
    merge_stacked(o, lse, buf[:batch])
    want = reference(o, lse)
    assert torch.isnan(buf[batch:]).all()  # nothing past out is written
    assert torch.equal(buf[batch - 1, 0].float(), torch.zeros(head_dim, device="cuda"))
    assert not torch.isnan(buf[:batch]).any()
    torch.testing.assert_close(buf[:batch].double(), want.to(dtype).double(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@needs_gpu
def test_merge_stacked_lets_a_nan_lse_show_in_its_row():
    """A NaN LSE (a broken pass) makes its row NaN, first pass or not, alone or beside -inf and finite passes;
    the other rows merge as usual (fmaxf alone would drop the NaN and give a finite or zero row)."""
    o = torch.randn(3, 4, 2, 8, device="cuda")
    lse = torch.randn(3, 4, 2, device="cuda")
    lse[0, 0, 0] = math.nan
    lse[2, 1, 1] = math.nan
    lse[:, 2, 0] = torch.tensor([-math.inf, math.nan, -math.inf], device="cuda")
    out = torch.empty(4, 2, 8, device="cuda")
    merge_stacked(o, lse, out)
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[0, 0] = bad[1, 1] = bad[2, 0] = True
    assert torch.isnan(out.cpu()[bad]).all() and not torch.isnan(out.cpu()[~bad]).any()
    torch.testing.assert_close(out[3].double(), reference(o[:, 3:], lse[:, 3:])[0], atol=1e-5, rtol=1e-5)


def test_merge_stacked_refuses_bad_shapes_in_one_line():
    """Checked before anything runs, so without a GPU too: CPU tensors, a shape mismatch, a half-precision o."""
    o, lse, out = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4), torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    for args in [(o, lse, out), (o, lse[:1], out), (o.half(), lse, out)]:
        with pytest.raises(ConfigError) as err:
            merge_stacked(*args)
        assert "\n" not in str(err.value) and "merge_stacked wants" in str(err.value) and "got o" in str(err.value)
