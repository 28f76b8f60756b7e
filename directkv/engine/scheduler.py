"""Continuous batching with chunked prefill and admission by KV memory (one scheduler for all executors).

Each step: every running request that finished its prompt decodes one token; the rest of the token budget
goes to prompt chunks, first of requests already prefilling, then of newly admitted ones (FIFO).
Admission reserves the request's whole KV (prompt + output) in the system's tier, so a running request
never runs out of memory (no preemption); a request that does not fit waits, and one that could never
fit, even alone, is marked `oom`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from directkv.engine.state import PrefillChunk, ReqState, Step
from directkv.errors import KVCapacityError, check
from directkv.memory import KVCacheManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048  # prompt-chunk + decode tokens per step

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_batched_tokens >= 1, f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, tier: str):
        self.cfg, self.kv, self.tier = cfg, kv, tier
        self.waiting: deque[ReqState] = deque()
        self.running: list[ReqState] = []
        self.rejected: list[ReqState] = []

    def add(self, state: ReqState) -> None:
        self.waiting.append(state)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self, s: ReqState, now: float) -> bool:
        need = s.req.prompt_len + s.req.output_len
        try:
            self.kv.reserve(s.req_id, need, self.tier)
        except KVCapacityError as e:
            if not self.kv.could_ever_fit(need, self.tier):
                s.status, s.error = "oom", str(e)
                self.rejected.append(s)
                self.waiting.popleft()
            return False
        self.waiting.popleft()
        s.status, s.admitted_t = "running", now
        self.running.append(s)
        return True

    def schedule(self, now: float) -> Step:
        budget = self.cfg.max_batched_tokens
        decodes = [s for s in self.running if s.prefill_done][:budget]
        budget -= len(decodes)
        chunks: list[PrefillChunk] = []
        for s in self.running:
            if budget <= 0:
                break
            if not s.prefill_done:
                n = min(s.req.prompt_len - s.prefilled, budget)
                chunks.append(PrefillChunk(s, n, s.prefilled))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            head = self.waiting[0]
            if not self._admit(head, now):
                if head.status == "oom":
                    continue
                break  # FIFO: later requests wait behind the head
            n = min(head.req.prompt_len, budget)
            chunks.append(PrefillChunk(head, n, 0))
            budget -= n
        return Step(tuple(decodes), tuple(chunks))

    def complete(self, step: Step, now: float) -> list[ReqState]:
        """Apply a finished step at time `now`; returns the requests that finished."""
        for s in step.decodes:
            s.generated += 1
            s.token_times.append(now)
            self.kv.append(s.req_id, 1)
        for c in step.prefills:
            c.state.prefilled += c.chunk_len
            self.kv.append(c.state.req_id, c.chunk_len)
            if c.state.prefill_done:  # the prompt's last chunk also yields the first output token
                c.state.generated += 1
                c.state.token_times.append(now)
        done = [s for s in self.running if s.finished]
        for s in done:
            s.status = "done"
            self.kv.free(s.req_id)
        self.running = [s for s in self.running if not s.finished]
        return done
