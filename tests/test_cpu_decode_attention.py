"""CPU decode attention (the cpu_attn system's native kernel) against a float64 reference, on this machine.

Fresh random inputs every run, output poisoned with NaN, lengths that are not page or piece multiples,
GQA 1/4/8, bf16 and fp16, head_dim 64 and 128, pages handed out in shuffled order with spare pages left
unused, pieces forced small so several pieces per sequence are merged, 1 and 2 threads.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cpu_decode_attention import (
    MIN_PIECE_PAGES,
    DecodeTables,
    cpu_decode_attention,
    kernel_item,
    plan_piece_pages,
)
from directkv.kernels.cuda import build

BF16, FP16 = torch.bfloat16, torch.float16


# the kernel is built on first use by the host C++ compiler (with OpenMP); without one these tests cannot run
pytestmark = pytest.mark.skipif(not build.can_build("cpu_decode_attention"), reason="no C++ compiler for the kernel")


def make_cache(lens, *, num_heads, num_kv_heads, head_dim, dtype, page_size=16, spare=3):
    """(q, k_pool, v_pool, block_table, seq_lens) with every sequence's pages at shuffled pool positions."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + spare
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pool, v_pool = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    perm = torch.randperm(num_pages)
    table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)  # one unused column
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at : at + p].to(torch.int32)
        at += p
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    return q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32)


def _tables(table, lens, page_size=16):
    return DecodeTables.check(table, lens, page_size=page_size)


def reference(q, k_pool, v_pool, table, lens, scale):
    """float64 attention of each sequence's query over its gathered keys; `[batch, num_heads, head_dim]`."""
    page_size, hkv = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // hkv
    outs = []
    for b, n in enumerate(lens.tolist()):
        ids = table[b, : -(-n // page_size)].long()
        k = k_pool[ids].reshape(-1, hkv, k_pool.shape[3])[:n].double().repeat_interleave(group, dim=1)
        v = v_pool[ids].reshape(-1, hkv, k_pool.shape[3])[:n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v))
    return torch.stack(outs)


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


# The inputs are exact in fp32 and the kernel computes in fp32, so only fp32 rounding is left (measured ~1e-6):
# a looser bound would let a wrong weight or a lost token pass.
TOL = {BF16: 1e-4, FP16: 1e-4, torch.float32: 1e-5}

CASES = [  # (lens, num_heads, num_kv_heads, head_dim, dtype, page_size)
    ([1], 4, 4, 64, BF16, 16),  # one token, MHA
    ([17, 1000, 3], 8, 2, 128, FP16, 16),  # GQA 4, a partial page, a long sequence beside short ones
    ([4097, 33], 8, 1, 128, BF16, 16),  # GQA 8
    ([300, 65, 129, 7], 32, 8, 128, BF16, 16),  # Llama-3.1-8B heads
    ([513, 100], 4, 4, 64, FP16, 7),  # page size not a power of two
    ([90, 5], 4, 2, 32, torch.float32, 16),  # fp32, as the CPU tests of the serving path use
    ([100, 7], 4, 2, 48, BF16, 16),  # bf16 with head_dim not a multiple of 32: the generic loops
    # bf16 with head_dim 64 / 128 and GQA 1 / 2 / 4 / 8 takes the AVX512-BF16 item where the CPU has it:
    ([250, 31], 8, 4, 64, BF16, 16),  # GQA 2
    ([513, 100, 6], 8, 2, 128, BF16, 7),  # pages of 7 tokens: masked tails everywhere
    ([1000, 45], 8, 2, 64, BF16, 32),  # pages of 32 tokens: two vectors of scores per head
    ([77, 300], 16, 1, 128, BF16, 16),  # GQA 16: no specialised item, the generic one
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-{str(c[4])[6:]}-p{c[5]}")
@pytest.mark.parametrize("piece_pages", [None, 1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64(case, piece_pages, threads):
    lens, num_heads, num_kv_heads, head_dim, dtype, page_size = case
    q, k_pool, v_pool, table, seq_lens = make_cache(lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                    head_dim=head_dim, dtype=dtype, page_size=page_size)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full(q.shape, math.nan, dtype=torch.float32)
    cpu_decode_attention(q, k_pool, v_pool, _tables(table, seq_lens, page_size), threads=threads,
                         piece_pages=piece_pages, out=out)
    assert not out.isnan().any()
    assert rel_err(out, reference(q, k_pool, v_pool, table, seq_lens, scale)) < TOL[dtype]


def test_large_scores_and_given_scale():
    """Scores far from 0 (a large scale) stress the online max; the default output buffer and scale path."""
    q, k_pool, v_pool, table, seq_lens = make_cache([777, 50], num_heads=8, num_kv_heads=2, head_dim=64, dtype=BF16)
    out = cpu_decode_attention(q, k_pool, v_pool, _tables(table, seq_lens), scale=2.0, piece_pages=2)
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert rel_err(out, reference(q, k_pool, v_pool, table, seq_lens, 2.0)) < TOL[BF16]
    default = cpu_decode_attention(q, k_pool, v_pool, _tables(table, seq_lens))
    assert rel_err(default, reference(q, k_pool, v_pool, table, seq_lens, 1 / 8)) < TOL[BF16]


def test_fp16_subnormals_and_extremes_convert_exactly():
    """One key, so the output is exactly that token's V row: every fp16 bit pattern class (subnormal, max,
    negative zero) must come back as the same value in fp32."""
    v_vals = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -0.0, 1.0, -2.5, 3e-6], dtype=FP16)
    k_pool = torch.randn(1, 16, 1, 8).to(FP16)
    v_pool = torch.zeros(1, 16, 1, 8, dtype=FP16)
    v_pool[0, 0, 0] = v_vals
    out = cpu_decode_attention(torch.randn(1, 1, 8).to(FP16), k_pool, v_pool,
                               _tables(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32)))
    assert torch.equal(out[0, 0], v_vals.float())


def test_a_part_of_the_checked_tables_attends_its_rows():
    """The pipelined cpu_attn path checks a step's tables once and hands each part rows(...) of them."""
    q, k_pool, v_pool, table, seq_lens = make_cache([40, 300, 17, 90], num_heads=8, num_kv_heads=2, head_dim=64,
                                                    dtype=BF16)
    tables = _tables(table, seq_lens)
    want = reference(q, k_pool, v_pool, table, seq_lens, 1 / 8)
    for rows in (slice(0, 2), slice(2, 4), slice(1, 3)):
        out = torch.full(q[rows].shape, math.nan, dtype=torch.float32)
        cpu_decode_attention(q[rows].contiguous(), k_pool, v_pool, tables.rows(rows), out=out)
        assert rel_err(out, want[rows]) < TOL[BF16]
    with pytest.raises(ConfigError, match="tables of 2 sequences with page_size 16 for q of 4"):
        cpu_decode_attention(q, k_pool, v_pool, tables.rows(slice(0, 2)))
    with pytest.raises(ConfigError, match="page_size 16 for q of 4 and pools of page_size 8"):
        cpu_decode_attention(q, k_pool.view(-1, 8, 2, 64), v_pool.view(-1, 8, 2, 64), tables)


def test_plan_piece_pages():
    assert plan_piece_pages([1, 2], 16) == MIN_PIECE_PAGES  # short sequences: whole sequences
    assert plan_piece_pages([2048] * 4, 16) == 128  # 4 x 32K tokens: 64 items, 4 per thread
    assert plan_piece_pages([2048], 1) == 512


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(q=a["q"].float()), "must share one dtype of float16, bfloat16, float32; got torch.float32"),
        (lambda a: a.update(q=a["q"].double()), "got torch.float64"),
        (lambda a: a.update(seq_lens=torch.tensor([0, 5], dtype=torch.int32)), r"seq_lens must be in 1\.\.48 .*got \[0\]"),
        (lambda a: a.update(seq_lens=torch.tensor([49, 5], dtype=torch.int32)), r"seq_lens must be in 1\.\.48 .*got \[49\]"),
        (lambda a: a.update(block_table=a["block_table"].long()), "block_table must be int32"),
        (lambda a: a["block_table"].__setitem__((0, 0), 99), r"page ids outside 0\.\.6: .*\.\.99"),
        (lambda a: a["block_table"].__setitem__((1, 0), -2), "block_table holds negative page ids: -2"),
        (lambda a: a.update(q=a["q"][:, :3]), "num_heads 3 is not a multiple of num_kv_heads 2"),
        (lambda a: a.update(piece_pages=0), "piece_pages must be an int >= 1; got 0"),
    ],
)
def test_bad_inputs_name_the_value(change, message):
    q, k_pool, v_pool, table, seq_lens = make_cache([20, 5], num_heads=4, num_kv_heads=2, head_dim=64, dtype=BF16,
                                                    spare=4)
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_table=table, seq_lens=seq_lens, piece_pages=None)
    change(args)
    with pytest.raises(ConfigError, match=message):
        tables = _tables(args.pop("block_table"), args.pop("seq_lens"))
        cpu_decode_attention(args.pop("q"), args.pop("k_pool"), args.pop("v_pool"), tables, **args)


def test_kernel_item_names_what_runs():
    """Specialised bf16 items exist for GQA 1/2/4/8 and head_dim 64/128 on AVX-512 CPUs; everything else,
    and every CPU without AVX-512, takes the generic item (tests/test_cpu_decode_paths.py checks them all)."""
    from directkv.hostinfo import cpuinfo_field

    flags = set((cpuinfo_field("flags") or "").split())  # the op is built with -march=native for this CPU
    best = "avx512bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags else "generic"
    assert kernel_item(BF16, 32, 8, 128) == kernel_item(BF16, 8, 1, 64) == best  # Llama heads; GQA 8, d64
    assert kernel_item(BF16, 16, 1, 128) == kernel_item(BF16, 4, 2, 48) == kernel_item(FP16, 32, 8, 128) == "generic"
    assert kernel_item(torch.float32, 4, 4, 64) == "generic"
    with pytest.raises(ConfigError, match="dtype must be one of float16, bfloat16, float32; got torch.int8"):
        kernel_item(torch.int8, 4, 4, 64)

