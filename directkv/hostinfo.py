"""The host CPU as Linux's /proc/cpuinfo describes it (model name, instruction-set flags), for result rows
and for the build cache key of ops compiled with -march=native."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path


@cache
def _cpuinfo() -> list[str] | None:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return None


def cpuinfo_field(key: str) -> str | None:
    """The first CPU's `key` line's value ("model name", "flags"), or None where there is no /proc/cpuinfo
    or no such line."""
    line = next((ln for ln in _cpuinfo() or [] if ln.startswith(key)), None)
    return None if line is None else line.split(":", 1)[1].strip()


def cpu_name() -> str:
    """The CPU's model name, else what platform reports."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()
