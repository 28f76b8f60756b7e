"""Traffic records: the bytes a kernel schedule moves per memory tier, counted as it runs.

`host` is memory on the far side of the CPU-GPU link (pinned CPU memory read zero-copy or by the copy
engine); `hbm` is GPU memory. A schedule calls `TrafficCounter.read/write` for every tile it touches,
so the record is what the loop did, not a formula written beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

TIERS = ("hbm", "host")


@dataclass
class Traffic:
    link_read_bytes: int = 0  # host -> GPU
    link_write_bytes: int = 0  # GPU -> host
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    flops: int = 0

    # Added once per layer by the serving paths: field names are read once, not through asdict's deep copy.
    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, k) + getattr(other, k) for k in _FIELDS))

    def scaled(self, factor: int) -> Traffic:
        return Traffic(*(getattr(self, k) * factor for k in _FIELDS))

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in _FIELDS}


_FIELDS = tuple(f.name for f in fields(Traffic))


@dataclass
class TrafficCounter:
    traffic: Traffic = field(default_factory=Traffic)

    def read(self, nbytes: int, tier: str) -> None:
        if tier == "host":
            self.traffic.link_read_bytes += int(nbytes)
        elif tier == "hbm":
            self.traffic.hbm_read_bytes += int(nbytes)
        else:
            raise ValueError(f"unknown tier {tier!r}; valid: {', '.join(TIERS)}")

    def write(self, nbytes: int, tier: str) -> None:
        if tier == "host":
            self.traffic.link_write_bytes += int(nbytes)
        elif tier == "hbm":
            self.traffic.hbm_write_bytes += int(nbytes)
        else:
            raise ValueError(f"unknown tier {tier!r}; valid: {', '.join(TIERS)}")

    def compute(self, flops: int) -> None:
        self.traffic.flops += int(flops)
