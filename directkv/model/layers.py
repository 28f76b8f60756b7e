"""Decoder building blocks on a flat token batch `[tokens, ...]`: norms, RoPE, MLPs.

Few kernels per block on purpose: a decode step runs ~20 of them per layer, and at small batches the
step time is the host's launch time, not the GPU's (measured on the H200: 37 ms host vs 7 ms GPU for
Llama-3.1-8B at batch 64 with three times as many kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from directkv.kernels.reference.rope import rope_angles
from directkv.model.weights import LayerWeights

NORM_EPS = 1e-5  # Llama-3.1 rms_norm_eps and OPT's LayerNorm eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """`x` `[tokens, hidden]` scaled by 1 / rms over hidden, times `weight` `[hidden]` (float accumulation)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """LayerNorm over the last dim of `x` `[tokens, hidden]` with `weight`, `bias` `[hidden]`."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class RopeCache:
    """cos/sin of every position up to `max_positions`, computed once, rotate-half convention.

    Angles from directkv.kernels.reference.rope.rope_angles, the rule the references and the kernels that
    fuse RoPE share.
    Tables are `[max_positions, head_dim / 2]` float32 (64 MiB for 131072 positions at head_dim 128).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device):
        self.max_positions = max_positions
        angles = rope_angles(0, max_positions, head_dim, theta)  # float64, on the CPU
        self.cos = angles.cos().to(device=device, dtype=torch.float32)
        self.sin = angles.sin().to(device=device, dtype=torch.float32)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[tokens, 1, head_dim / 2]` float32 of `positions` `[tokens]` int64 (< max_positions).

        Gathered once per forward and shared by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[tokens, heads, head_dim]` at `positions` `[tokens]`; see rope()."""
        return rope(x, *self.lookup(positions))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x` `[tokens, heads, head_dim]` (any strides) with `cos`, `sin` from
    RopeCache.lookup; computed in float32, returned contiguous in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    first = torch.addcmul(x1 * cos, x2, sin, value=-1)  # x1 cos - x2 sin
    second = torch.addcmul(x2 * cos, x1, sin)  # x2 cos + x1 sin
    return torch.cat([first, second], dim=-1).to(x.dtype)


def mlp(x: torch.Tensor, layer: LayerWeights, family: str) -> torch.Tensor:
    """Feed-forward of normed `x` `[tokens, hidden]` -> `[tokens, hidden]`.

    llama: down(silu(gate(x)) * up(x)); opt: fc2(relu(fc1(x) + b1)) + b2.
    """
    if family == "llama":
        gate, up = (x @ layer.w_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ layer.w_down
    hidden = F.relu(torch.addmm(layer.b_up, x, layer.w_up))
    return torch.addmm(layer.b_down, hidden, layer.w_down)
