"""Arrival times: gamma inter-arrival gaps (shape = burstiness; 1 = Poisson), as in vLLM's serving benchmark."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from directkv.errors import check
from workloads.request import Workload


def gamma_arrivals(n: int, rate: float | None, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times of ``n`` requests offered at ``rate`` requests per second.

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``, so their coefficient of
    variation is ``1/sqrt(burstiness)``: below 1 is burstier than Poisson, above 1 more regular. The times
    are then scaled so the last arrival is exactly ``n / rate``: a short run then offers exactly ``rate``,
    which a plain random draw only does on average.

    Parameters
    ----------
    n : int
        Number of requests (>= 0).
    rate : float | None
        Requests per second (> 0); ``None`` or ``inf`` puts every arrival at t = 0 (offline batch).
    burstiness : float
        Gamma shape (> 0).
    seed : int
        Seed of the gaps.

    Returns
    -------
    np.ndarray
        ``[n]`` float64 seconds, non-decreasing.
    """
    check(isinstance(n, int) and n >= 0, f"n must be a non-negative integer, got {n!r}")
    check(0 < burstiness < math.inf, f"burstiness must be > 0 and finite, got {burstiness!r}")
    if rate is None or rate == math.inf:
        return np.zeros(n)
    check(rate > 0, f"rate must be > 0, got {rate!r}")
    if n == 0:
        return np.zeros(0)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return times * ((n / rate) / times[-1])


def with_arrivals(workload: Workload, rate: float | None, burstiness: float = 1.0, seed: int = 0) -> Workload:
    """A copy of ``workload`` whose requests carry ``gamma_arrivals`` times, in request order.

    The arrival settings are added to ``params`` (``arrival_rate``, ``burstiness``, ``arrival_seed``).
    """
    times = gamma_arrivals(len(workload.requests), rate, burstiness, seed)
    requests = [
        dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(workload.requests, times, strict=True)
    ]
    params = {**workload.params, "arrival_rate": rate, "burstiness": burstiness, "arrival_seed": seed}
    return dataclasses.replace(workload, requests=requests, params=params)
