"""CUDA graphs of the runner's dense layer parts, so a small serving step is not bound by kernel launches.

A decode step of Llama-3.1-8B issues ~20 small kernels per layer outside attention (norms, projections,
RoPE, MLP); at a few requests per step the GPU finishes them faster than Python can launch them, and the
step takes the launch time (~25 ms per step measured on the H200, results/h200/README.md). Here each
layer's two dense halves become one graph each:

* ``pre[L]``  : norm, QKV projection, RoPE -> q `[size, Hq, D]`, k, v `[size, Hkv, D]` (ModelRunner._pre)
* ``post[L]`` : output projection, MLP and residuals of the attention output -> x `[size, hidden]` (_post)

Attention stays eager between them: every system's KV path keeps its own Python and kernels, so all five
systems gain the same. A `GraphSet` serves steps of up to `size` tokens (padded; the padding rows are
computed and never read: every op here is per row), and `slot` separates the two halves of a pipelined step,
which are in flight at once. Captured once per process and reused by every point.

A step replays one set per slot, so the sets of a slot share their static tensors (`SlotBuffers`, sized for
the largest bucket; a set uses rows [0, size)) and one memory pool, which holds what a graph frees before it
ends (and the capture stream's cuBLAS workspace). x alternates between two buffers, as each layer reads only
the one before. Each layer keeps its own q, k, v for the whole step, as a margin: no system reads them after
its layer's output is waited for (a review found none), but one that did would read another layer's values if
they alternated too, which would save ~0.1 GB per slot for Llama-3.1-8B and ~0.3 GB for OPT-13B more. When
every set held its own outputs in a pool of its own, swap and stream (one slot) held 0.52 GB more for OPT-13B
and 0.24 GB more for Llama-3.1-8B (weights + pools 26.98 -> 26.46 and 16.58 -> 16.34 GB; H200, 2026-12-03);
cpu_attn and pipelined directkv capture two slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from directkv.errors import check

# Padded step sizes (tokens) that get graphs; a step of more tokens runs eagerly (it is GPU-bound anyway).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# capture(fn, pool) -> (replay, outputs): run fn once into static outputs; replay() refreshes them in place.
Capture = Callable[[Callable[[], Any], Any], tuple[Callable[[], None], Any]]


def eager_capture(fn: Callable[[], Any], pool: Any) -> tuple[Callable[[], None], Any]:
    """Stand-in for cuda_capture on the CPU (tests): replay re-runs fn and copies into the first outputs, so
    the static-buffer plumbing behaves as with a graph."""
    outputs = fn()

    def replay() -> None:
        for old, new in zip(_flat(outputs), _flat(fn()), strict=True):
            old.copy_(new)

    return replay, outputs


def _flat(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


@dataclass
class SlotBuffers:
    """The static tensors every GraphSet of one slot writes and reads, for steps of up to `rows` tokens."""

    rows: int
    x0: torch.Tensor  # [rows, hidden] layer-0 input (embeddings), written before the first replay
    cos: torch.Tensor | None  # [rows, 1, D / 2] RoPE tables of the step's positions (llama), else None
    sin: torch.Tensor | None
    attn: torch.Tensor  # [rows, Hq, D] attention output of the current layer, written before post[L]
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer: q [rows, Hq, D], k, v [rows, Hkv, D]
    x: tuple[torch.Tensor, torch.Tensor]  # [rows, hidden] each: layer L's output is x[L % 2]

    @classmethod
    def make(cls, rows: int, *, hidden: int, q_shape: tuple[int, int], kv_shape: tuple[int, int],
             rope_half: int | None, num_layers: int, dtype: torch.dtype, device: torch.device) -> SlotBuffers:
        like = dict(dtype=dtype, device=device)

        def table() -> torch.Tensor | None:
            return None if rope_half is None else torch.zeros(rows, 1, rope_half, dtype=torch.float32, device=device)

        return cls(rows, torch.zeros(rows, hidden, **like), table(), table(), torch.zeros(rows, *q_shape, **like),
                   [(torch.zeros(rows, *q_shape, **like), torch.zeros(rows, *kv_shape, **like),
                     torch.zeros(rows, *kv_shape, **like)) for _ in range(num_layers)],
                   (torch.zeros(rows, hidden, **like), torch.zeros(rows, hidden, **like)))


@dataclass
class GraphSet:
    """Static inputs and the per-layer graphs for steps of <= `size` tokens (views of its slot's buffers)."""

    size: int
    x0: torch.Tensor  # [size, hidden]
    cos: torch.Tensor | None  # [size, 1, D / 2] (llama), else None
    sin: torch.Tensor | None
    attn: torch.Tensor  # [size, Hq, D]
    pre: list[Callable[[], None]] = field(default_factory=list)
    pre_out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    post: list[Callable[[], None]] = field(default_factory=list)
    post_out: list[torch.Tensor] = field(default_factory=list)

    def load(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The step's embeddings `[n, hidden]` and RoPE tables into the static inputs (rows [0, n))."""
        n = x.shape[0]
        self.x0[:n].copy_(x)
        if rot is not None:
            self.cos[:n].copy_(rot[0])
            self.sin[:n].copy_(rot[1])


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n tokens, or None when n exceeds them all."""
    return next((b for b in sorted(buckets) if b >= n), None)


def capture_set(size: int, buffers: SlotBuffers, *, pre: Callable, post: Callable, capture: Capture,
                pool: Any) -> GraphSet:
    """Capture the 2 x num_layers graphs of one set into rows [0, size) of `buffers`.

    pre(layer, x, rot, out) writes (q, k, v) into `out` and returns it; post(layer, x, attn, out) writes the
    layer's output x into `out` and returns it: the runner's dense halves.
    """
    check(size <= buffers.rows, f"graph bucket {size} exceeds its slot buffers' {buffers.rows} rows")
    rows = slice(0, size)
    gs = GraphSet(size, buffers.x0[rows], None if buffers.cos is None else buffers.cos[rows],
                  None if buffers.sin is None else buffers.sin[rows], buffers.attn[rows])
    rot = None if gs.cos is None else (gs.cos, gs.sin)
    x = gs.x0
    for layer in range(len(buffers.qkv)):
        qkv = tuple(t[:size] for t in buffers.qkv[layer])
        replay, qkv = capture(lambda layer=layer, x=x, qkv=qkv: pre(layer, x, rot, qkv), pool)
        gs.pre.append(replay)
        gs.pre_out.append(qkv)
        out = buffers.x[layer % 2][:size]
        replay, x = capture(lambda layer=layer, x=x, out=out: post(layer, x, gs.attn, out), pool)
        gs.post.append(replay)
        gs.post_out.append(x)
    return gs
