"""What the CUDA benchmarks (bench_prefill, bench_gemm, bench_proj) share: the L2 flush before each timed call,
the run's ceilings, timing, the rel.-error check of a row, a row's status, and the CLI's output."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import torch

from directkv.kernels.cuda.zero_copy import pinned_empty
from directkv.timing import time_fn

_FLUSH: list[torch.Tensor] = []


def flush_l2() -> None:
    """Overwrite L2 (60 MiB on an H200) with a 256 MiB write so no timed call starts from warm operands."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    _FLUSH[0].fill_(1)


def get_ceilings() -> dict:
    """probe.measure_ceilings() of this run; if the probe fails, the copy-engine H2D rate alone (noted)."""
    try:
        from directkv.kernels.cuda.probe import measure_ceilings

        return dict(measure_ceilings())
    except Exception as err:  # the benchmark still runs; the row says why the SM ceiling is missing
        host = pinned_empty((256 << 20,), torch.uint8)
        dst = torch.empty(host.shape, dtype=torch.uint8, device="cuda")
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, device="cuda"))
        t = time_fn(lambda: dst.copy_(host, non_blocking=True), warmup=2, repeats=5)
        return {"ce_h2d_gbps": host.numel() / (t.median_ms * 1e-3) / 1e9, "ceilings_error": f"{type(err).__name__}: {err}"}


def timed(fn: Callable[[], object], *, warmup: int, repeats: int) -> dict:
    """time_fn with an L2 flush before every call (untimed): time_ms (median), min, max, repeats, clock."""
    return time_fn(fn, warmup=warmup, repeats=repeats, setup=flush_l2).as_dict()


def check_rel_err(row: dict, result: torch.Tensor, reference: torch.Tensor, limit: float, anchor: str,
                  what: str) -> None:
    """row["rel_err"] of `result` against the float64 `reference`; above `limit`, or NaN (an output left
    poisoned), a ValueError that run_point records as the row's error."""
    row["rel_err"] = float((result.double() - reference).norm() / reference.norm())
    if not row["rel_err"] <= limit:  # NaN fails too
        raise ValueError(f"rel. error {row['rel_err']:.3g} against {anchor} exceeds {limit}: wrong {what}")


def run_point(row: dict, measure: Callable[[], None]) -> dict:
    """Run measure() (which fills row) and set row["status"]: ok, oom or error (with the message)."""
    try:
        measure()
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0])
    except Exception as err:  # one failing point must not end the sweep
        row.update(status="error", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    size = row.get("q_len", row.get("m"))
    print(f"[{row['op']} {size} {row['variant']}] {row['status']} {row.get('time_ms', '-')} ms {row.get('error', '')}",
          flush=True)  # progress: a later point that hangs still leaves these lines
    return row


def report(rows: list[dict], out: str | None, cols: Sequence[str]) -> None:
    """A bench CLI's output: the rows as JSON at `out` when given, and the table of `cols`."""
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print_table(rows, cols)


def print_table(rows: list[dict], cols: Sequence[str]) -> None:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    table = [list(cols)] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
    for r in rows:
        if r.get("error"):
            print(f"{r['variant']} {r.get('q_len', r.get('m'))}: {r['error']}")
