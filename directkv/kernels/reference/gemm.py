"""The GEMM case study: C = A B with B possibly in host memory, output-stationary vs B-stationary."""

from __future__ import annotations

import torch

from directkv.errors import check
from directkv.kernels.reference.common import STAT_BYTES, check_tiles, check_variant, counted
from directkv.kernels.traffic import TIERS, Traffic, TrafficCounter

GEMM_VARIANTS = ("naive", "pipelined", "tiled")


def _tiles(n: int, tile: int) -> list[tuple[int, int]]:
    return [(i, min(i + tile, n)) for i in range(0, n, tile)]


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    variant: str,
    b_tier: str = "host",
    tile_m: int = 128,
    tile_n: int = 128,
    tile_k: int = 64,
    compute: bool = True,
    counter: TrafficCounter | None = None,
) -> tuple[torch.Tensor | None, Traffic]:
    """C = A B, accumulated in float32.

    Parameters
    ----------
    a : `[M, K]` in HBM.
    b : `[K, N]` in `b_tier` ("host" or "hbm"), same dtype as a.
    variant : "naive" (output-stationary: for each C tile loop over k; B crosses the link ceil(M / tile_m)
        times), "tiled" (B-stationary: each B tile read once and applied to every A row tile, the float32
        partial C read-modified-written in HBM; the last k step writes C in a's dtype) or "pipelined"
        (the same traffic and math as "tiled"; the difference, prefetching producer warps, exists only
        in the CUDA kernel).
    tile_m, tile_n, tile_k : tile sizes; M, N, K need not be multiples.
    compute : False counts traffic only (a and b may be on device "meta").
    counter : accumulates the traffic when given.

    Returns
    -------
    (c `[M, N]` in a.dtype or None, this call's Traffic)
    """
    check_variant("gemm", variant, GEMM_VARIANTS)
    check(b_tier in TIERS, f"unknown b_tier {b_tier!r}; valid: {', '.join(TIERS)}")
    check_tiles(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k)
    check(a.dim() == 2 and b.dim() == 2, f"a and b must be 2-D; got {tuple(a.shape)} and {tuple(b.shape)}")
    check(a.shape[1] == b.shape[0], f"inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    check(a.dtype == b.dtype, f"a dtype {a.dtype} != b dtype {b.dtype}")
    m, k = (int(s) for s in a.shape)
    n = int(b.shape[1])
    check(min(m, n, k) >= 1, f"M, N, K must be >= 1; got M={m}, N={n}, K={k}")
    elem = a.dtype.itemsize
    rows, cols, depth = _tiles(m, tile_m), _tiles(n, tile_n), _tiles(k, tile_k)

    def step(acc: torch.Tensor | None, mt: tuple[int, int], nt: tuple[int, int], kt: tuple[int, int],
             counter: TrafficCounter) -> torch.Tensor | None:  # fmt: skip
        """acc += A[mt, kt] B[kt, nt]; counts the A tile read and the FLOPs (B reads are the caller's)."""
        (m0, m1), (n0, n1), (k0, k1) = mt, nt, kt
        counter.read((m1 - m0) * (k1 - k0) * elem, "hbm")
        counter.compute(2 * (m1 - m0) * (n1 - n0) * (k1 - k0))
        if acc is None:
            return None
        return acc + a[m0:m1, k0:k1].float() @ b[k0:k1, n0:n1].to(device=a.device, dtype=torch.float32)

    def zeros(mt: tuple[int, int], nt: tuple[int, int]) -> torch.Tensor | None:
        if not compute:
            return None
        return torch.zeros(mt[1] - mt[0], nt[1] - nt[0], dtype=torch.float32, device=a.device)

    def naive(counter: TrafficCounter, c: torch.Tensor | None) -> None:
        for mt in rows:
            for nt in cols:
                acc = zeros(mt, nt)
                for kt in depth:
                    counter.read((kt[1] - kt[0]) * (nt[1] - nt[0]) * elem, b_tier)
                    acc = step(acc, mt, nt, kt, counter)
                counter.write((mt[1] - mt[0]) * (nt[1] - nt[0]) * elem, "hbm")
                if c is not None:
                    c[mt[0] : mt[1], nt[0] : nt[1]] = acc.to(c.dtype)

    def stationary(counter: TrafficCounter, c: torch.Tensor | None) -> None:
        partial: dict[tuple[int, int], torch.Tensor | None] = {}  # float32 partial C tiles in HBM
        for nt in cols:
            for ki, kt in enumerate(depth):
                counter.read((kt[1] - kt[0]) * (nt[1] - nt[0]) * elem, b_tier)  # the stationary B tile
                for mt in rows:
                    tile_elems = (mt[1] - mt[0]) * (nt[1] - nt[0])
                    if ki == 0:
                        acc = zeros(mt, nt)
                    else:
                        counter.read(tile_elems * STAT_BYTES, "hbm")
                        acc = partial.pop((mt[0], nt[0]))
                    acc = step(acc, mt, nt, kt, counter)
                    if ki == len(depth) - 1:
                        counter.write(tile_elems * elem, "hbm")
                        if c is not None:
                            c[mt[0] : mt[1], nt[0] : nt[1]] = acc.to(c.dtype)
                    else:
                        counter.write(tile_elems * STAT_BYTES, "hbm")
                        partial[(mt[0], nt[0])] = acc

    def run(counter: TrafficCounter) -> torch.Tensor | None:
        c = torch.empty(m, n, dtype=a.dtype, device=a.device) if compute else None
        (naive if variant == "naive" else stationary)(counter, c)
        return c

    return counted(counter, run)
