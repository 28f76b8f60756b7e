"""Bytes and FLOPs of one engine step, per layer, from the kernels' closed-form traffic.

The closed forms (`directkv.kernels.traffic_model`) are tested equal to what the reference schedules count
as they run, so the simulation charges each system exactly the traffic its kernels would move.
"""

from __future__ import annotations

from dataclasses import replace

from directkv.engine.state import Step
from directkv.kernels import traffic_model as tm
from directkv.kernels.traffic import Traffic
from directkv.specs import ModelSpec


def linear_layer_traffic(model: ModelSpec, tokens: int) -> Traffic:
    """One layer's projections and MLP for `tokens` tokens: weights read once from HBM per step."""
    per_layer_flops = (model.linear_flops_per_token() - 2 * model.hidden_size * model.vocab_size) // model.num_layers
    act = tokens * (4 * model.hidden_size + 3 * model.intermediate_size) * model.dtype_bytes
    return Traffic(hbm_read_bytes=model.layer_params() * model.dtype_bytes + act, hbm_write_bytes=act,
                   flops=tokens * per_layer_flops)


def lm_head_traffic(model: ModelSpec, rows: int) -> Traffic:
    if rows == 0:
        return Traffic()
    return Traffic(hbm_read_bytes=model.hidden_size * model.vocab_size * model.dtype_bytes,
                   hbm_write_bytes=rows * model.vocab_size * 4, flops=2 * rows * model.hidden_size * model.vocab_size)


def past_kv_tokens(step: Step) -> int:
    """Cached tokens the step's attention reads (decodes attend to their cache; chunks to their past)."""
    return sum(s.context_len for s in step.decodes) + sum(c.past_len for c in step.prefills)


def only_prefills(step: Step) -> Step:
    return Step((), step.prefills)


def to_hbm(t: Traffic) -> Traffic:
    """The same schedule with the KV in HBM: link bytes become HBM bytes."""
    return replace(t, link_read_bytes=0, link_write_bytes=0, hbm_read_bytes=t.hbm_read_bytes + t.link_read_bytes,
                   hbm_write_bytes=t.hbm_write_bytes + t.link_write_bytes)


def head_shape(model: ModelSpec) -> dict[str, int]:
    """The attention head sizes the traffic_model closed forms take as keywords."""
    return dict(num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                dtype_bytes=model.dtype_bytes)


def attention_traffic(step: Step, model: ModelSpec, variant: str, policy) -> Traffic:
    """One layer's attention over host-resident KV, including writing the step's new K/V to the host tier.

    As the GPU executor runs them: a decode's new token is stored to the host tier and ``naive``/``tiled``
    read it back with the rest of the sequence (``fused`` keeps it on chip); a prompt chunk's new K/V are
    stored to the host tier once and attended from the projection's output in HBM by every variant (the
    kernels take them as k_new / v_new), so they cross the link once. Until 2026-12-02 the model read them
    back across the link as the paper's separate kernels would, a chunk's size per layer more than the
    executor's kernels read (their closed forms, the measured rows' link bytes).
    """
    shape = head_shape(model)
    kvl = model.kv_bytes_per_token_per_layer()
    total = Traffic()
    if step.decodes:
        lens = step.decode_kv_lens
        if variant == "fused":
            lens = [n - 1 for n in lens]  # the new token's K/V come from registers, not the link
        dec_variant = "naive" if variant == "naive" else "tiled"  # stream states tiled's closed form
        total = total + tm.decode_traffic(lens, variant=dec_variant, **shape)
        total.link_write_bytes += len(step.decodes) * kvl
    for c in step.prefills:
        if variant == "stream":  # flash passes over ring chunks (callers charge chunks read in place as tiled:
            # systems.stream_parts)
            t = tm.stream_prefill_traffic(c.chunk_len, c.past_len, causal=True, **shape)
        else:
            t = tm.prefill_traffic(c.chunk_len, c.past_len, variant="naive" if variant == "naive" else "tiled",
                                   causal=True, tile_q=policy.tile_q, tile_kv=policy.tile_kv, **shape)
        t.link_write_bytes += c.chunk_len * kvl  # the store; the kernel reads k_new / v_new in HBM
        total = total + t
    return total
