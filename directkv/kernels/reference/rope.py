"""Llama rotary position embedding, rotate-half convention (dimension i pairs with i + head_dim/2)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, pos0: int, theta: float) -> torch.Tensor:
    """Rotate x `[tokens, heads, head_dim]` (float32) for absolute positions pos0, pos0 + 1, ...

    Frequencies are theta ** (-2i / head_dim), i < head_dim / 2, without Llama-3.1's long-context
    frequency rescaling (irrelevant to bytes and FLOPs; the references and kernels agree on it).
    """
    tokens, _, dim = x.shape
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
    pos = torch.arange(pos0, pos0 + tokens, dtype=torch.float64, device=x.device)
    angles = torch.outer(pos, inv_freq)  # float64: positions up to 1e5+ lose digits in float32
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)[:, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
