"""Kernel registry: one public entry per op, dispatched by backend and variant.

Backends: ``reference`` (PyTorch, runs on CPU, counts traffic as its loops run) and ``cuda`` (csrc/,
built on first use; traffic from the closed forms, tested equal to the reference counts). Every entry
returns ``(output, Traffic)``. ``VARIANTS`` lists every variant of an op that some backend implements;
``stream`` (copy-engine staging, beyond the paper) exists on the CUDA backend only.
"""

from __future__ import annotations

import importlib

from directkv.errors import ConfigError, unknown_name

OPS = ("decode_attention", "prefill_attention", "proj_attention", "gemm")
BACKENDS = ("reference", "cuda")
VARIANTS = {
    "decode_attention": ("naive", "tiled", "stream"),
    "prefill_attention": ("naive", "tiled", "stream"),
    "proj_attention": ("separate", "fused"),
    "gemm": ("naive", "tiled", "pipelined", "stream"),
}
# module of each op per backend (the CUDA module name is the op's csrc name)
_MODULES = {
    ("reference", op): "directkv.kernels.reference" for op in OPS
} | {("cuda", "decode_attention"): "directkv.kernels.cuda.decode_attention",
     ("cuda", "prefill_attention"): "directkv.kernels.cuda.prefill_attention",
     ("cuda", "proj_attention"): "directkv.kernels.cuda.proj_attention",
     ("cuda", "gemm"): "directkv.kernels.cuda.gemm_case_study"}
_FUNCS = {"decode_attention": "decode_attention", "prefill_attention": "prefill_attention",
          "proj_attention": "proj_attention", "gemm": "gemm"}


def get_op(op: str, backend: str = "reference"):
    """The callable implementing `op` on `backend` (exact names; errors list the valid ones)."""
    if op not in OPS:
        raise unknown_name("op", op, OPS)
    if backend not in BACKENDS:
        raise unknown_name("backend", backend, BACKENDS)
    mod = _MODULES.get((backend, op))
    if mod is None:
        have = sorted(o for (b, o) in _MODULES if b == backend)
        raise ConfigError(f"op {op!r} has no {backend} backend; {backend} ops: {', '.join(have)}")
    return getattr(importlib.import_module(mod), _FUNCS[op])


def decode_attention(*args, backend: str = "reference", **kwargs):
    """Decode attention over a PagedKV; see the backend modules for shapes and variants."""
    return get_op("decode_attention", backend)(*args, **kwargs)


def prefill_attention(*args, backend: str = "reference", **kwargs):
    return get_op("prefill_attention", backend)(*args, **kwargs)


def proj_attention(*args, backend: str = "reference", **kwargs):
    return get_op("proj_attention", backend)(*args, **kwargs)


def gemm(*args, backend: str = "reference", **kwargs):
    return get_op("gemm", backend)(*args, **kwargs)
