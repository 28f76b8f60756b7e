"""PyTorch reference backend: every kernel schedule as a loop that counts its traffic as it runs.

Runs anywhere torch runs (CPU included). With `compute=False` the loops only count, so byte and FLOP
totals at real shapes come from meta tensors without memory.
"""

from directkv.kernels.reference.decode import DECODE_VARIANTS, decode_attention
from directkv.kernels.reference.dense import dense_attention
from directkv.kernels.reference.gemm import GEMM_VARIANTS, gemm
from directkv.kernels.reference.prefill import PREFILL_VARIANTS, prefill_attention
from directkv.kernels.reference.proj_attention import PROJ_VARIANTS, proj_attention
from directkv.kernels.reference.rope import apply_rope

__all__ = [
    "DECODE_VARIANTS",
    "GEMM_VARIANTS",
    "PREFILL_VARIANTS",
    "PROJ_VARIANTS",
    "apply_rope",
    "decode_attention",
    "dense_attention",
    "gemm",
    "prefill_attention",
    "proj_attention",
]
