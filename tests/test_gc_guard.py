"""GcGuard: what exists is frozen during the run and unfrozen after; the collections inside are counted and timed."""

import gc

from directkv.engine.gpu.gc_guard import GcGuard


class _Cycle:
    def __init__(self):
        self.me = self


def test_collections_inside_are_counted_and_the_freeze_is_undone():
    before = gc.get_freeze_count()
    with GcGuard() as guard:
        assert gc.get_freeze_count() > before  # the objects that existed are frozen
        for _ in range(3):
            [_Cycle() for _ in range(1000)]
            gc.collect()  # an explicit collection goes through the callbacks too
    cols = guard.columns()
    assert cols["gc_collections"] >= 3 and cols["gc_oldest_collections"] >= 3 and cols["gc_pause_ms"] > 0
    assert gc.get_freeze_count() == 0 and guard._callback not in gc.callbacks


def test_nothing_is_counted_after_exit():
    with GcGuard() as guard:
        pass
    n = guard.columns()["gc_collections"]
    gc.collect()
    assert guard.columns()["gc_collections"] == n
