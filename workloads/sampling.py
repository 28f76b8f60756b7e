"""vLLM's benchmark sampling rules, shared by the text datasets: seeded shuffle, tokenize, length filters."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from directkv.errors import ConfigError, check
from workloads.request import Request
from workloads.tokenizer import TokenCounter

# (source label, prompt text, output text), e.g. ("sharegpt:QWJhYvA_0", "Summarize ...", "Here are ...")
TextPair = tuple[str, str, str]


@dataclass(frozen=True)
class LengthFilter:
    """Token-length limits a sampled request must meet; None disables a limit.

    Defaults are vLLM's ShareGPT defaults: prompt >= 4, output >= 4, prompt <= 1024, prompt + output <= 2048.
    With ``fixed_output_len`` every request gets that output length and, as in vLLM, the minimum-output rule
    is skipped (the dataset's answer length no longer matters).
    """

    min_prompt: int | None = 4
    max_prompt: int | None = 1024
    max_total: int | None = 2048
    min_output: int | None = 4
    fixed_output_len: int | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check(
                value is None or (isinstance(value, int) and value >= 1),
                f"{name} must be a positive integer or None, got {value!r}",
            )
        if self.min_prompt is not None and self.max_prompt is not None:
            check(
                self.min_prompt <= self.max_prompt,
                f"min_prompt ({self.min_prompt}) must be <= max_prompt ({self.max_prompt})",
            )

    def accepts(self, prompt_len: int, output_len: int) -> bool:
        """Whether a request with these token counts is kept (output_len already fixed if requested)."""
        if self.min_prompt is not None and prompt_len < self.min_prompt:
            return False
        if self.fixed_output_len is None and self.min_output is not None and output_len < self.min_output:
            return False
        if self.max_prompt is not None and prompt_len > self.max_prompt:
            return False
        return self.max_total is None or prompt_len + output_len <= self.max_total

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def sample_requests(
    pairs: Sequence[TextPair],
    *,
    num_requests: int,
    seed: int,
    limits: LengthFilter,
    counter: TokenCounter,
    what: str,
) -> list[Request]:
    """Shuffle ``pairs`` with ``random.Random(seed)``, tokenize in that order, keep those ``limits`` accept.

    Shuffling the whole candidate list and stopping at ``num_requests`` is what vLLM's benchmark does, so for
    the same file, seed and tokenizer the same records come out.

    Parameters
    ----------
    pairs : sequence of (source, prompt_text, output_text)
        Candidates in file order, ``[num_candidates]``.
    num_requests : int
        How many requests to return.
    seed : int
        Shuffle seed.
    limits : LengthFilter
        Token-length rules.
    counter : TokenCounter
        Gives the token counts.
    what : str
        Names the data in the error raised when too few candidates pass, e.g. ``"ShareGPT (/x.json)"``.

    Returns
    -------
    list[Request]
        ``[num_requests]``, ``req_id`` 0..num_requests-1 in sampling order, ``arrival_s`` 0.
    """
    check(
        isinstance(num_requests, int) and num_requests >= 1,
        f"num_requests must be a positive integer, got {num_requests!r}",
    )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out: list[Request] = []
    start = 0
    while start < len(order) and len(out) < num_requests:
        # Tokenize in batches a bit larger than what is still missing: batch encoding is fast, and most of a
        # large file is never needed.
        size = min(2048, max(64, 2 * (num_requests - len(out))))
        chunk = [pairs[i] for i in order[start : start + size]]
        start += size
        prompt_lens = counter.count_many([p for _, p, _ in chunk])
        if limits.fixed_output_len is None:
            output_lens = counter.count_many([o for _, _, o in chunk])
        else:
            output_lens = [limits.fixed_output_len] * len(chunk)
        for (source, _, _), p_len, o_len in zip(chunk, prompt_lens, output_lens, strict=True):
            if limits.accepts(p_len, o_len):
                out.append(Request(req_id=len(out), prompt_len=p_len, output_len=o_len, source=source))
                if len(out) == num_requests:
                    break
    if len(out) < num_requests:
        raise ConfigError(
            f"only {len(out)} of {len(pairs)} {what} candidates pass the filters ({limits.describe()}) "
            f"with {counter.name}; asked for num_requests={num_requests}"
        )
    return out
