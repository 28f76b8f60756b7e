"""slot_runs / sequence_runs: the contiguous stretches of valid slots that the stream prefill plan's passes and
cpu_attn attend, checked against a loop written from their definition."""

import random

import numpy as np
import pytest

from directkv.errors import ConfigError
from directkv.kernels.paged import sequence_runs, slot_runs


def _by_definition(pages, tokens, page_size):
    """Pages in id order (then token count); a page joins the run before it when its id follows and every page
    of that run is full."""
    runs = []
    for page, n in sorted(zip(pages, tokens, strict=True)):
        if n <= 0:
            continue
        if runs and page * page_size == runs[-1][0] + runs[-1][1] and runs[-1][1] % page_size == 0:
            runs[-1][1] += n
        else:
            runs.append([page * page_size, n])
    return [(a, b) for a, b in runs]


def test_slot_runs_join_consecutive_pages_in_id_order():
    assert slot_runs([2, 3, 4], [4, 4, 2], 4) == [(8, 10)]  # one run, last page half full
    assert slot_runs([7, 8, 1, 4, 5], [4, 4, 4, 4, 3], 4) == [(4, 4), (16, 7), (28, 8)]
    assert slot_runs([5, 4, 3], [4, 4, 1], 4) == [(12, 1), (16, 8)]  # descending ids; the partial page ends a run
    assert slot_runs([5, 6, 9], [4, 4, 0], 4) == [(20, 8)]  # an empty page is not read
    assert slot_runs([3, 3, 4], [4, 4, 4], 4) == [(12, 4), (12, 8)]  # a page named twice starts a run again
    assert slot_runs([], [], 16) == []


@pytest.mark.parametrize("seed", range(4))
def test_slot_runs_and_sequence_runs_match_the_definition(seed):
    """Random pages (repeats, gaps, any order), full, partial, empty and negative counts, pages as lists or
    numpy arrays; the runs come back as Python ints."""
    rng = random.Random(seed)
    for _ in range(500):
        ps = rng.choice([1, 4, 16])
        k = rng.randint(0, 40)
        pages = [rng.randint(0, 30) for _ in range(k)]
        tokens = [rng.choice([ps, ps, ps, rng.randint(-2, ps)]) for _ in range(k)]
        got = slot_runs(np.array(pages, dtype=np.int32), tokens, ps)
        assert got == _by_definition(pages, tokens, ps), (pages, tokens, ps)
        assert all(type(a) is int and type(b) is int for a, b in got)
        n = rng.randint(0, k * ps + 3)
        assert sequence_runs(pages, n, ps) == _by_definition(pages, [min(ps, n - j * ps) for j in range(k)], ps)


def test_slot_runs_wants_one_count_per_page_of_at_most_page_size():
    with pytest.raises(ConfigError, match="one token count per page; got 3 pages and 2 counts"):
        slot_runs([1, 2, 3], [4, 4], 4)
    with pytest.raises(ConfigError, match="at most page_size = 4 tokens; got a count of 8"):
        slot_runs([3, 5], [8, 4], 4)
