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
which are in flight at once. The graphs of one set are captured in layer order into one memory pool and must
be replayed in that order, which the forward passes do. Captured once per process and reused by every point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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
class GraphSet:
    """Static inputs and the per-layer graphs for steps of <= `size` tokens."""

    size: int
    x0: torch.Tensor  # [size, hidden] layer-0 input (embeddings), written before the first replay
    cos: torch.Tensor | None  # [size, 1, D / 2] RoPE tables of the step's positions (llama), else None
    sin: torch.Tensor | None
    attn: torch.Tensor  # [size, Hq, D] attention output of the current layer, written before post[L]
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


def capture_set(size: int, *, hidden: int, q_shape: tuple[int, int], rope_half: int | None, num_layers: int,
                pre: Callable, post: Callable, dtype: torch.dtype, device: torch.device, capture: Capture,
                pool: Any) -> GraphSet:
    """Capture the 2 x num_layers graphs of one set.

    pre(layer, x, rot) -> (q, k, v) and post(layer, x, attn) -> x are the runner's dense halves; rope_half is
    head_dim / 2 for RoPE models, None otherwise; q_shape is (Hq, D).
    """
    zeros = dict(dtype=dtype, device=device)
    gs = GraphSet(size, torch.zeros(size, hidden, **zeros),
                  None if rope_half is None else torch.zeros(size, 1, rope_half, dtype=torch.float32, device=device),
                  None if rope_half is None else torch.zeros(size, 1, rope_half, dtype=torch.float32, device=device),
                  torch.zeros(size, *q_shape, **zeros))
    rot = None if rope_half is None else (gs.cos, gs.sin)
    x = gs.x0
    for layer in range(num_layers):
        replay, qkv = capture(lambda layer=layer, x=x: pre(layer, x, rot), pool)
        gs.pre.append(replay)
        gs.pre_out.append(qkv)
        replay, x = capture(lambda layer=layer, x=x: post(layer, x, gs.attn), pool)
        gs.post.append(replay)
        gs.post_out.append(x)
    return gs
