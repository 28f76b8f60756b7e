import pytest
import torch

from directkv.errors import ConfigError, KVCapacityError
from directkv.memory import KVCacheManager
from directkv.specs import get_model

TINY = get_model("tiny")
TOK = TINY.kv_bytes_per_token()


def test_accounting_reserve_append_free():
    kv = KVCacheManager(TINY, page_size=16, hbm_budget_bytes=0, host_budget_bytes=100 * 16 * TOK)
    kv.reserve(1, 40, "host")  # 3 pages
    kv.append(1, 33)
    assert kv.seq_len(1) == 33 and kv.stats().host_bytes == 3 * 16 * TOK
    kv.append(1, 20)  # grows past the reservation: 53 tokens -> 4 pages
    assert kv.stats().host_bytes == 4 * 16 * TOK
    kv.free(1)
    s = kv.stats()
    assert s.host_bytes == 0 and s.host_peak_bytes == 4 * 16 * TOK and s.hbm_bytes == 0


def test_budget_exhaustion_is_typed_and_leaves_state_clean():
    kv = KVCacheManager(TINY, page_size=16, hbm_budget_bytes=4 * 16 * TOK, host_budget_bytes=0)
    kv.reserve(1, 48, "hbm")
    with pytest.raises(KVCapacityError) as e:
        kv.reserve(2, 17, "hbm")
    assert e.value.tier == "hbm"
    assert kv.free_pages("hbm") == 1 and kv.can_fit(16, "hbm") and not kv.can_fit(17, "hbm")
    assert kv.could_ever_fit(64, "hbm") and not kv.could_ever_fit(65, "hbm")
    with pytest.raises(KVCapacityError):
        kv.reserve(3, 1, "host")


@pytest.mark.parametrize("bad", [dict(hbm_budget_bytes=-1, host_budget_bytes=0),
                                 dict(hbm_budget_bytes=0, host_budget_bytes=-5)])
def test_negative_budget_rejected(bad):
    with pytest.raises(ConfigError, match="budget must be >= 0"):
        KVCacheManager(TINY, **bad)


def test_materialized_write_and_view_roundtrip_across_tiers():
    torch.manual_seed(0)
    kv = KVCacheManager(TINY, page_size=16, hbm_budget_bytes=8 * 16 * TOK, host_budget_bytes=8 * 16 * TOK,
                        materialize=True, dtype=torch.float32, hbm_device="cpu")
    kv.reserve(7, 37, "host")
    kv.reserve(9, 21, "hbm")
    data = {}
    for r, n in ((7, 37), (9, 21)):
        for layer in range(TINY.num_layers):
            k = torch.randn(n, TINY.num_kv_heads, TINY.head_dim)
            v = torch.randn(n, TINY.num_kv_heads, TINY.head_dim)
            kv.write(layer, r, 0, k[:10], v[:10])  # two writes, the second crossing page boundaries
            kv.write(layer, r, 10, k[10:], v[10:])
            data[r, layer] = (k, v)
        kv.append(r, n)
    for layer in range(TINY.num_layers):
        view = kv.view(layer, [7, 9])
        assert view.block_table[0, 0] >= 0 and view.block_table[1, 0] < 0  # host vs hbm pages
        for i, r in enumerate((7, 9)):
            k, v = view.gather(i)
            torch.testing.assert_close(k, data[r, layer][0])
            torch.testing.assert_close(v, data[r, layer][1])
    assert not kv.arena.pinned  # a CPU run (on a machine with a GPU too): ordinary tensors, their own device view
    assert kv.arena.k_view is kv.arena.k


def test_page_ids_stay_inside_the_pool_after_frees():
    kv = KVCacheManager(TINY, page_size=16, hbm_budget_bytes=0, host_budget_bytes=10 * 16 * TOK)
    for round_ in range(20):  # allocate, free, allocate again: ids must be reused, never grow past capacity
        for r in range(3):
            kv.reserve(round_ * 10 + r, 40, "host")
        assert max(e for r in range(3) for e in kv.pages(round_ * 10 + r)) < kv.capacity_pages["host"]
        for r in range(3):
            kv.free(round_ * 10 + r)


def test_recycled_pages_are_handed_out_lowest_first_in_ascending_order():
    """Freed pages come back as runs of consecutive ids, so bulk copies (swap's stager) need few copies."""
    m = get_model("tiny")
    kv = KVCacheManager(m, page_size=16, hbm_budget_bytes=0, host_budget_bytes=64 * 16 * m.kv_bytes_per_token(),
                        materialize=False)
    kv.reserve(0, 10 * 16, "host")
    kv.reserve(1, 10 * 16, "host")
    kv.free(1)
    kv.free(0)  # freed last-to-first: a plain stack would hand out 9, 8, ..., 0
    kv.reserve(2, 20 * 16, "host")
    assert kv.pages(2) == list(range(20))


def test_block_table_and_decode_slots_match_the_per_request_forms():
    """The padded block table and the decode tokens' slots, built from lists in one tensor each, equal the
    per-request forms (pages, slots) for host and HBM pages, pages recycled out of order, and no requests."""
    kv = KVCacheManager(TINY, page_size=4, hbm_budget_bytes=64 * 4 * TOK,
                        host_budget_bytes=64 * 4 * TOK)
    for r, (n, tier) in enumerate([(9, "host"), (3, "hbm"), (17, "host"), (1, "hbm")]):
        kv.reserve(r, n, tier)
        kv.append(r, n)
    kv.free(0)
    kv.reserve(4, 6, "host")  # recycled pages first
    kv.append(4, 6)
    reqs, positions = [4, 1, 2, 3], [5, 2, 16, 0]
    table = kv.block_table(reqs)
    assert table.dtype == torch.int32 and table.shape == (4, max(len(kv.pages(r)) for r in reqs))
    for i, r in enumerate(reqs):
        row = table[i].tolist()
        assert row[: len(kv.pages(r))] == kv.pages(r) and set(row[len(kv.pages(r)):]) <= {0}
    assert kv.block_table([]).shape == (0, 1)
    want = torch.cat([kv.slots(r, p, 1) for r, p in zip(reqs, positions, strict=True)])
    assert torch.equal(kv.decode_slots(reqs, positions), want)
    assert kv.decode_slots([], []).shape == (0,)


def test_a_materialized_cache_names_its_device():
    with pytest.raises(ConfigError, match=r"a materialized KV cache needs hbm_device, the run's device .*; got None"):
        KVCacheManager(TINY, page_size=16, hbm_budget_bytes=16 * TOK, host_budget_bytes=16 * TOK, materialize=True,
                       dtype=torch.float32)
