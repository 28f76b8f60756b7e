"""GEMM variant ring (csrc/include/directkv/gemm_ring.cuh): its options, its plan of bands and ring slots, and its
launch; gemm_case_study.gemm checks the common arguments and calls these."""

from __future__ import annotations

import math
from functools import cache

import torch

from directkv.errors import check
from directkv.kernels.cuda import build
from directkv.kernels.traffic_model import RING_TILE_M, RING_TILE_N

UNIT_ROWS = 64  # k rows of a ring unit (the kernel's k tile)
RING_UNIT_BYTES = UNIT_ROWS * RING_TILE_N * 2  # a unit: 64 k rows of one 128-column strip, in the shared-memory layout
RING_BYTES = 64 << 20  # HBM the ring of bands may take (at least one band, whatever its size)
RING_SLOTS = 4  # bands the ring holds at most


def ring_options(a: torch.Tensor, b: torch.Tensor, band: int | None, cluster: int | None) -> int:
    """The cluster size for C = a `[M, K]` b `[K, N]` (ring_cluster), after checking the rows' alignment and the band
    (plan_ring), so a bad call fails before any output is allocated."""
    (m, k), n = a.shape, b.shape[1]
    check(k % 8 == 0 and n % 8 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0, f"gemm variant 'ring' "
          f"needs k and n multiples of 8 and 16-byte aligned A and B; got k = {k}, n = {n}, A at {a.data_ptr() % 16} "
          f"and B at {b.data_ptr() % 16} bytes past a 16-byte boundary")
    plan_ring(m, n, k, 1, band=band)
    return ring_cluster(n, band, cluster)


def ring_cluster(n: int, band: int | None, cluster: int | None) -> int:
    """ring's CTAs per cluster for B `[K, n]`: 1 unless given (None); 2 (pairs on adjacent strips of one row tile,
    sharing each A tile by TMA multicast) needs an even number of strips and, if a band is given, an even one.
    Pairs are not the default: on the H200 (2026-12-04, two runs in one call) they ran ring with B in HBM ~10%
    faster (3.79 / 3.66 ms against 4.21 / 4.11 at 10240^3: less L2 work) but with B on the host, where the link
    bounds it, level at 10240^3 (4.56 / 4.71 against 4.66 / 4.65) and slower at 4096^3 (0.75 / 0.86 against
    0.73 / 0.78)."""
    strips = math.ceil(n / RING_TILE_N)
    pairs = strips % 2 == 0 and (band is None or band % 2 == 0)
    check(cluster != 2 or pairs, f"gemm ring cluster 2 needs an even number of {RING_TILE_N}-column strips and an even "
          f"band; got n = {n} ({strips} strips), band {band!r}; use cluster 1 or None")
    return 1 if cluster is None else cluster


def plan_ring(m: int, n: int, k: int, ctas: int, *, band: int | None = None, cluster: int = 1) -> tuple[int, int]:
    """(band, slots) of variant ring for C `[m, n]` = A `[m, k]` B `[k, n]` on a grid of `ctas` CTAs: a band of
    128-column strips is about one tile per CTA (ctas // row tiles of RING_TILE_M rows, at least 1, at most every
    strip; even for pairs, cluster 2), so the tiles of a band run together and follow its units across the link; a
    given band is checked against the strips. slots: bands the ring holds, up to RING_SLOTS within RING_BYTES (at
    least one)."""
    strips, mtiles, ktiles = math.ceil(n / RING_TILE_N), math.ceil(m / RING_TILE_M), math.ceil(k / UNIT_ROWS)
    check(band is None or (type(band) is int and 1 <= band <= strips), f"gemm ring band {band!r} is not in "
          f"1..{strips} (the 128-column strips of n = {n})")
    if band is None:
        band = max(1, min(strips, ctas // mtiles))
        band = max(2, band // 2 * 2) if cluster == 2 else band
    bands = math.ceil(strips / band)
    return band, max(1, min(bands, RING_SLOTS, RING_BYTES // (band * ktiles * RING_UNIT_BYTES)))


@cache
def ring_ctas(device: int, cluster: int) -> int:
    with torch.cuda.device(device):
        return build.load("gemm_case_study").ring_ctas(cluster)


def run_ring(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, band: int | None, cluster: int, out_code: int) -> None:
    """out = a @ b by the ring kernel (gemm_case_study's launcher code `out_code` for out's dtype): a grid of the CTAs
    resident at once (at most one a tile), its ring and its zeroed counts allocated per call."""
    (m, k), n = a.shape, b.shape[1]
    pair = 2 * out.element_size()  # C's rows are written as element pairs
    check(out.data_ptr() % pair == 0, f"gemm variant 'ring' writes C in pairs of elements: out must be {pair}-byte "
          f"aligned; got {out.data_ptr() % pair} bytes past")
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    ctas = min(ring_ctas(device, cluster), math.ceil(m / RING_TILE_M) * math.ceil(n / RING_TILE_N))
    band, slots = plan_ring(m, n, k, ctas, band=band, cluster=cluster)
    ktiles, bands = math.ceil(k / UNIT_ROWS), math.ceil(math.ceil(n / RING_TILE_N) / band)
    ring = torch.empty(slots * band * ktiles * RING_UNIT_BYTES, dtype=torch.uint8, device=a.device)
    sync = torch.zeros(bands * band * ktiles + bands, dtype=torch.int32, device=a.device)
    build.load("gemm_case_study").ring_run(
        a.data_ptr(), b.data_ptr(), out.data_ptr(), ring.data_ptr(), ring.numel(), sync.data_ptr(), sync.numel(), ctas,
        m, n, k, band, slots, cluster, out_code, torch.cuda.current_stream(a.device).cuda_stream)
