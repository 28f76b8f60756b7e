"""CUDA GEMM case study (naive, tiled, pipelined) against a float64 product on the GPU.

B lives in pinned host memory read through a zero-copy view; fresh random inputs, C poisoned with NaN,
odd shapes (unaligned rows take the element-load path), several chunks per k-split, fp16 and fp32 C, both
host-load forms (cp.async.cg and .ca). The GPU tests skip without CUDA; the argument check runs anywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.gemm_case_study import HOST_LOADS, gemm
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.reference import gemm as reference_gemm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.float16: 5e-3, torch.float32: 1e-4}
SHAPES = [  # (m, n, k)
    (1000, 777, 1111),  # odd everywhere: element loads, ragged tiles and chunks
    (256, 384, 640),
    (1, 8, 8),
    (130, 136, 1032),  # aligned, not tile multiples, 3 chunks of 512
    (300, 520, 2048),
]
VARIANTS = ["naive", "tiled", "pipelined", "raster"]


def host_b(k: int, n: int) -> torch.Tensor:
    pinned = pinned_empty((k, n), torch.float16)
    pinned.copy_(torch.randn(k, n, device="cuda").half())
    return device_view(pinned)


def check_product(a, b, variant, out_dtype, **kwargs):
    out = torch.full((a.shape[0], b.shape[1]), math.nan, dtype=out_dtype, device="cuda")
    c, traffic = gemm(a, b, variant=variant, out=out, **kwargs)
    torch.cuda.synchronize()
    assert c.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "unwritten or NaN output elements"
    ref = a.double() @ b.to(a.device).double()
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[out_dtype]
    return traffic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["c16", "c32"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_float64(shape, variant, out_dtype, host_load):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").half()
    b = host_b(k, n)
    traffic = check_product(a, b, variant, out_dtype, host_load=host_load)
    # The SMs request B once per row tile (naive, and raster: the same schedule in another CTA order) or once
    # (tiled, pipelined); the reference agrees.
    schedule = "naive" if variant == "raster" else variant
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    _, ref = reference_gemm(meta(a), meta(b), variant=schedule, compute=False, tile_k=64 if schedule == "naive" else 512)
    per_row_tile = math.ceil(m / 128) if schedule == "naive" else 1
    assert traffic.link_read_bytes == ref.link_read_bytes == k * n * 2 * per_row_tile


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant", ["tiled", "pipelined"])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_gemm_partial_c_round_trips(variant, k_splits, host_load):
    """Forced few k-splits: each CTA owns several chunks and read-modify-writes its partial C."""
    for m, n, k in [(1000, 777, 1111), (300, 520, 2048)]:
        a = torch.randn(m, k, device="cuda").half()
        check_product(a, host_b(k, n), variant, torch.float16, k_splits=k_splits, host_load=host_load)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
def test_gemm_b_in_hbm_and_pinned_cpu(host_load):
    a = torch.randn(200, 300, device="cuda").half()
    b = torch.randn(300, 264, device="cuda").half()
    traffic = check_product(a, b, "tiled", torch.float16, host_load=host_load)
    assert traffic.link_read_bytes == 0
    check_product(a, b.cpu().pin_memory(), "pipelined", torch.float32, host_load=host_load)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gemm_sees_b_rewritten_between_launches(variant, host_load):
    """B rewritten in place between two calls: the second call must read the new bytes (an L1 line cached
    by the first launch must not survive into the next one)."""
    a = torch.randn(300, 520, device="cuda").half()
    b = host_b(520, 264)
    check_product(a, b, variant, torch.float16, host_load=host_load)
    b.copy_(torch.randn(b.shape, device="cuda").half())  # the same pinned bytes, new values
    torch.cuda.synchronize()
    check_product(a, b, variant, torch.float16, host_load=host_load)


def test_gemm_rejects_bad_host_load_before_touching_cuda():
    """Runs without a GPU: host_load is checked first, and a valid value passes on to the device checks."""
    a = torch.randn(64, 64).half()
    with pytest.raises(ConfigError, match=r"host_load 'lru'; valid: ca, cg"):
        gemm(a, a, variant="tiled", host_load="lru")
    with pytest.raises(ConfigError, match="CUDA tensor"):
        gemm(a, a, variant="tiled", host_load="ca")


@pytest.mark.gpu
@needs_cuda
def test_gemm_rejects_bad_arguments():
    a = torch.randn(64, 64, device="cuda").half()
    b = host_b(64, 64)
    with pytest.raises(ConfigError, match="variant"):
        gemm(a, b, variant="fused")
    with pytest.raises(ConfigError, match="tiles"):
        gemm(a, b, variant="naive", tile_k=32)
    with pytest.raises(ConfigError, match="float16"):
        gemm(a.float(), b, variant="naive")
