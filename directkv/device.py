"""Which device a run uses: `auto` is CUDA where a GPU is visible, else the CPU (where serving is simulated).

One rule for the experiments' `device=` and the profiler's `--device`, so a CPU run on a machine with a GPU
(the CPU tests there) asks for the CPU by name and gets it.
"""

from __future__ import annotations

import torch

from directkv.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str) -> str:
    """The device to run on, `cpu` or `cuda`, for `requested` (one of DEVICES); `cuda` without a visible GPU is an
    error."""
    if requested not in DEVICES:
        raise ConfigError(f"unknown device {requested!r}; valid: {', '.join(DEVICES)}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is visible; use device=auto or device=cpu to simulate")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
