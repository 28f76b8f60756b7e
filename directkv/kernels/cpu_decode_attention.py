"""Decode attention on the CPU over a paged KV cache in host memory (the Neo-like `cpu_attn` system's kernel).

One native call per layer attends every decode of the step (csrc/include/directkv/cpu_decode_attention.h):
OpenMP threads take (sequence, piece of pages) items, read each page's K/V in place from the pools
(pinned or not; bf16 or fp16 converted to fp32 on the fly, or fp32), and the pieces of a sequence are merged by
their softmax statistics. It replaces a torch loop whose per-sequence calls (a dozen small ops per decode
per layer) bound the rate sweeps on the H200: 604 ms per token with ~50 decodes per step (2026-11-29).
On a 2-core Zen 4 VM with AVX512-BF16 (2026-11-29, 2 threads, bf16, Llama-3.1-8B heads) one layer took
0.43 ms for 64 decodes of 20 tokens (torch loop 2.67 ms) and 25 ms for 4 x 16K tokens (49 ms); with the
kernel's specialised AVX-512 item (bf16, GQA 1/2/4/8, head_dim 64/128; kernel_item says which item runs)
12.5 ms for 4 x 16K (results/dev-vm). The module is built like the CUDA ops (directkv.kernels.cuda.build: a
host-only op, C++ compiler and OpenMP, no nvcc) on first use.

A step's block table and lengths are the same for every layer: DecodeTables checks them once per step
(~0.1 ms of small torch ops, which per layer and pipelined part added a few ms to every cpu_attn step), and
each layer's call checks only its query, pools and output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from directkv.errors import check

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # the kernel's CpuDtype
MIN_PIECE_PAGES = 4  # below this a work item's setup and merge cost more than its reads


def plan_piece_pages(seq_pages: list[int], threads: int) -> int:
    """Pages per work item (a piece of one sequence, all its heads): long sequences are cut so that there are
    about 4 items per thread (load balance with few, long sequences), but never into pieces under
    MIN_PIECE_PAGES pages."""
    return max(MIN_PIECE_PAGES, math.ceil(sum(seq_pages) / (4 * max(1, threads))))


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not elementwise ==
class DecodeTables:
    """The page tables of a step's decodes, checked once (DecodeTables.check) for all layers' calls.

    block_table `[batch, width]` int32 CPU, the page ids of each sequence in logical order; seq_lens `[batch]`
    int32 CPU, each in 1..width * page_size; pages: pages each sequence reads; max_page: the largest page id
    any of them reads (a layer's pools must hold more pages than that).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    pages: tuple[int, ...]
    max_page: int

    @classmethod
    def check(cls, block_table: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int) -> DecodeTables:
        for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
            check(t.device.type == "cpu" and t.is_contiguous(), f"{name} must be a contiguous CPU tensor; got {t.device}")
        check(block_table.dim() == 2 and block_table.dtype == torch.int32,
              f"block_table must be int32 [batch, width]; got {block_table.dtype} {tuple(block_table.shape)}")
        batch, width = (int(s) for s in block_table.shape)
        check(seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32,
              f"seq_lens must be int32 [{batch}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
        lens = seq_lens.tolist()
        check(batch >= 1 and all(1 <= n <= width * page_size for n in lens),
              f"seq_lens must be in 1..{width * page_size} (block table width {width} x page_size {page_size}); got "
              f"{[n for n in lens if not 1 <= n <= width * page_size][:4] or 'an empty batch'}")
        pages = tuple(-(-n // page_size) for n in lens)
        used = block_table[torch.arange(width)[None, :] < torch.tensor(pages)[:, None]]  # the entries the kernel reads
        check(int(used.min()) >= 0, f"block_table holds negative page ids: {int(used.min())}")
        return cls(block_table, seq_lens, page_size, pages, int(used.max()))

    def rows(self, rows: slice) -> DecodeTables:
        """The tables of some of the decodes (a pipelined part); max_page stays the whole step's bound."""
        return DecodeTables(self.block_table[rows], self.seq_lens[rows], self.page_size, self.pages[rows],
                            self.max_page)

    @property
    def batch(self) -> int:
        return len(self.pages)


def kernel_item(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """The item the native kernel, as built on this machine, runs for these shapes: "avx512bf16" or "avx512f"
    (the specialised bf16 item, by the instructions it was compiled with) or "generic"."""
    from directkv.kernels.cuda import build

    check(dtype in DTYPE_CODES, f"dtype must be one of float16, bfloat16, float32; got {dtype}")
    return build.load("cpu_decode_attention").item(DTYPE_CODES[dtype], num_heads, num_kv_heads, head_dim)


def cpu_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: DecodeTables,
    *,
    scale: float | None = None,
    threads: int | None = None,
    piece_pages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over its cached tokens, on the CPU.

    Parameters
    ----------
    q : `[batch, num_heads, head_dim]` CPU tensor, fp16, bf16 or fp32 (the pools' dtype; fp32 for tests).
    k_pool, v_pool : `[num_pages, page_size, num_kv_heads, head_dim]` contiguous CPU tensors (pinned or not).
    tables : the sequences' block table and lengths, checked (DecodeTables.check).
    scale : softmax scale, default 1 / sqrt(head_dim).
    threads : OpenMP threads, default torch.get_num_threads().
    piece_pages : pages per work item; None plans it (plan_piece_pages).
    out : optional `[batch, num_heads, head_dim]` contiguous float32 CPU output.

    Returns
    -------
    out `[batch, num_heads, head_dim]` float32.
    """
    check(q.dim() == 3, f"q must be [batch, num_heads, head_dim]; got shape {tuple(q.shape)}")
    check(k_pool.dim() == 4 and v_pool.shape == k_pool.shape, f"k_pool and v_pool must be the same "
          f"[num_pages, page_size, num_kv_heads, head_dim]; got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    batch, num_heads, head_dim = (int(s) for s in q.shape)
    num_pages, page_size, num_kv_heads, pool_dim = (int(s) for s in k_pool.shape)
    check(q.dtype in DTYPE_CODES and k_pool.dtype == q.dtype and v_pool.dtype == q.dtype, f"q, k_pool, v_pool must "
          f"share one dtype of float16, bfloat16, float32; got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    check(head_dim == pool_dim, f"q head_dim {head_dim} != pool head_dim {pool_dim}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        check(t.device.type == "cpu" and t.is_contiguous(), f"{name} must be a contiguous CPU tensor; got {t.device}")
    check(tables.batch == batch and tables.page_size == page_size, f"tables of {tables.batch} sequences with "
          f"page_size {tables.page_size} for q of {batch} and pools of page_size {page_size}")
    check(tables.max_page < num_pages, f"block_table holds page ids outside 0..{num_pages - 1}: ..{tables.max_page}")
    threads = int(threads or torch.get_num_threads())
    check(threads >= 1, f"threads must be >= 1; got {threads}")
    if piece_pages is None:
        piece_pages = plan_piece_pages(list(tables.pages), threads)
    check(isinstance(piece_pages, int) and piece_pages >= 1, f"piece_pages must be an int >= 1; got {piece_pages!r}")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    check(out.shape == q.shape and out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous(),
          f"out must be a contiguous float32 CPU tensor of shape {tuple(q.shape)}")
    from directkv.kernels.cuda import build

    build.load("cpu_decode_attention").run(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.block_table.data_ptr(),
        tables.seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, page_size,
        int(tables.block_table.shape[1]), piece_pages, threads,
        float(scale) if scale is not None else 1.0 / math.sqrt(head_dim), DTYPE_CODES[q.dtype],
    )  # fmt: skip
    return out
