"""merge_strided (one CUDA launch merging attention passes of any layout by their LSE) against a float64 softmax,
the prefill stream variant's use of it, and merge_passes, its torch-op twin for what the kernel does not take."""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda import merge_strided as ms

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# a part's O as a permutation of a buffer laid out in this order of (A, B, C, D): as the prefill stream's passes
LAYOUTS = {"abcd": (0, 1, 2, 3), "bacd": (1, 0, 2, 3), "bcad": (1, 2, 0, 3), "cabd": (2, 0, 1, 3)}


def _strided(shape: tuple[int, ...], order: tuple[int, ...], dtype, gen) -> torch.Tensor:
    """A random `shape` tensor stored in dimension order `order` (a permuted view of a contiguous buffer)."""
    buf = torch.randn([shape[i] for i in order], device="cuda", generator=gen).to(dtype)
    return buf.permute(*[order.index(i) for i in range(len(shape))])


def _reference(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """float64: weights softmax over passes, 0 for a pass of -inf LSE (its O not read) and for a row no pass saw."""
    lse = torch.stack([lse.double() for _, lse in parts])
    w = torch.softmax(lse, dim=0).nan_to_num(0.0)[..., None]
    o = torch.stack([o.double() for o, _ in parts])
    return (torch.where(w > 0, o, 0.0) * w).sum(0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dims,head_dim,num_parts", [((3, 2, 4), 64, 1), ((33, 8, 4), 128, 5), ((7, 1, 1), 4, 17),
                                                     ((5, 4, 1), 128, 32)])
def test_merge_strided_matches_a_float64_softmax_over_the_passes(out_dtype, dims, head_dim, num_parts):
    """Passes in four layouts and three dtypes, mixed in one merge; LSEs scaled so the weights differ by orders of
    magnitude and permuted too; some (pass, row) pairs have -inf LSE with NaN O (never read) and one row has -inf
    in every pass (zeros). out is the front of a poisoned buffer: the row after it must stay NaN."""
    gen = torch.Generator(device="cuda").manual_seed(num_parts * 100 + head_dim)
    shape = (*dims, head_dim)
    parts = []
    for p in range(num_parts):
        order = list(LAYOUTS.values())[p % len(LAYOUTS)]
        o = _strided(shape, order, (torch.bfloat16, torch.float32, torch.float16)[p % 3], gen)
        lse = 4 * _strided(dims, tuple(i for i in order if i < 3), torch.float32, gen)
        parts.append((o, lse))
    unseen = torch.rand(num_parts, *dims, device="cuda", generator=gen) < 0.3
    unseen[0] &= ~unseen.all(0)  # keep some rows seen by some pass ...
    unseen[:, -1, -1, -1] = True  # ... and one row seen by none
    for (o, lse), u in zip(parts, unseen, strict=True):
        lse[u] = -math.inf
        o[u] = math.nan
    buf = torch.full((dims[0] + 1, *shape[1:]), math.nan, dtype=out_dtype, device="cuda")
    out = buf[: dims[0]]
    assert ms.accepts(parts, out)
    assert ms.merge_strided(parts, out).data_ptr() == out.data_ptr()
    want = _reference(parts)
    assert torch.isnan(buf[dims[0]:]).all()  # nothing past out is written
    assert torch.equal(out[-1, -1, -1].float(), torch.zeros(head_dim, device="cuda"))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want.to(out_dtype).double(), atol=TOL[out_dtype], rtol=TOL[out_dtype])


@pytest.mark.gpu
@needs_gpu
def test_merge_strided_lets_a_nan_lse_show_in_its_row():
    """A NaN LSE (a broken pass) makes its row NaN, first pass or not; the other rows merge as usual."""
    o = [torch.randn(4, 2, 1, 8, device="cuda") for _ in range(3)]
    lse = [torch.randn(4, 2, 1, device="cuda") for _ in range(3)]
    lse[0][0, 0, 0] = math.nan
    lse[2][1, 1, 0] = math.nan
    out = torch.empty(4, 2, 1, 8, device="cuda")
    ms.merge_strided(list(zip(o, lse, strict=True)), out)
    assert out[0, 0].isnan().all() and out[1, 1].isnan().all()
    rest = torch.ones(4, 2, dtype=torch.bool)
    rest[0, 0] = rest[1, 1] = False
    want = _reference(list(zip(o, lse, strict=True)))
    torch.testing.assert_close(out[rest].double(), want[rest], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_merge_strided_refuses_what_it_cannot_read():
    """Each refusal is a ConfigError naming the shapes, dtypes and strides it got, and accepts() says no first:
    too many passes, an fp16 LSE, an O starting off a 4-element boundary (fp32 and bf16), strides not multiples
    of 4, a head_dim that is not unit-stride (the kernel never sees that stride), a shape unlike out's, an out
    with gaps."""
    out = torch.empty(3, 2, 4, 8, device="cuda")
    o, lse = torch.randn(3, 2, 4, 8, device="cuda"), torch.randn(3, 2, 4, device="cuda")
    odd = torch.randn(3 * 2 * 4 * 8 + 1, device="cuda")[1:].view(3, 2, 4, 8)
    narrow = torch.randn(3, 2, 4, 10, device="cuda")[..., :8]  # strides (80, 40, 10, 1)
    spaced = torch.randn(3, 2, 4, 8, 4, device="cuda")[..., 0]  # strides (256, 128, 32, 4): D not unit-stride
    odd_bf16 = torch.randn(3 * 2 * 4 * 8 + 2, device="cuda").bfloat16()[2:].view(3, 2, 4, 8)  # starts 4 B in
    bad = {"too many passes": ([(o, lse)] * (ms.MAX_PARTS + 1), out),
           "an fp16 LSE": ([(o, lse.half())], out),
           "a misaligned O": ([(odd, lse)], out),
           "strides not multiples of 4": ([(narrow, lse)], out),
           "a head_dim stride of 4": ([(spaced, lse)], out),
           "a bf16 O starting 2 elements in": ([(odd_bf16, lse)], out),
           "another shape": ([(o[:2], lse[:2])], out),
           "an out with gaps": ([(o, lse)], torch.empty(3, 2, 4, 16, device="cuda")[..., :8])}
    for why, (parts, target) in bad.items():
        assert not ms.accepts(parts, target), why
        with pytest.raises(ConfigError, match="merge_strided wants") as info:
            ms.merge_strided(parts, target)
        assert str(tuple(target.shape)) in str(info.value), why
    ms.merge_strided([(o, lse)], out)  # and the same parts, well formed, merge
    torch.testing.assert_close(out, o)


def test_merge_strided_refuses_cpu_tensors_with_what_it_got():
    """No GPU needed: CPU tensors are refused before any build, the message naming out's device and shape."""
    out = torch.empty(2, 1, 1, 4)
    assert not ms.accepts([(out, torch.zeros(2, 1, 1))], out)
    with pytest.raises(ConfigError, match=r"got out \(2, 1, 1, 4\) torch.float32 cpu"):
        ms.merge_strided([(out, torch.zeros(2, 1, 1))], out)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("chunk_pages,merge,merged_by", [(16, "kernel", "merge_strided"), (1, "kernel", "merge_strided"),
                                                         (1, "torch", "merge_passes")])
def test_prefill_stream_merges_its_passes_as_they_come(monkeypatch, chunk_pages, merge, merged_by):
    """The prefill stream variant merges its passes with merge_strided (or the torch-op merge when asked:
    merge="torch"), in one launch when they are few (16-page chunks of a 1,000-token past); with one-page chunks
    (~47 ring passes) it folds them as they come, so no merge takes more than STREAM_HELD_PASSES passes and the
    merges are the folds traffic_model.fold_count counts plus the final one; each against float64."""
    import directkv.kernels.cuda.prefill_attention as pa
    from directkv.kernels.traffic_model import STREAM_HELD_PASSES, fold_count
    from tests.test_cuda_prefill import BF16, assert_matches, dense_reference, make_inputs, page_bytes_of

    used, added = [], []
    for owner, name, label in ((pa.merge_strided, "run", "merge_strided"), (pa.merge_strided, "merge_passes",
                                                                           "merge_passes")):
        fn = getattr(owner, name)
        monkeypatch.setattr(owner, name, (lambda f, n: lambda p, *a: used.append((n, len(p))) or f(p, *a))(fn, label))
    add = ms.RunningMerge.add
    monkeypatch.setattr(ms.RunningMerge, "add", lambda self, o, lse: added.append(1) or add(self, o, lse))
    q, k_new, v_new, kv_cpu, kv = make_inputs((65, 1000, 8, 2, 128, BF16, 16), hbm_fraction=0.25)
    out = torch.full_like(q, math.nan)
    pa.prefill_attention(q, k_new, v_new, kv, variant="stream", out=out,
                         chunk_bytes=chunk_pages * page_bytes_of(kv_cpu), merge=merge)
    assert {n for n, _ in used} == {merged_by}
    assert max(k for _, k in used) <= STREAM_HELD_PASSES
    assert len(used) == fold_count(len(added)) + 1 and (len(used) == 1) == (chunk_pages == 16)
    assert_matches(out, dense_reference(q, k_new, v_new, kv_cpu, causal=True, scale=1 / math.sqrt(q.shape[-1])))


def test_merge_passes_gives_zeros_to_a_row_no_pass_saw():
    """A sequence of length 0 in a call of several passes has -inf LSEs in all of them: its output is 0, not
    the NaN of a softmax over nothing; the other rows merge as before."""
    o = [torch.randn(2, 4, 8), torch.randn(2, 4, 8)]
    lse = [torch.randn(2, 4), torch.randn(2, 4)]
    for t in lse:
        t[1] = -math.inf
    out = torch.full((2, 4, 8), math.nan)
    ms.merge_passes(list(zip(o, lse, strict=True)), out)
    w = torch.softmax(torch.stack(lse)[:, 0], dim=0)
    assert torch.equal(out[1], torch.zeros(4, 8))
    torch.testing.assert_close(out[0], w[0, :, None] * o[0][0] + w[1, :, None] * o[1][0])


def test_merge_passes_follows_the_merge_kernels_rules():
    """As merge_stacked / merge_strided: a pass of -inf LSE is not read, even where its O is NaN (never written),
    and a NaN LSE (a broken pass) makes its row NaN instead of being hidden as zeros."""
    o = [torch.randn(3, 2, 8), torch.randn(3, 2, 8)]
    lse = [torch.randn(3, 2), torch.randn(3, 2)]
    lse[1][0] = -math.inf
    o[1][0] = math.nan  # row 0: the second pass saw none of its keys and wrote nothing
    lse[0][1, 1] = math.nan  # row (1, 1): a broken first pass
    out = torch.full((3, 2, 8), -7.0)
    ms.merge_passes(list(zip(o, lse, strict=True)), out)
    torch.testing.assert_close(out[0], o[0][0])
    assert out[1, 1].isnan().all() and not out[1, 0].isnan().any() and not out[2].isnan().any()
    w = torch.softmax(torch.stack(lse)[:, 2], dim=0)
    torch.testing.assert_close(out[2], w[0, :, None] * o[0][2] + w[1, :, None] * o[1][2])


def test_merge_passes_weighs_views_of_any_layout_by_their_lse():
    """Runs without a GPU: passes given as contiguous [q, Hq, D] fp32, a permuted bf16 [q, Hkv, G, D] view (as
    the flash passes hand them over) and a transposed one, merged against a float64 softmax over the LSEs."""
    torch.manual_seed(0)
    q_len, hkv, g, d = 5, 2, 4, 8
    plain = (torch.randn(q_len, hkv * g, d), torch.randn(q_len, hkv * g))
    folded = torch.randn(hkv, q_len, g, d).to(torch.bfloat16)  # flash over folded rows: [Hkv, q * G, D] in memory
    folded_lse = torch.randn(hkv, q_len, g)
    by_head = torch.randn(hkv * g, q_len, d).to(torch.bfloat16)  # flash over the new tokens: [Hq, q, D] in memory
    by_head_lse = torch.randn(hkv * g, q_len)
    four_d = lambda t: t.unflatten(1, (hkv, g))  # noqa: E731 - how prefill's stream hands its passes over
    parts = [(four_d(plain[0]), four_d(plain[1])), (folded.permute(1, 0, 2, 3), folded_lse.permute(1, 0, 2)),
             (four_d(by_head.transpose(0, 1)), four_d(by_head_lse.transpose(0, 1)))]
    out = torch.full((q_len, hkv * g, d), math.nan, dtype=torch.bfloat16)
    ms.merge_passes(parts, out)
    os_ = torch.stack([plain[0].double(), folded.permute(1, 0, 2, 3).reshape(q_len, hkv * g, d).double(),
                       by_head.transpose(0, 1).double()])
    lse = torch.stack([plain[1].double(), folded_lse.permute(1, 0, 2).reshape(q_len, hkv * g).double(),
                       by_head_lse.t().double()])
    want = (os_ * torch.softmax(lse, 0).unsqueeze(-1)).sum(0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
