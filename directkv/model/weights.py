"""Random decoder weights at a ModelSpec's exact shapes (no downloads: timings and bytes do not depend on
the values).

Layout: every projection is stored `[in_features, out_features]` and applied as `x @ w`. Per layer the
q/k/v projections are fused into one `wqkv` `[hidden, q_dim + 2 * kv_dim]` (one GEMM instead of three)
and Llama's gate and up projections into one `w_up` `[hidden, 2 * intermediate]` (gate first).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from directkv.errors import check
from directkv.specs.models import ModelSpec

# HF's initializer_range for both Llama and OPT.
INIT_STD = 0.02


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer. The `*_bias` / `b*` fields are None for Llama (no biases, RMSNorm)."""

    attn_norm: torch.Tensor  # [hidden]
    attn_norm_bias: torch.Tensor | None  # [hidden] (OPT LayerNorm)
    wqkv: torch.Tensor  # [hidden, q_dim + 2 * kv_dim]
    bqkv: torch.Tensor | None  # [q_dim + 2 * kv_dim]
    wo: torch.Tensor  # [q_dim, hidden]
    bo: torch.Tensor | None  # [hidden]
    mlp_norm: torch.Tensor  # [hidden]
    mlp_norm_bias: torch.Tensor | None  # [hidden]
    w_up: torch.Tensor  # llama: [hidden, 2 * intermediate] (gate | up); opt: fc1 [hidden, intermediate]
    b_up: torch.Tensor | None  # opt: [intermediate]
    w_down: torch.Tensor  # [intermediate, hidden]
    b_down: torch.Tensor | None  # opt: [hidden]

    def tensors(self) -> Iterator[torch.Tensor]:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield value


@dataclass(frozen=True, eq=False)
class Weights:
    """All weights of one model. For OPT `lm_head` is `embed.t()`, a view sharing its storage (tied)."""

    spec: ModelSpec
    layers: tuple[LayerWeights, ...]
    embed: torch.Tensor  # [vocab, hidden]
    pos_embed: torch.Tensor | None  # opt: [max_context + 2, hidden]; row p + 2 holds position p
    final_norm: torch.Tensor  # [hidden]
    final_norm_bias: torch.Tensor | None  # opt: [hidden]
    lm_head: torch.Tensor  # [hidden, vocab]

    @property
    def tied(self) -> bool:
        return self.spec.family == "opt"

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every stored tensor once (a tied LM head is not yielded a second time)."""
        for layer in self.layers:
            yield from layer.tensors()
        own = [self.embed, self.pos_embed, self.final_norm, self.final_norm_bias]
        if not self.tied:
            own.append(self.lm_head)
        yield from (t for t in own if t is not None)


def weight_bytes(weights: Weights) -> int:
    """Bytes of all stored weights; equals `spec.weight_bytes()` when the dtype has spec.dtype_bytes."""
    return sum(t.numel() * t.element_size() for t in weights.tensors())


def weight_params(weights: Weights) -> int:
    """Number of stored parameters; equals `spec.weight_params()`."""
    return sum(t.numel() for t in weights.tensors())


class _Maker:
    """Creates tensors on one device from one seeded generator, in a fixed order (so a seed is a model)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int):
        self.device, self.dtype = device, dtype
        # Meta tensors carry shapes only; there is no generator on "meta".
        self.gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        if self.gen is None:
            return torch.empty(shape, device=self.device, dtype=self.dtype)
        # Generated on the target device: an 8B model initialises in seconds on a GPU.
        out = torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype)
        return out.mul_(INIT_STD)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, device=self.device, dtype=self.dtype)


def _layer(spec: ModelSpec, make: _Maker) -> LayerWeights:
    h, f = spec.hidden_size, spec.intermediate_size
    qkv = spec.q_dim + 2 * spec.kv_dim
    if spec.family == "llama":
        return LayerWeights(
            attn_norm=make.ones(h), attn_norm_bias=None,
            wqkv=make.randn(h, qkv), bqkv=None, wo=make.randn(spec.q_dim, h), bo=None,
            mlp_norm=make.ones(h), mlp_norm_bias=None,
            w_up=make.randn(h, 2 * f), b_up=None, w_down=make.randn(f, h), b_down=None,
        )
    # OPT: small random biases (not HF's zeros) so that a dropped bias changes the output.
    return LayerWeights(
        attn_norm=make.ones(h), attn_norm_bias=make.randn(h),
        wqkv=make.randn(h, qkv), bqkv=make.randn(qkv), wo=make.randn(spec.q_dim, h), bo=make.randn(h),
        mlp_norm=make.ones(h), mlp_norm_bias=make.randn(h),
        w_up=make.randn(h, f), b_up=make.randn(f), w_down=make.randn(f, h), b_down=make.randn(h),
    )


def init_weights(spec: ModelSpec, *, device: str | torch.device,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Weights:
    """Random weights for `spec`: N(0, 0.02^2) matrices and biases, norm scales 1.

    Parameters
    ----------
    spec : the model shapes.
    device : "cpu", "cuda", "cuda:N" or "meta" (shapes only, no memory: for shape tests).
    dtype : storage and compute dtype (bf16 for serving, float32 for tests).
    seed : the same (spec, device, dtype, seed) gives the same weights.
    """
    check(dtype.is_floating_point, f"weights dtype must be a floating type; got {dtype}")
    make = _Maker(torch.device(device), dtype, seed)
    layers = tuple(_layer(spec, make) for _ in range(spec.num_layers))
    h, v = spec.hidden_size, spec.vocab_size
    embed = make.randn(v, h)
    if spec.family == "llama":
        return Weights(spec=spec, layers=layers, embed=embed, pos_embed=None, final_norm=make.ones(h),
                       final_norm_bias=None, lm_head=make.randn(h, v))
    return Weights(spec=spec, layers=layers, embed=embed, pos_embed=make.randn(spec.max_context + 2, h),
                   final_norm=make.ones(h), final_norm_bias=make.randn(h), lm_head=embed.t())


def check_weights(weights: Weights, spec: ModelSpec) -> None:
    """Raise ConfigError unless `weights` have exactly the shapes `init_weights(spec)` makes."""
    check(weights.spec == spec, f"weights were made for model {weights.spec.name!r}, not {spec.name!r}")
    check(len(weights.layers) == spec.num_layers,
          f"weights have {len(weights.layers)} layers; model {spec.name!r} has {spec.num_layers}")
    expected = init_weights(spec, device="meta", dtype=weights.dtype)
    pairs = [(f"layers[{i}]", got, want) for i, (got, want) in enumerate(zip(weights.layers, expected.layers, strict=True))]
    pairs.append(("model", weights, expected))
    for where, got, want in pairs:
        for f in fields(want):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
                shape_a = None if a is None else tuple(a.shape)
                shape_b = None if b is None else tuple(b.shape)
                ok = shape_a == shape_b and (a is None or (a.dtype == weights.dtype and a.device == weights.device))
                check(ok, f"{where}.{f.name}: shape {shape_a} {getattr(a, 'dtype', None)} on "
                          f"{getattr(a, 'device', None)}; model {spec.name!r} needs {shape_b} {weights.dtype} "
                          f"on {weights.device}")
