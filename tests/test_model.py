"""Model runner on CPU in float32 ('tiny' and a tiny OPT): weight bytes, a float64 per-token reference,
chunked prefill, decode-after-prefill consistency, OPT's position offset, input validation."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.reference.rope import apply_rope
from directkv.model import ModelRunner, init_weights, sample_greedy, weight_bytes, weight_params
from directkv.model.layers import RopeCache
from directkv.specs.models import MODELS, ModelSpec, get_model

TINY_OPT = ModelSpec("opt-tiny", "opt", 2, 256, 8, 8, 32, 512, 1024, 64)
SPECS = {"tiny": get_model("tiny"), "opt-tiny": TINY_OPT}
EPS = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def make_weights(spec: ModelSpec, seed: int = 0):
    """float32 weights whose norm scales are not 1, so that a norm applied without its weight shows."""
    w = init_weights(spec, device="cpu", dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    norms = [w.final_norm] + [t for layer in w.layers for t in (layer.attn_norm, layer.mlp_norm)]
    for t in norms:
        t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
    return w


class ContiguousKV:
    """Test KV store: one contiguous K/V tensor per (layer, request); causal attention in float64.

    Before each forward the caller names the request of every token (`owners`, tokens of one request in
    position order)."""

    def __init__(self) -> None:
        self.k: dict[tuple[int, int], torch.Tensor] = defaultdict(lambda: torch.empty(0))
        self.v: dict[tuple[int, int], torch.Tensor] = defaultdict(lambda: torch.empty(0))
        self.owners: list[int] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for req in dict.fromkeys(self.owners):
            rows = [i for i, o in enumerate(self.owners) if o == req]
            past = self.k[layer, req].shape[0]
            keys = torch.cat([self.k[layer, req], k[rows].double()]) if past else k[rows].double()
            vals = torch.cat([self.v[layer, req], v[rows].double()]) if past else v[rows].double()
            self.k[layer, req], self.v[layer, req] = keys, vals
            keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
            for j, row in enumerate(rows):
                n = past + j + 1  # causal: this token sees its own prefix only
                scores = torch.einsum("hd,lhd->hl", q[row].double(), keys[:n]) / math.sqrt(q.shape[-1])
                out[row] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), vals[:n]).to(q.dtype)
        return out


def reference_logits(spec: ModelSpec, w, seq: list[int]) -> torch.Tensor:
    """Logits `[len(seq), vocab]` of one sequence, token by token, head by head, float64, no batching."""
    d, group = spec.head_dim, spec.gqa_ratio
    W = lambda t: None if t is None else t.double()  # noqa: E731

    def norm(x, weight, bias):
        if bias is None:
            return x / torch.sqrt((x * x).mean() + EPS) * W(weight)
        return (x - x.mean()) / torch.sqrt(((x - x.mean()) ** 2).mean() + EPS) * W(weight) + W(bias)

    def rope(vec, pos):  # vec [D]: element i pairs with i + D/2
        out = vec.clone()
        for i in range(d // 2):
            a = pos * spec.rope_theta ** (-2 * i / d)
            x1, x2 = vec[i].item(), vec[i + d // 2].item()
            out[i], out[i + d // 2] = x1 * math.cos(a) - x2 * math.sin(a), x2 * math.cos(a) + x1 * math.sin(a)
        return out

    keys, vals, logits = [[] for _ in w.layers], [[] for _ in w.layers], []
    for pos, tok in enumerate(seq):
        x = W(w.embed)[tok]
        if spec.family == "opt":
            x = x + W(w.pos_embed)[pos + 2]
        for li, L in enumerate(w.layers):
            h = norm(x, L.attn_norm, L.attn_norm_bias)
            qkv = h @ W(L.wqkv) + (0 if L.bqkv is None else W(L.bqkv))
            q = qkv[: spec.q_dim].view(spec.num_heads, d)
            k = qkv[spec.q_dim: spec.q_dim + spec.kv_dim].view(spec.num_kv_heads, d)
            v = qkv[spec.q_dim + spec.kv_dim:].view(spec.num_kv_heads, d)
            if spec.family == "llama":
                q = torch.stack([rope(q[i], pos) for i in range(spec.num_heads)])
                k = torch.stack([rope(k[i], pos) for i in range(spec.num_kv_heads)])
            keys[li].append(k), vals[li].append(v)
            heads = []
            for hq in range(spec.num_heads):
                s = torch.tensor([q[hq] @ kk[hq // group] / math.sqrt(d) for kk in keys[li]], dtype=torch.float64)
                p = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
                heads.append(sum(p[j] * vals[li][j][hq // group] for j in range(len(p))))
            x = x + torch.cat(heads) @ W(L.wo) + (0 if L.bo is None else W(L.bo))
            h = norm(x, L.mlp_norm, L.mlp_norm_bias)
            if spec.family == "llama":
                f = spec.intermediate_size
                up = h @ W(L.w_up)
                x = x + (up[:f] / (1 + torch.exp(-up[:f])) * up[f:]) @ W(L.w_down)
            else:
                x = x + torch.clamp(h @ W(L.w_up) + W(L.b_up), min=0) @ W(L.w_down) + W(L.b_down)
        head = W(w.embed).T if spec.family == "opt" else W(w.lm_head)  # OPT ties the head to the embedding
        logits.append(norm(x, w.final_norm, w.final_norm_bias) @ head)
    return torch.stack(logits)


# ---- (a) weights ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [*MODELS.values(), TINY_OPT], ids=lambda s: s.name)
def test_weight_bytes_match_spec(spec):
    w = init_weights(spec, device="meta", dtype=torch.bfloat16)
    assert weight_bytes(w) == spec.weight_bytes()
    assert weight_params(w) == spec.weight_params()


@pytest.mark.parametrize("name", SPECS)
def test_weights_values_tying_and_seed(name):
    spec = SPECS[name]
    w = init_weights(spec, device="cpu", dtype=torch.float32, seed=3)
    assert weight_bytes(w) == 2 * spec.weight_bytes()  # float32 is twice the spec's bf16 bytes
    assert 0.018 < w.layers[0].wqkv.std().item() < 0.022
    assert torch.equal(w.layers[1].attn_norm, torch.ones(spec.hidden_size))
    assert torch.equal(w.embed, init_weights(spec, device="cpu", dtype=torch.float32, seed=3).embed)
    assert not torch.equal(w.embed, init_weights(spec, device="cpu", dtype=torch.float32, seed=4).embed)
    if spec.family == "opt":
        assert w.lm_head.data_ptr() == w.embed.data_ptr() and w.lm_head.shape == (spec.hidden_size, spec.vocab_size)
        assert w.pos_embed.shape == (spec.max_context + 2, spec.hidden_size)
        assert w.layers[0].bqkv.abs().sum() > 0
    else:
        assert w.lm_head.data_ptr() != w.embed.data_ptr() and w.pos_embed is None


def test_rope_matches_reference_kernel_rope():
    theta, pos0 = 500000.0, 1000
    x = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(0))
    cache = RopeCache(64, theta, 2048, torch.device("cpu"))
    got = cache.apply(x, torch.arange(pos0, pos0 + 7))
    assert rel_err(got, apply_rope(x, pos0, theta)) < 1e-6
    assert rel_err(got, x) > 0.1


# ---- (b) batched forward == per-token float64 reference -------------------------------------------
@pytest.mark.parametrize("name", SPECS)
def test_batched_forward_matches_per_token_reference(name):
    spec, w = SPECS[name], make_weights(SPECS[name])
    runner, gen = ModelRunner(spec, w), torch.Generator().manual_seed(1)
    seq_a = torch.randint(0, spec.vocab_size, (6,), generator=gen).tolist()
    seq_b = torch.randint(0, spec.vocab_size, (5,), generator=gen).tolist()
    kv = ContiguousKV()
    # Step 1: both prompts' first chunks (A 0..4, B 0..2). Step 2, order swapped: B's chunk 3..4 and A's
    # decode token 5, as a continuous-batching step mixes them.
    kv.owners = [0] * 5 + [1] * 3
    step1 = runner.forward(torch.tensor(seq_a[:5] + seq_b[:3]), torch.tensor([*range(5), *range(3)]), kv,
                           torch.tensor([4, 7, 2]))
    kv.owners = [1, 1, 0]
    step2 = runner.forward(torch.tensor(seq_b[3:5] + seq_a[5:6]), torch.tensor([3, 4, 5]), kv, torch.tensor([1, 2]))
    ref_a, ref_b = reference_logits(spec, w, seq_a), reference_logits(spec, w, seq_b)
    assert step1.dtype == torch.float32 and step1.shape == (3, spec.vocab_size)
    want = torch.stack([ref_a[4], ref_b[2], ref_a[2], ref_b[4], ref_a[5]])
    assert rel_err(torch.cat([step1, step2]), want) < 1e-4
    # The attention path matters: a different history changes the logits well beyond that tolerance.
    assert rel_err(ref_a[4], reference_logits(spec, w, seq_b[:4] + seq_a[4:5])[4]) > 1e-2


# ---- (c) chunked prefill, (d) decode after prefill ------------------------------------------------
def run_prefill(runner, kv, req, tokens, start):
    kv.owners = [req] * len(tokens)
    return runner.prefill(torch.tensor(tokens), torch.arange(start, start + len(tokens)), kv)


@pytest.mark.parametrize("name", SPECS)
def test_chunked_prefill_equals_one_chunk(name):
    spec = SPECS[name]
    runner = ModelRunner(spec, make_weights(spec))
    prompt = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = run_prefill(runner, ContiguousKV(), 0, prompt, 0)
    kv = ContiguousKV()
    run_prefill(runner, kv, 0, prompt[:4], 0)
    chunked = run_prefill(runner, kv, 0, prompt[4:], 4)
    assert whole.shape == (spec.vocab_size,) and whole.dtype == torch.float32
    assert rel_err(chunked, whole) < 1e-5


@pytest.mark.parametrize("name", SPECS)
def test_decode_after_prefill_equals_longer_prefill(name):
    spec, gen = SPECS[name], torch.Generator().manual_seed(3)
    runner = ModelRunner(spec, make_weights(spec))
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (7, 4)]
    kv = ContiguousKV()
    firsts = [sample_greedy(run_prefill(runner, kv, req, p, 0)).item() for req, p in enumerate(prompts)]
    kv.owners = [0, 1]
    decoded = runner.decode(torch.tensor(firsts), torch.tensor([len(p) for p in prompts]), kv)
    assert decoded.shape == (2, spec.vocab_size)
    for req, (p, first) in enumerate(zip(prompts, firsts, strict=True)):
        assert rel_err(decoded[req], run_prefill(runner, ContiguousKV(), 0, p + [first], 0)) < 1e-5


def test_sample_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample_greedy(logits).tolist() == [1, 0]
    assert sample_greedy(logits[1]).item() == 0


# ---- (e) OPT position offset ----------------------------------------------------------------------
def test_opt_reads_position_rows_with_offset_two():
    spec, w = TINY_OPT, make_weights(TINY_OPT)
    runner = ModelRunner(spec, w)

    def single_token_logits(pos):
        return run_prefill(runner, ContiguousKV(), 0, [5], pos)

    for pos in (0, 17, spec.max_context - 1):
        clean = single_token_logits(pos)
        w.pos_embed[pos + 1] = float("nan")  # the row an offset of 1 (or 0 for pos 1) would read
        assert torch.equal(single_token_logits(pos), clean)
        saved = w.pos_embed[pos + 2].clone()
        w.pos_embed[pos + 2] = float("nan")
        assert single_token_logits(pos).isnan().all()
        w.pos_embed[pos + 2] = saved
    w.pos_embed[0] = float("nan")  # rows 0 and 1 are never read
    assert torch.isfinite(run_prefill(runner, ContiguousKV(), 0, [1, 2, 3], 0)).all()
    with pytest.raises(ConfigError, match=r"positions must lie in \[0, 64\)"):
        single_token_logits(spec.max_context)


# ---- shapes at real model sizes (meta device) ------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-3.1-8b", "opt-13b"])
def test_real_shapes_on_meta(name):
    spec = get_model(name)
    runner = ModelRunner(spec, init_weights(spec, device="meta"))
    seen = []

    def attend(layer, q, k, v):
        seen.append((layer, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype))
        return torch.empty_like(q)

    logits = runner.forward(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([100, 0, 1, 2, 7]), attend,
                            torch.tensor([0, 3, 4]))
    assert logits.shape == (3, spec.vocab_size) and logits.dtype == torch.float32
    d = spec.head_dim
    assert seen == [(i, (5, spec.num_heads, d), (5, spec.num_kv_heads, d), (5, spec.num_kv_heads, d),
                     torch.bfloat16) for i in range(spec.num_layers)]


# ---- (f) validation ------------------------------------------------------------------------------
def test_bad_inputs_raise_config_error():
    spec = SPECS["tiny"]
    runner = ModelRunner(spec, init_weights(spec, device="cpu", dtype=torch.float32), max_positions=16)
    kv = ContiguousKV()
    kv.owners = [0, 0]
    ok_t, ok_p, ok_r = torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([1])
    cases = [
        ((torch.tensor([[1, 2]]), ok_p, ok_r), r"tokens must be a 1-D int64 tensor; got shape \(1, 2\)"),
        ((ok_t.float(), ok_p, ok_r), r"tokens must be a 1-D int64 tensor; got shape \(2,\) torch.float32"),
        ((ok_t, [0, 1], ok_r), "positions must be a 1-D int64 tensor; got list"),
        ((ok_t, torch.tensor([0, 1, 2]), ok_r), r"one entry per token \(2\); got 3"),
        ((torch.tensor([1, 1024]), ok_p, ok_r), r"tokens must lie in \[0, 1024\) .* got values in \[1, 1024\]"),
        ((ok_t, torch.tensor([-1, 0]), ok_r), r"positions must lie in \[0, 16\)"),
        ((ok_t, torch.tensor([15, 16]), ok_r), r"positions must lie in \[0, 16\)"),
        ((ok_t, ok_p, torch.tensor([2])), r"logits_rows must lie in \[0, 2\)"),
        ((ok_t, ok_p, torch.tensor([], dtype=torch.int64)), "logits_rows must select at least one row"),
        ((torch.tensor([], dtype=torch.int64),) * 2 + (ok_r,), "at least one token"),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError, match=message):
            runner.forward(args[0], args[1], kv, args[2])
    with pytest.raises(ConfigError, match=r"attend\(layer=0\) must return \[n, Hq, D\] = \[2, 8, 32\]"):
        runner.forward(ok_t, ok_p, lambda layer, q, k, v: q[:, :2], ok_r)
    with pytest.raises(ConfigError, match="prefill tokens must be a"):
        runner.prefill(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), kv)
    with pytest.raises(ConfigError, match=r"decode tokens must be a \[batch\] tensor; got \[1, 2\]"):
        runner.decode([1, 2], ok_p, kv)


def test_bad_weights_or_limits_raise_config_error():
    spec = SPECS["tiny"]
    w = init_weights(spec, device="meta", dtype=torch.float32)
    with pytest.raises(ConfigError, match="made for model 'tiny', not 'opt-tiny'"):
        ModelRunner(TINY_OPT, w)
    with pytest.raises(ConfigError, match=r"max_positions must be an int in \[1, 8192\]"):
        ModelRunner(spec, w, max_positions=8193)
    bad_layer = dataclasses.replace(w.layers[1], wo=torch.empty(8, 8, device="meta"))
    with pytest.raises(ConfigError, match=r"layers\[1\]\.wo: shape \(8, 8\)"):
        ModelRunner(spec, dataclasses.replace(w, layers=(w.layers[0], bad_layer)))
    mixed = dataclasses.replace(w, final_norm=torch.ones(spec.hidden_size, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ConfigError, match=r"model\.final_norm: .*torch.bfloat16"):
        ModelRunner(spec, mixed)
    with pytest.raises(ConfigError, match="floating type"):
        init_weights(spec, device="meta", dtype=torch.int32)


@pytest.mark.parametrize("name", list(SPECS))
def test_pipelined_forward_matches_forward(name):
    """Two parts, attention started per part and waited for later: the same logits as one pass."""
    spec = SPECS[name]
    runner = ModelRunner(spec, make_weights(spec))
    tokens = torch.tensor([3, 17, 5, 9, 11], dtype=torch.int64)
    positions = torch.tensor([4, 0, 7, 2, 30], dtype=torch.int64)
    rows = torch.arange(5)
    group = spec.num_heads // spec.num_kv_heads

    def attend(layer, q, k, v):  # a stand-in that mixes q, k and v row by row, so every input matters
        return q + k.repeat_interleave(group, dim=1) * v.repeat_interleave(group, dim=1)

    calls = []

    def attend_async(layer, part, q, k, v):
        calls.append((layer, part.start))
        out = attend(layer, q, k, v)
        return lambda: out

    want = runner.forward(tokens, positions, attend, rows)
    got = runner.forward_pipelined(tokens, positions, attend_async, rows, split=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [(layer, start) for layer in range(spec.num_layers) for start in (0, 2)]
    with pytest.raises(ConfigError, match="split must cut the 5 rows into two parts; got 5"):
        runner.forward_pipelined(tokens, positions, attend_async, rows, split=5)


def _row_mixing_attend(spec):
    group = spec.num_heads // spec.num_kv_heads

    def attend(layer, q, k, v):  # mixes q, k and v row by row, so every input matters
        return q + k.repeat_interleave(group, dim=1) * v.repeat_interleave(group, dim=1)

    return attend


@pytest.mark.parametrize("name", list(SPECS))
def test_graphed_forward_matches_eager(name):
    """The graph plumbing (static inputs, per-layer static outputs, padding to the bucket, refresh on every
    step) with the CPU stand-in for CUDA graphs: steps of several sizes, in and beyond the buckets, give the
    eager logits; the graphed steps hand the attention views of the step's rows only."""
    from directkv.model.graphs import eager_capture

    spec = SPECS[name]
    w = make_weights(spec)
    eager, graphed = ModelRunner(spec, w), ModelRunner(spec, w)
    replays = []

    def counting_capture(fn, pool):
        replay, outputs = eager_capture(fn, pool)
        return lambda: (replays.append(1), replay()), outputs

    graphed.enable_graphs((2, 4, 8), slots=2, capture=counting_capture)
    assert sorted(graphed._graph_sets) == [(2, 0), (2, 1), (4, 0), (4, 1), (8, 0), (8, 1)]
    attend = _row_mixing_attend(spec)
    seen = []

    def recording(layer, q, k, v):
        seen.append(q.shape[0])
        return attend(layer, q, k, v)

    gen = torch.Generator().manual_seed(5)
    for n in (3, 1, 8, 5, 11, 3):  # 11 > 8: eager
        tokens = torch.randint(0, spec.vocab_size, (n,), generator=gen)
        positions = torch.randint(0, 40, (n,), generator=gen)
        rows = torch.arange(n)
        seen.clear()
        replays.clear()
        want = eager.forward(tokens, positions, attend, rows)
        got = graphed.forward(tokens, positions, recording, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert seen == [n] * spec.num_layers
        assert len(replays) == (2 * spec.num_layers if n <= 8 else 0)
    graphed.disable_graphs()  # switched off: eager again, same logits
    torch.testing.assert_close(graphed.forward(tokens, positions, attend, rows), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SPECS))
def test_graphed_pipelined_forward_matches_eager(name):
    """Both halves of a pipelined step in flight at once, each with its own graph set (slot)."""
    from directkv.model.graphs import eager_capture

    spec = SPECS[name]
    w = make_weights(spec)
    eager, graphed = ModelRunner(spec, w), ModelRunner(spec, w)
    graphed.enable_graphs((4,), slots=2, capture=eager_capture)
    attend = _row_mixing_attend(spec)

    def attend_async(layer, part, q, k, v):
        return lambda: attend(layer, q, k, v).clone()  # read at the wait, after the other part's replays

    tokens = torch.tensor([3, 17, 5, 9, 11], dtype=torch.int64)
    positions = torch.tensor([4, 0, 7, 2, 30], dtype=torch.int64)
    rows = torch.arange(5)
    want = eager.forward(tokens, positions, attend, rows)
    got = graphed.forward_pipelined(tokens, positions, attend_async, rows, split=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_graphs_need_a_cuda_device_and_valid_buckets():
    spec = SPECS["tiny"]
    runner = ModelRunner(spec, make_weights(spec))
    with pytest.raises(ConfigError, match="CUDA graphs need the model on a CUDA device; it is on cpu"):
        runner.enable_graphs()
    with pytest.raises(ConfigError, match=r"graph buckets must be positive ints; got \[0\]"):
        runner.enable_graphs([0])
    with pytest.raises(ConfigError, match="graph slots must be 1 or 2; got 3"):
        runner.enable_graphs(slots=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(SPECS))
def test_cuda_graphs_match_eager_on_the_gpu(name):
    """Real CUDA graph capture (bf16 weights on the GPU): graphed steps of several sizes, including padded
    ones and one beyond the buckets, and a pipelined step, against the eager runner on the same weights.
    Padding changes the GEMM shapes, so the comparison allows bf16 rounding."""
    spec = SPECS[name]
    w = init_weights(spec, device="cuda", dtype=torch.bfloat16, seed=3)
    eager, graphed = ModelRunner(spec, w), ModelRunner(spec, w)
    graphed.enable_graphs((1, 4, 8), slots=2)
    attend = _row_mixing_attend(spec)
    gen = torch.Generator().manual_seed(9)
    for n in (3, 1, 8, 5, 13):
        tokens = torch.randint(0, spec.vocab_size, (n,), generator=gen).cuda()
        positions = torch.randint(0, 40, (n,), generator=gen).cuda()
        rows = torch.arange(n, device="cuda")
        torch.testing.assert_close(graphed.forward(tokens, positions, attend, rows),
                                   eager.forward(tokens, positions, attend, rows), rtol=2e-2, atol=2e-2)

    def attend_async(layer, part, q, k, v):
        out = attend(layer, q, k, v).clone()
        return lambda: out

    torch.testing.assert_close(graphed.forward_pipelined(tokens, positions, attend_async, rows, split=6),
                               eager.forward(tokens, positions, attend, rows), rtol=2e-2, atol=2e-2)
