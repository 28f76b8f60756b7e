"""Typed errors. `ConfigError` is what a user sees as one line; the others drive engine decisions."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad name or value given by the user. The CLI prints it as one line and exits non-zero."""


def unknown_name(kind: str, name: object, valid: Iterable[str]) -> ConfigError:
    return ConfigError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond; for validating user-supplied values."""
    if not cond:
        raise ConfigError(message)


class KVCapacityError(MemoryError):
    """A KV allocation does not fit the budget of `tier` ('hbm' or 'host').

    The scheduler turns it into queueing (try later) or, when the request could never fit,
    into a result row with status=oom.
    """

    def __init__(self, tier: str, needed_bytes: int, free_bytes: int, budget_bytes: int):
        self.tier = tier
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"{tier} KV budget exhausted: need {needed_bytes / 2**30:.3f} GiB, "
            f"free {free_bytes / 2**30:.3f} GiB of {budget_bytes / 2**30:.3f} GiB"
        )
