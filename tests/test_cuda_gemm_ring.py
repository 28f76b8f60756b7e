"""CUDA GEMM variant ring (B through an HBM ring by SM loads, output-stationary tiles) against a float64 product on
the GPU, as test_cuda_gemm does the others: fresh random inputs, C poisoned with NaN, ragged m / n / k, a ring that
wraps, B on the host and in HBM, single CTAs and pairs; its plan and refusals. The plan tests run anywhere."""

from __future__ import annotations

import math

import pytest
import torch
from test_cuda_gemm import check_product, host_b, needs_cuda

from directkv.errors import ConfigError
from directkv.kernels.cuda.gemm_case_study import gemm
from directkv.kernels.cuda.gemm_ring import plan_ring, ring_cluster

RING_CASES = [  # (m, n, k, band)
    (1, 8, 8, None),  # one tile, one unit: zeros staged past k and n, rows past m left out
    (1000, 776, 1112, None),  # ragged everywhere: 4 row tiles, the last strip 8 columns, the last k tile 24 rows
    (300, 2184, 2048, 1),  # 18 bands of one strip in 4 slots: the ring wraps 4 times
    (4096, 4096, 2056, 2),  # 512 tiles on at most 132 CTAs (several each), 16 bands in 4 slots
    (1000, 2048, 1112, 2),  # pairs with a ragged last row tile and k tile, 8 bands in 4 slots
    # bands of 4, 4, 4, 4, 2 strips in 4 slots: the narrower last band wraps onto slot 0; pairs: the second half of
    # row tile 1 (rows 384-511) lies wholly past m (added after the session's last GPU run)
    (300, 2184, 2048, 4),
    (2048, 8192, 512, None),  # the planned band (16 strips of 8 row tiles: 128 tiles a band)
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cluster", [None, 2], ids=["c1", "c2"])
@pytest.mark.parametrize("b_kind", ["host", "hbm"])
@pytest.mark.parametrize("m,n,k,band", RING_CASES, ids=[f"{m}x{n}x{k}-band{b}" for m, n, k, b in RING_CASES])
def test_gemm_ring(m, n, k, band, b_kind, cluster):
    if cluster == 2 and (math.ceil(n / 128) % 2 or (band or 2) % 2):
        pytest.skip("the strips do not pair up (test_gemm_ring_refusals: refused)")
    a = torch.randn(m, k, device="cuda").half()
    b = host_b(k, n) if b_kind == "host" else torch.randn(k, n, device="cuda").half()
    traffic = check_product(a, b, "ring", torch.float32, band=band, cluster=cluster)
    assert traffic.link_read_bytes == (k * n * 2 if b_kind == "host" else 0)  # the closed form's tier follows B
    b.copy_(torch.randn(b.shape, device="cuda").half())  # new values in the same bytes: no stale ring unit
    torch.cuda.synchronize()
    check_product(a, b, "ring", torch.float16, band=band, cluster=cluster)


@pytest.mark.gpu
@needs_cuda
def test_gemm_ring_refusals():
    a = torch.randn(130, 1024, device="cuda").half()
    with pytest.raises(ConfigError, match=r"'ring' needs k and n multiples of 8 .* got k = 1024, n = 260"):
        gemm(a, host_b(1024, 260), variant="ring")
    with pytest.raises(ConfigError, match=r"ring band 3 is not in 1..2 \(the 128-column strips of n = 256\)"):
        gemm(a, host_b(1024, 256), variant="ring", band=3)
    with pytest.raises(ConfigError, match=r"host_load must be None or 'cg'; got 'ca'"):
        gemm(a, host_b(1024, 256), variant="ring", host_load="ca")
    with pytest.raises(ConfigError, match=r"band is an option of gemm variant 'ring'; got 2 for 'tiled'"):
        gemm(a, host_b(1024, 256), variant="tiled", band=2)
    with pytest.raises(ConfigError, match=r"ring cluster 2 needs an even number of 128-column strips and an even band; "
                                          r"got n = 384 \(3 strips\), band None"):
        gemm(a, host_b(1024, 384), variant="ring", cluster=2)


def test_plan_ring_by_hand():
    assert plan_ring(10240, 10240, 10240, 132) == (3, 4)  # 40 row tiles: 3 strips a band (120 tiles), 4 slots
    assert plan_ring(4096, 4096, 4096, 132) == (8, 4)  # 16 row tiles x 8 strips
    assert plan_ring(64, 8, 8, 132) == (1, 1)  # one strip: one band
    assert plan_ring(65536, 1024, 8192, 132) == (1, 4)  # more row tiles than CTAs: a strip a band
    # a band of 16 strips of 131072 k rows is 512 MiB: the ring holds one, whatever RING_BYTES says
    assert plan_ring(256, 4096, 131072, 132, band=16) == (16, 1)
    for bad in (0, 3, True, 1.0):
        with pytest.raises(ConfigError, match=rf"ring band {bad!r} is not in 1..2"):
            plan_ring(64, 256, 64, 132, band=bad)
    # pairs: the band rounded down to even, at least 2
    assert plan_ring(10240, 10240, 10240, 132, cluster=2) == (2, 4)
    assert plan_ring(4096, 4096, 4096, 132, cluster=2) == (8, 4)
    assert plan_ring(65536, 1024, 8192, 132, cluster=2) == (2, 4)


def test_ring_cluster_by_hand():
    assert ring_cluster(256, None, None) == 1  # pairs only when asked for
    assert ring_cluster(256, None, 2) == 2 and ring_cluster(1024, 4, 2) == 2 and ring_cluster(1024, 3, 1) == 1
    with pytest.raises(ConfigError, match=r"got n = 1024 \(8 strips\), band 3; use cluster 1 or None"):
        ring_cluster(1024, 3, 2)
