"""Llama rotary position embedding, rotate-half convention (dimension i pairs with i + head_dim/2)."""

from __future__ import annotations

import torch


def rope_angles(pos0: int, tokens: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """float64 angles `[tokens, head_dim / 2]` of positions pos0.. : position x theta ** (-2i / head_dim), without
    Llama-3.1's long-context frequency rescaling. The one rule the references, the model's RopeCache and the
    kernels that fuse RoPE share (float64: positions up to 1e5+ lose digits in float32)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    pos = torch.arange(pos0, pos0 + tokens, dtype=torch.float64, device=device)
    return torch.outer(pos, inv_freq)


def apply_rope(x: torch.Tensor, pos0: int, theta: float) -> torch.Tensor:
    """Rotate x `[tokens, heads, head_dim]` (float32) for absolute positions pos0, pos0 + 1, ...

    Frequencies are theta ** (-2i / head_dim), i < head_dim / 2, without Llama-3.1's long-context
    frequency rescaling (irrelevant to bytes and FLOPs; the references and kernels agree on it).
    """
    tokens, _, dim = x.shape
    angles = rope_angles(pos0, tokens, dim, theta, x.device)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)[:, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
