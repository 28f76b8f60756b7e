"""The unit every executor consumes: a request reduced to its lengths, plus the workload that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One request as the engine sees it: token counts only, never text.

    Attributes
    ----------
    req_id : int
        Position in the workload, 0-based; unique within one workload.
    prompt_len : int
        Prompt tokens (prefill length).
    output_len : int
        Tokens to generate (decode steps + 1, the first coming from prefill).
    arrival_s : float
        Arrival time in seconds from the start of the run; 0 for an offline batch.
    source : str
        Where the lengths came from, e.g. ``"sharegpt:QWJhYvA_0"`` or ``"synthetic:17"``.
    """

    req_id: int
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    source: str = ""


@dataclass
class Workload:
    """A request schedule plus what is needed to record where it came from.

    Attributes
    ----------
    requests : list[Request]
        In arrival order when arrivals are set, otherwise in sampling order.
    dataset : str
        ``"sharegpt"``, ``"alpaca"`` or ``"synthetic"``.
    path : str | None
        The data file actually read (absolute), None for synthetic workloads.
    tokenizer : str
        ``TokenCounter.name`` used for the lengths (``"none"`` for synthetic).
    params : dict
        Sampling filters, seeds and arrival settings; JSON-serialisable, copied into results manifests.
    """

    requests: list[Request]
    dataset: str
    path: str | None
    tokenizer: str
    params: dict = field(default_factory=dict)
