"""The pinned host arena: every host-tier KV page of every layer, allocated once, up front.

For a CUDA run (`pin=True`) the arena is page-locked and also exposed as a zero-copy CUDA view over the same
memory, so kernels read host pages across the link and nothing is staged. Pinning is slow (DESIGN.md §2:
64 GB took 43 s), which is why it happens once and its duration is reported. For a CPU run (`pin=False`, on any
machine) the pools are ordinary tensors and the "device view" is the same tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from directkv.specs import ModelSpec


@dataclass
class HostArena:
    """K and V page pools `[num_layers, num_pages, page_size, num_kv_heads, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor
    k_view: torch.Tensor  # CUDA-visible view of `k` (zero-copy) or, unpinned, `k` itself
    v_view: torch.Tensor
    pinned: bool
    pin_seconds: float
    extra: dict = field(default_factory=dict)

    @classmethod
    def allocate(cls, model: ModelSpec, num_pages: int, page_size: int, *, dtype: torch.dtype = torch.bfloat16,
                 pin: bool) -> HostArena:
        """pin: page-locked with a zero-copy CUDA view (a CUDA run), else plain host tensors that are their own view."""
        shape = (model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim)
        pin = pin and num_pages > 0  # an empty tensor cannot be page-locked (HBM-only systems)
        t0 = time.perf_counter()
        from directkv.kernels.cuda.zero_copy import host_buffer

        (k, k_view), (v, v_view) = host_buffer(shape, dtype, pin=pin), host_buffer(shape, dtype, pin=pin)
        return cls(k, v, k_view, v_view, pin, time.perf_counter() - t0)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
