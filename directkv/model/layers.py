"""Decoder building blocks on a flat token batch `[tokens, ...]`: norms, RoPE, MLPs.

Norms and RoPE compute in float32 and return the input dtype, as HF Llama/OPT do under bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from directkv.model.weights import LayerWeights

NORM_EPS = 1e-5  # Llama-3.1 rms_norm_eps and OPT's LayerNorm eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """`x` `[tokens, hidden]` scaled by 1 / rms over hidden, times `weight` `[hidden]`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """LayerNorm over the last dim of `x` `[tokens, hidden]` with `weight`, `bias` `[hidden]`."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return out.to(x.dtype)


class RopeCache:
    """cos/sin of every position up to `max_positions`, computed once, rotate-half convention.

    Frequencies theta ** (-2i / head_dim) for i < head_dim / 2, without Llama-3.1's long-context
    rescaling, exactly as directkv.kernels.reference.rope does (kernels that fuse RoPE must agree).
    Tables are `[max_positions, head_dim / 2]` float32 (64 MiB for 131072 positions at head_dim 128).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device):
        self.max_positions = max_positions
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        # float64 angles: position * freq loses digits in float32 beyond ~1e4 positions.
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().to(device=device, dtype=torch.float32)
        self.sin = angles.sin().to(device=device, dtype=torch.float32)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[tokens, heads, head_dim]`; `positions` `[tokens]` int64 (< max_positions)."""
        cos = self.cos[positions][:, None, :]  # [tokens, 1, head_dim / 2]
        sin = self.sin[positions][:, None, :]
        xf = x.float()
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def mlp(x: torch.Tensor, layer: LayerWeights, family: str) -> torch.Tensor:
    """Feed-forward of normed `x` `[tokens, hidden]` -> `[tokens, hidden]`.

    llama: down(silu(gate(x)) * up(x)); opt: fc2(relu(fc1(x) + b1)) + b2.
    """
    if family == "llama":
        gate, up = (x @ layer.w_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ layer.w_down
    hidden = F.relu(torch.addmm(layer.b_up, x, layer.w_up))
    return torch.addmm(layer.b_down, hidden, layer.w_down)
