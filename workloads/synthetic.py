"""Synthetic requests of chosen lengths, for context sweeps (e.g. prompt_len 1024 .. 32768)."""

from __future__ import annotations

import numpy as np

from directkv.errors import check, unknown_name
from workloads.request import Request, Workload

DISTS = ("fixed", "uniform")


def _lengths(rng: np.random.Generator, n: int, mean: int, dist: str, spread: float) -> np.ndarray:
    """``[n]`` int lengths: all ``mean``, or uniform integers in ``[mean*(1-spread), mean*(1+spread)]``, >= 1."""
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    lo = max(1, round(mean * (1 - spread)))
    hi = max(lo, round(mean * (1 + spread)))
    return rng.integers(lo, hi, size=n, endpoint=True)


def synthetic_workload(
    num_requests: int,
    prompt_len: int,
    output_len: int,
    *,
    dist: str = "fixed",
    spread: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Requests whose lengths are set directly instead of sampled from a dataset.

    Parameters
    ----------
    num_requests : int
        Number of requests (>= 1).
    prompt_len, output_len : int
        Lengths in tokens (>= 1); the mean of the range when ``dist="uniform"``.
    dist : str
        ``"fixed"`` (every request the same) or ``"uniform"`` (each length drawn independently).
    spread : float
        Relative half-width of the uniform range, in [0, 1]; must be 0 for ``"fixed"``.
    seed : int
        Seed of the draws (unused for ``"fixed"``).

    Returns
    -------
    Workload
        ``requests`` ``[num_requests]``, ``dataset="synthetic"``, no path, tokenizer ``"none"``.
    """
    if dist not in DISTS:
        raise unknown_name("synthetic length distribution", dist, DISTS)
    for name, value in (
        ("num_requests", num_requests),
        ("prompt_len", prompt_len),
        ("output_len", output_len),
    ):
        check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
    check(0.0 <= spread <= 1.0, f"spread must be in [0, 1], got {spread!r}")
    check(dist == "uniform" or spread == 0.0, f"spread={spread!r} needs dist='uniform' (dist is {dist!r})")
    rng = np.random.default_rng(seed)
    prompts = _lengths(rng, num_requests, prompt_len, dist, spread)
    outputs = _lengths(rng, num_requests, output_len, dist, spread)
    requests = [
        Request(req_id=i, prompt_len=int(p), output_len=int(o), source=f"synthetic:{i}")
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    params = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "dist": dist,
        "spread": spread,
        "seed": seed,
    }
    return Workload(requests, "synthetic", None, "none", params)
