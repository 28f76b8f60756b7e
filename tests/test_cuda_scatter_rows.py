"""scatter_rows: one launch storing rows of one or two tensors (a serving step's new K and V) at given rows."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import directkv.kernels.cuda.scatter_rows as scatter_mod
from directkv.errors import ConfigError
from directkv.kernels.cuda.scatter_rows import scatter_rows

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(device: str, dtype: torch.dtype, pages: int, page_size: int, row: tuple, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randn(pages, page_size, *row, generator=gen).to(dtype) for _ in range(2)]
    src = [torch.randn(n, *row, generator=gen).to(dtype) for _ in range(2)]
    rows = torch.randperm(pages * page_size, generator=gen)[:n]
    return [p.to(device) for p in pools], [s.to(device) for s in src], rows.to(device)


def test_scatter_rows_off_cuda_is_the_index_put_it_replaces():
    pools, src, rows = _case("cpu", torch.bfloat16, 5, 4, (2, 8), 7, 0)
    want = [p.clone() for p in pools]
    for w, s in zip(want, src, strict=True):
        w.view(-1, 2, 8)[rows] = s
    scatter_rows(pools, src, rows)
    assert all(torch.equal(p, w) for p, w in zip(pools, want, strict=True))
    pick = torch.tensor([6, 0, 3])
    scatter_rows(pools[:1], src[:1], rows[:3], pick)
    want[0].view(-1, 2, 8)[rows[:3]] = src[0][pick]
    assert torch.equal(pools[0], want[0])


def test_scatter_rows_takes_a_strided_src_the_way_index_put_does():
    pools, src, rows = _case("cpu", torch.bfloat16, 5, 4, (2, 8), 7, 2)
    strided = [torch.stack([t, t], dim=1)[:, 0] for t in src]  # every other row of a [7, 2, 2, 8] tensor
    assert not strided[0].is_contiguous()
    want = [p.clone() for p in pools]
    for w, t in zip(want, src, strict=True):
        w.view(-1, 2, 8)[rows] = t
    scatter_rows(pools, strided, rows)
    assert all(torch.equal(p, w) for p, w in zip(pools, want, strict=True))


def test_scatter_rows_refuses_bad_arguments_in_one_line():
    pools, src, rows = _case("cpu", torch.float16, 3, 4, (1, 8), 5, 1)
    bad = [(pools, src[:1], rows), (pools, src, rows.int()), (pools, src, rows[:2]),
           (pools, [s.float() for s in src], rows), (pools, src, rows[:2], torch.tensor([0, 1], dtype=torch.int32)),
           (pools, [src[0], src[1].float()], rows)]  # the second src of another dtype than the first
    for args in bad:
        with pytest.raises(ConfigError) as err:
            scatter_rows(*args)
        assert "\n" not in str(err.value) and "scatter_rows wants" in str(err.value)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row,host", [((8, 128), True), ((8, 128), False), ((1, 64), True), ((4, 3), False)])
@pytest.mark.parametrize("pairs,gather", [(2, False), (1, False), (2, True)])
def test_scatter_rows_on_the_gpu_writes_exactly_the_given_rows(dtype, row, host, pairs, gather, monkeypatch):
    """Random pools (a zero-copy view of pinned memory where `host`, as the KV arena's), random distinct rows,
    optionally a gather of src rows; every other row of the pools must keep its value. Each pool is the second
    layer of a two-layer tensor (a view at a non-zero offset, as the arena's per-layer views are). Rows of whole
    16-byte vectors take the kernel (one launch per call, counted), a 24-byte row the index_put fallback. The
    call runs on a side stream given as `stream`; the result is read after that stream."""
    from directkv.kernels.cuda.zero_copy import device_view, pinned_empty

    seed = zlib.crc32(repr((dtype, row, host, pairs, gather)).encode())  # stable across processes
    pools, src, rows = _case("cpu", dtype, 37, 16, row, 101, seed)
    want = [p.clone() for p in pools]
    pick = torch.randperm(101, generator=torch.Generator().manual_seed(seed))[:57] if gather else None
    dst_rows = rows[:57] if gather else rows
    for w, s in zip(want, src, strict=True):
        w.view(-1, *row)[dst_rows] = s if pick is None else s[pick]

    def place(t):  # layer 1 of [2, *t.shape], layer 0 NaN
        both = torch.stack([torch.full_like(t, math.nan), t])
        if not host:
            return both.cuda()[1]
        pinned = pinned_empty(both.shape, t.dtype)
        pinned.copy_(both)
        return device_view(pinned)[1]

    dst = [place(p) for p in pools][:pairs]
    args = ([s.cuda() for s in src][:pairs], dst_rows.cuda(), None if pick is None else pick.cuda())
    loads = []
    real = scatter_mod._module
    monkeypatch.setattr(scatter_mod, "_module", lambda: loads.append("scatter_rows") or real())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the copies to the GPU above precede the call
    scatter_rows(dst, *args, stream=side.cuda_stream)
    side.synchronize()
    assert loads == (["scatter_rows"] if math.prod(row) * 2 % 16 == 0 else [])
    for d, w in zip(dst, want, strict=False):
        assert torch.equal(d.cpu(), w)
