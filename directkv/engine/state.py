"""Per-request state the scheduler and executors share, and the step they agree on."""

from __future__ import annotations

from dataclasses import dataclass, field

from workloads.request import Request


@dataclass
class ReqState:
    req: Request
    prefilled: int = 0  # prompt tokens whose KV is in the cache
    generated: int = 0  # output tokens produced
    admitted_t: float | None = None
    token_times: list[float] = field(default_factory=list)  # time of each output token
    status: str = "waiting"  # waiting | running | done | oom | error
    error: str = ""

    @property
    def req_id(self) -> int:
        return self.req.req_id

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.req.prompt_len

    @property
    def context_len(self) -> int:
        """Tokens whose KV is cached now."""
        return self.prefilled + max(0, self.generated - 1)

    @property
    def finished(self) -> bool:
        return self.generated >= self.req.output_len


@dataclass(frozen=True)
class PrefillChunk:
    state: ReqState
    chunk_len: int
    past_len: int  # tokens of this request already cached before the chunk


@dataclass(frozen=True)
class Step:
    """One engine iteration: decode tokens for running requests plus prompt chunks (chunked prefill)."""

    decodes: tuple[ReqState, ...]
    prefills: tuple[PrefillChunk, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.chunk_len for c in self.prefills)

    @property
    def decode_kv_lens(self) -> list[int]:
        """KV length each decode query attends to (cached tokens plus the new one)."""
        return [s.context_len + 1 for s in self.decodes]

    @property
    def num_logits(self) -> int:
        """Sequences producing a token this step (decodes plus prefills that finish their prompt)."""
        return len(self.decodes) + sum(
            1 for c in self.prefills if c.past_len + c.chunk_len >= c.state.req.prompt_len
        )
