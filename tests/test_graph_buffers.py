"""The graph sets of one slot share their static tensors (model/graphs.py SlotBuffers): what they hold, and on
the GPU what enable_graphs allocates for the default buckets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from directkv.model import ModelRunner, init_weights
from directkv.model.graphs import BUCKETS, eager_capture
from directkv.specs.models import get_model


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_sets_of_a_slot_share_buffers_and_a_pool_and_slots_do_not():
    spec = dataclasses.replace(get_model("tiny"), num_layers=4)
    runner = ModelRunner(spec, init_weights(spec, device="cpu", dtype=torch.float32, seed=1))
    pools = []

    def recording(fn, pool):
        pools.append(pool)
        return eager_capture(fn, pool)

    runner.enable_graphs((2, 4, 8), slots=2, capture=recording)
    per_slot = 3 * 2 * spec.num_layers  # 3 sets of 2 graphs per layer, slot 0 first
    assert len(pools) == 2 * per_slot and pools[0] is not None
    assert all(p is pools[0] for p in pools[:per_slot]) and all(p is pools[per_slot] for p in pools[per_slot:])
    assert pools[0] is not pools[per_slot]
    sets = runner._graph_sets
    for slot in (0, 1):
        small, large = sets[(2, slot)], sets[(8, slot)]
        assert (small.size, large.size) == (2, 8)
        assert small.pre_out[0][1].shape[0] == 2 and large.pre_out[0][1].shape[0] == 8
        for a, b in [(small.x0, large.x0), (small.attn, large.attn), (small.pre_out[1][2], large.pre_out[1][2]),
                     (small.post_out[-1], large.post_out[-1])]:
            assert a.data_ptr() == b.data_ptr()
    assert _ptr(sets[(8, 0)].x0) != _ptr(sets[(8, 1)].x0)
    assert _ptr(sets[(8, 0)].pre_out[0][0]) != _ptr(sets[(8, 1)].pre_out[0][0])
    gs = sets[(8, 0)]
    # every layer keeps its own q, k, v for the step; x alternates between two buffers
    assert len({_ptr(t) for qkv in gs.pre_out for t in qkv}) == 3 * spec.num_layers
    assert [_ptr(x) for x in gs.post_out] == [_ptr(gs.post_out[i % 2]) for i in range(spec.num_layers)]
    assert _ptr(gs.post_out[0]) != _ptr(gs.post_out[1])


def test_a_larger_bucket_added_later_gets_buffers_of_its_own_and_both_still_serve():
    spec = get_model("tiny")
    w = init_weights(spec, device="cpu", dtype=torch.float32, seed=1)
    eager, runner = ModelRunner(spec, w), ModelRunner(spec, w)
    runner.enable_graphs((2,), capture=eager_capture)
    runner.enable_graphs((2, 16), capture=eager_capture)  # idempotent for 2, a new set for 16
    assert runner._graph_sets[(2, 0)].x0.shape[0] == 2 and runner._graph_sets[(16, 0)].x0.shape[0] == 16
    assert _ptr(runner._graph_sets[(2, 0)].x0) != _ptr(runner._graph_sets[(16, 0)].x0)
    group = spec.num_heads // spec.num_kv_heads

    def attend(layer, q, k, v):
        return q + k.repeat_interleave(group, dim=1) * v.repeat_interleave(group, dim=1)

    gen = torch.Generator().manual_seed(3)
    for n in (2, 11, 1, 16):  # the old buffers' set, the new ones', and back
        tokens = torch.randint(0, spec.vocab_size, (n,), generator=gen)
        positions = torch.randint(0, 40, (n,), generator=gen)
        rows = torch.arange(n)
        torch.testing.assert_close(runner.forward(tokens, positions, attend, rows),
                                   eager.forward(tokens, positions, attend, rows), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_buckets_allocate_one_set_of_buffers_per_slot():
    """Llama-3.1-8B's shapes at 8 layers: the graphs of every bucket up to 256 leave allocated what one set of
    256-row buffers holds (plus the RoPE tables), not each bucket's outputs (83.6 MB at these shapes before)."""
    spec = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=8)
    runner = ModelRunner(spec, init_weights(spec, device="cuda", dtype=torch.bfloat16, seed=2))
    runner.enable_graphs((1,))  # cuBLAS's workspaces and the first pool, outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    runner.enable_graphs(BUCKETS)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    rows, kv = max(BUCKETS), spec.num_kv_heads * spec.head_dim
    # per row: every layer's q, k, v; x0, the two x buffers and attn (q_dim); cos and sin (float32, D / 2 each)
    per_row = 2 * (spec.num_layers * (spec.q_dim + 2 * kv) + 3 * spec.hidden_size + spec.q_dim) + 4 * spec.head_dim
    buffers = rows * per_row
    old_outputs = sum(BUCKETS[1:]) * spec.num_layers * 2 * (spec.q_dim + 2 * kv + spec.hidden_size)
    assert buffers <= grown <= buffers + (4 << 20), (grown, buffers)
    assert grown < 0.5 * old_outputs
