"""Serving metrics with vLLM's benchmark names, from per-request token times.

Per-token latency as the paper defines it is the mean TPOT, (e2e - ttft) / (output_tokens - 1), with
arrival-to-token times, so queueing counts.
"""

from __future__ import annotations

import numpy as np

from directkv.engine.state import ReqState


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    a = np.asarray(values_s, dtype=float) * 1e3
    if a.size == 0:
        return {f"mean_{name}_ms": float("nan"), f"median_{name}_ms": float("nan"), f"p99_{name}_ms": float("nan")}
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"p99_{name}_ms": float(np.percentile(a, 99))}


def summarize(states: list[ReqState], duration_s: float) -> dict[str, float]:
    done = [s for s in states if s.status == "done" and s.token_times]
    ttft = [s.token_times[0] - s.req.arrival_s for s in done]
    e2el = [s.token_times[-1] - s.req.arrival_s for s in done]
    tpot = [(e - t) / (len(s.token_times) - 1) for s, t, e in zip(done, ttft, e2el, strict=True)
            if len(s.token_times) > 1]
    itl = [b - a for s in done for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
    out_tokens = sum(len(s.token_times) for s in done)
    in_tokens = sum(s.req.prompt_len for s in done)
    dur = max(duration_s, 1e-12)
    return {
        "completed": len(done),
        "num_oom": sum(s.status == "oom" for s in states),
        "num_error": sum(s.status == "error" for s in states),
        "duration_s": duration_s,
        "request_throughput": len(done) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        **_stats("ttft", ttft),
        **_stats("tpot", tpot),
        **_stats("itl", itl),
        **_stats("e2el", e2el),
    }
