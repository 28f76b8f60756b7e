"""Request workloads: datasets (ShareGPT, Alpaca), synthetic lengths, arrival processes, stored schedules.

``build_workload(kind, **options)`` is the entry the experiments use; ``kind`` is one of ``KINDS``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from directkv.errors import ConfigError, unknown_name
from workloads.alpaca import load_alpaca
from workloads.arrivals import gamma_arrivals, with_arrivals
from workloads.request import Request, Workload
from workloads.schedule import load_schedule, save_schedule
from workloads.sharegpt import load_sharegpt
from workloads.synthetic import synthetic_workload
from workloads.tokenizer import TokenCounter, get_token_counter

KINDS: dict[str, Callable[..., Workload]] = {
    "sharegpt": load_sharegpt,
    "alpaca": load_alpaca,
    "synthetic": synthetic_workload,
    "schedule": load_schedule,
}


def build_workload(kind: str, **options) -> Workload:
    """Build a workload by exact kind name.

    Parameters
    ----------
    kind : str
        ``"sharegpt"``, ``"alpaca"``, ``"synthetic"`` or ``"schedule"``.
    **options
        Keyword arguments of the matching function (``load_sharegpt``, ``load_alpaca``,
        ``synthetic_workload``, ``load_schedule``).

    Returns
    -------
    Workload
        Requests without arrival times unless ``kind="schedule"``; see ``with_arrivals``.
    """
    if kind not in KINDS:
        raise unknown_name("workload kind", kind, KINDS)
    fn = KINDS[kind]
    accepted = inspect.signature(fn).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for workload {kind!r}; valid: {', '.join(accepted)}")
    return fn(**options)


__all__ = [
    "KINDS",
    "Request",
    "TokenCounter",
    "Workload",
    "build_workload",
    "gamma_arrivals",
    "get_token_counter",
    "load_alpaca",
    "load_schedule",
    "load_sharegpt",
    "save_schedule",
    "synthetic_workload",
    "with_arrivals",
]
