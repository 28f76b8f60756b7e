"""Stanford Alpaca instructions -> requests: prompt = instruction (+ input), output = the reference answer."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict
from pathlib import Path

from directkv.errors import ConfigError
from workloads.datafiles import file_key, resolve_data_file
from workloads.request import Workload
from workloads.sampling import LengthFilter, TextPair, sample_requests
from workloads.tokenizer import TokenCounter, get_token_counter

SAMPLE_FILE = ("alpaca", "alpaca_5000.json")
_HINT = ("point DIRECTKV_DATA_DIR at a folder holding alpaca/alpaca_5000.json, or pass workload=alpaca "
         "workload.path=alpaca_data.json (from github.com/tatsu-lab/stanford_alpaca)")


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The prompt text: the instruction, then the input after a blank line when there is one."""
    return instruction + ("\n\n" + input_text if input_text else "")


@functools.lru_cache(maxsize=4)
def _read_cached(key: tuple[str, int, int]) -> tuple[TextPair, ...]:
    path = key[0]
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not an Alpaca JSON file ({err})") from err
    if not isinstance(records, list):
        raise ConfigError(f"{path} is not an Alpaca JSON file: expected a list of records")
    pairs = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("instruction"), str):
            raise ConfigError(f"{path}: record {i} has no 'instruction' string")
        prompt = alpaca_prompt(rec["instruction"], rec.get("input") or "")
        pairs.append((f"alpaca:{i}", prompt, str(rec.get("output") or "")))
    return tuple(pairs)


def read_alpaca(path: Path) -> tuple[TextPair, ...]:
    """(source, prompt, output) per record in file order; parsed once per process."""
    return _read_cached(file_key(path))


def load_alpaca(
    path: str | os.PathLike | None = None,
    *,
    num_requests: int,
    seed: int = 0,
    min_prompt: int | None = 4,
    max_prompt: int | None = 1024,
    max_total: int | None = 2048,
    min_output: int | None = 4,
    fixed_output_len: int | None = None,
    counter: TokenCounter | None = None,
) -> Workload:
    """Sample Alpaca requests with the same seeded shuffle and length filters as ``load_sharegpt``.

    Parameters
    ----------
    path : str | PathLike | None
        Alpaca JSON list of ``{instruction, input, output}``. None: the 5,000-record sample in
        ``$DIRECTKV_DATA_DIR/alpaca/`` or ``../shared/data/alpaca/``.
    num_requests, seed, min_prompt, max_prompt, max_total, min_output, fixed_output_len, counter
        As in ``load_sharegpt``. Alpaca answers are short, so ``min_output=4`` drops the one-word ones.

    Returns
    -------
    Workload
        ``requests`` ``[num_requests]``, sources ``"alpaca:<index in file>"``.
    """
    limits = LengthFilter(min_prompt, max_prompt, max_total, min_output, fixed_output_len)
    counter = counter or get_token_counter()
    file = resolve_data_file("Alpaca", path, package=None, sample=SAMPLE_FILE, hint=_HINT)
    pairs = read_alpaca(file)
    requests = sample_requests(
        pairs, num_requests=num_requests, seed=seed, limits=limits, counter=counter, what=f"Alpaca ({file})"
    )
    params = {"num_requests": num_requests, "seed": seed, **asdict(limits), "file_records": len(pairs)}
    return Workload(requests, "alpaca", str(file), counter.name, params)
