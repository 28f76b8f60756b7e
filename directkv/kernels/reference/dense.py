"""Dense float64 attention: the plain softmax(Q K^T * scale + mask) V the tiled kernels are checked against."""

from __future__ import annotations

import math

import torch


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos0: int,
    causal: bool,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Attention in float64 with GQA head mapping (query head h reads KV head h // gqa_ratio).

    Parameters
    ----------
    q : `[q_len, num_heads, head_dim]`; query i is at absolute position q_pos0 + i.
    k, v : `[kv_len, num_kv_heads, head_dim]`; key j is at absolute position j.
    causal : query i sees key j iff j <= q_pos0 + i; otherwise every key.

    Returns
    -------
    `[q_len, num_heads, head_dim]` float64.
    """
    q_len, num_heads, head_dim = q.shape
    gqa = num_heads // k.shape[1]
    kd = k.double().repeat_interleave(gqa, dim=1)
    vd = v.double().repeat_interleave(gqa, dim=1)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) * scale
    if causal:
        q_pos = torch.arange(q_pos0, q_pos0 + q_len, device=q.device)
        k_pos = torch.arange(k.shape[0], device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vd)
