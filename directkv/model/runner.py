"""The decoder stack on one flat token batch, with the KV path supplied by the caller.

Continuous batching: one step's tokens (decode tokens of many requests and prompt chunks) are
concatenated into `tokens` `[n]`. Everything except attention is per token, so the runner never needs to
know which request a token belongs to; the caller's `attend` does (it stores the new K/V wherever the
system under test keeps KV and reads the cache back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from directkv.errors import ConfigError, check
from directkv.kernels.cuda.capture import cuda_capture
from directkv.model.graphs import BUCKETS, Capture, GraphSet, SlotBuffers, bucket_for, capture_set
from directkv.model.layers import RopeCache, layer_norm, mlp, rms_norm, rope
from directkv.model.weights import LayerWeights, Weights, check_weights
from directkv.specs.models import ModelSpec

# attend(layer, q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) -> out [n, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# attend_async(layer, rows, q, k, v) -> wait() -> out [len(rows), Hq, D]  (see forward_pipelined)
AsyncAttendFn = Callable[[int, slice, torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]

# OPT's learned position table starts at row 2 (rows 0-1 are a padding artefact kept upstream).
OPT_POSITION_OFFSET = 2


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Token ids `[...]` int64 of the largest logit of `logits` `[..., vocab]`."""
    return logits.argmax(dim=-1)


class ModelRunner:
    """Prefill and decode of `spec` with `weights` (from init_weights).

    Parameters
    ----------
    spec, weights : the model; weights are checked against spec's shapes.
    max_positions : largest position + 1 the runner accepts; sizes the RoPE table (llama). Defaults to
        spec.max_context. OPT is always limited by its position table (spec.max_context rows in use).
    check_ranges : check token ids and positions against the vocab and position limits. Free for CPU
        inputs; for device inputs it costs one device-to-host sync per call, so a caller that builds
        them from its own state may switch it off (an out-of-range index then fails on the device).
    """

    def __init__(self, spec: ModelSpec, weights: Weights, *, max_positions: int | None = None,
                 check_ranges: bool = True):
        check_weights(weights, spec)
        limit = spec.max_context
        if max_positions is not None:
            check(isinstance(max_positions, int) and 1 <= max_positions <= limit,
                  f"max_positions must be an int in [1, {limit}] for {spec.name!r}; got {max_positions!r}")
            limit = max_positions
        self.spec, self.weights, self.max_positions = spec, weights, limit
        self.device, self.dtype = weights.device, weights.dtype
        self.check_ranges = check_ranges
        self.rope = (RopeCache(spec.head_dim, spec.rope_theta, limit, self.device)
                     if spec.family == "llama" else None)
        self.graphs_enabled = False  # see enable_graphs
        self._graph_sets: dict[tuple[int, int], GraphSet] = {}  # (bucket, slot) -> captured set
        self._slot_buffers: dict[int, SlotBuffers] = {}  # slot -> the static tensors its sets share
        self._slot_pools: dict[tuple[int, Capture], object] = {}  # (slot, capture) -> the memory pool its sets share

    # ---- CUDA graphs of the dense layer parts (directkv/model/graphs.py) ---------------------------
    def enable_graphs(self, buckets: Sequence[int] = BUCKETS, *, slots: int = 1, capture: Capture | None = None) -> None:
        """Capture the per-layer graphs for steps of up to max(buckets) tokens (idempotent: sets captured
        before are kept) and use them from now on; slots=2 also captures the second half of pipelined steps.
        capture defaults to CUDA graphs and needs the weights on a CUDA device (tests pass eager_capture)."""
        check(all(isinstance(b, int) and b >= 1 for b in buckets) and len(buckets) > 0,
              f"graph buckets must be positive ints; got {list(buckets)!r}")
        check(slots in (1, 2), f"graph slots must be 1 or 2; got {slots!r}")
        if capture is None:
            if self.device.type != "cuda":
                raise ConfigError(f"CUDA graphs need the model on a CUDA device; it is on {self.device}")
            capture = cuda_capture
        spec = self.spec
        top = max(buckets)
        with torch.no_grad():
            for slot in range(slots):
                todo = [b for b in sorted(set(buckets)) if (b, slot) not in self._graph_sets]
                if not todo:
                    continue
                if slot not in self._slot_buffers or self._slot_buffers[slot].rows < top:
                    # a later, larger bucket gets buffers of its own; the sets captured before keep theirs
                    self._slot_buffers[slot] = SlotBuffers.make(
                        top, hidden=spec.hidden_size, q_shape=(spec.num_heads, spec.head_dim),
                        kv_shape=(spec.num_kv_heads, spec.head_dim),
                        rope_half=spec.head_dim // 2 if self.rope is not None else None,
                        num_layers=spec.num_layers, dtype=self.dtype, device=self.device)
                # one pool per slot and capture kind: a CPU stand-in's token must not stand for a CUDA pool later
                if (slot, capture) not in self._slot_pools:
                    self._slot_pools[(slot, capture)] = (torch.cuda.graph_pool_handle() if capture is cuda_capture
                                                         else object())
                pool = self._slot_pools[(slot, capture)]
                for size in todo:
                    self._graph_sets[(size, slot)] = capture_set(
                        size, self._slot_buffers[slot],
                        pre=lambda i, x, rot, out: self._pre(self.weights.layers[i], x, rot, out),
                        post=lambda i, x, attn, out: self._post(i, self.weights.layers[i], x, attn, dest=out),
                        capture=capture, pool=pool)
        self.graphs_enabled = True

    def disable_graphs(self) -> None:
        """Run every step eagerly from now on; captured sets are kept for a later enable_graphs."""
        self.graphs_enabled = False

    def _graph_set(self, n: int, slot: int = 0) -> GraphSet | None:
        if not self.graphs_enabled:
            return None
        size = bucket_for(n, [b for b, s in self._graph_sets if s == slot])
        return None if size is None else self._graph_sets[(size, slot)]

    # ---- public entry points -------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """One prompt (or prompt chunk) of one request.

        tokens, positions : `[n]` int64. Returns float32 logits `[vocab]` of the last token.
        """
        check(isinstance(tokens, torch.Tensor) and tokens.dim() == 1 and tokens.numel() >= 1,
              f"prefill tokens must be a [n] tensor with n >= 1; got {getattr(tokens, 'shape', tokens)!r}")
        last = torch.tensor([tokens.numel() - 1], dtype=torch.int64)
        return self.forward(tokens, positions, attend, last)[0]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """One new token for each of `batch` requests.

        tokens, positions : `[batch]` int64. Returns float32 logits `[batch, vocab]`.
        """
        check(isinstance(tokens, torch.Tensor) and tokens.dim() == 1,
              f"decode tokens must be a [batch] tensor; got {getattr(tokens, 'shape', tokens)!r}")
        return self.forward(tokens, positions, attend, torch.arange(tokens.numel(), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """Run the layer stack on a flat token batch.

        Parameters
        ----------
        tokens : `[n]` int64 token ids of one step, requests concatenated.
        positions : `[n]` int64 absolute position of each token in its own sequence.
        attend : called once per layer as `attend(layer, q, k, v)` with q `[n, Hq, D]`, k and v
            `[n, Hkv, D]` (contiguous, model dtype, RoPE already applied to q and k for llama); must
            store k/v and return the causal attention output `[n, Hq, D]` of every token.
        logits_rows : `[r]` int64 indices into the batch (typically each sequence's last token).

        Returns
        -------
        float32 logits `[r, vocab]` for the selected rows only.
        """
        tokens, positions, logits_rows = self._inputs(tokens, positions, logits_rows)
        spec, w = self.spec, self.weights
        n = tokens.numel()
        # no_grad rather than inference_mode: tensors handed to `attend` may be kept by the caller and
        # updated in place later, which inference tensors forbid outside inference mode.
        with torch.no_grad():
            x = w.embed[tokens]  # [n, hidden]
            if spec.family == "opt":
                x = x + w.pos_embed[positions + OPT_POSITION_OFFSET]
            rot = self.rope.lookup(positions) if self.rope is not None else None
            gs = self._graph_set(n)
            if gs is not None:
                gs.load(x, rot)
                for index in range(spec.num_layers):
                    q, k, v = self._graph_pre(gs, index, n)
                    x = self._graph_post(gs, index, n, attend(index, q, k, v))
            else:
                for index, layer in enumerate(w.layers):
                    x = self._layer(index, layer, x, rot, attend)
            x = self._norm(x[logits_rows], w.final_norm, w.final_norm_bias)
            return (x @ w.lm_head).float()

    def forward_pipelined(self, tokens: torch.Tensor, positions: torch.Tensor, attend_async: AsyncAttendFn,
                          logits_rows: torch.Tensor, split: int) -> torch.Tensor:
        """forward() for a step's rows cut into parts A = rows [0, split) and B = the rest,
        software-pipelined so the attention of one part (e.g. on the CPU) overlaps the other part's
        linear layers on the GPU (Neo's asymmetric pipeline).

        attend_async(layer, rows, q, k, v) starts the attention of `rows` (a slice of the batch) and returns
        a callable that waits for it and gives the output `[len(rows), Hq, D]`. Order per layer L: finish
        A(L - 1) and start A(L), then finish B(L - 1) and start B(L): while the attention of one part runs,
        the other part's projections and MLP are issued. The parts must not attend to each other (decode
        rows, or decodes | prompt chunks: no part sees the other's K/V within a step); each part may run as
        CUDA graphs or eagerly, by its size. Same result as forward().
        """
        tokens, positions, logits_rows = self._inputs(tokens, positions, logits_rows)
        n = tokens.numel()
        check(isinstance(split, int) and 0 < split < n, f"split must cut the {n} rows into two parts; got {split!r}")
        spec, w = self.spec, self.weights
        parts = (slice(0, split), slice(split, n))
        with torch.no_grad():
            x = w.embed[tokens]
            if spec.family == "opt":
                x = x + w.pos_embed[positions + OPT_POSITION_OFFSET]
            rot = self.rope.lookup(positions) if self.rope is not None else None
            xs = [x[r] for r in parts]
            rots = [None if rot is None else (rot[0][r], rot[1][r]) for r in parts]
            sizes = [split, n - split]
            sets = [self._graph_set(sizes[p], p) for p in range(2)]  # a part too large for any graph runs eager
            for p in range(2):
                if sets[p] is not None:
                    sets[p].load(xs[p], rots[p])
            wait: list = [None, None]

            def post(p: int, index: int) -> torch.Tensor:  # this part's layer `index`, its attention done
                if sets[p] is not None:
                    return self._graph_post(sets[p], index, sizes[p], wait[p](), p)
                return self._post(index, w.layers[index], xs[p], wait[p](), p)

            for index, layer in enumerate(w.layers):
                for p, rows in enumerate(parts):
                    if wait[p] is not None:  # this part's previous layer: its attention ran meanwhile
                        xs[p] = post(p, index - 1)
                    if sets[p] is not None:
                        q, k, v = self._graph_pre(sets[p], index, sizes[p])
                    else:
                        q, k, v = self._pre(layer, xs[p], rots[p])
                    wait[p] = attend_async(index, rows, q, k, v)
            for p in range(2):
                xs[p] = post(p, len(w.layers) - 1)
            x = self._norm(torch.cat(xs)[logits_rows], w.final_norm, w.final_norm_bias)
            return (x @ w.lm_head).float()

    # ---- internals -----------------------------------------------------------------------------
    def _layer(self, index: int, layer: LayerWeights, x: torch.Tensor,
               rot: tuple[torch.Tensor, torch.Tensor] | None, attend: AttendFn) -> torch.Tensor:
        q, k, v = self._pre(layer, x, rot)
        return self._post(index, layer, x, attend(index, q, k, v))

    def _pre(self, layer: LayerWeights, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor] | None,
             out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV projection and RoPE: q `[n, Hq, D]`, k, v `[n, Hkv, D]`, contiguous; written into `out` (a
        graph's static outputs) when given."""
        spec = self.spec
        n, d, hq = x.shape[0], spec.head_dim, spec.num_heads
        h = self._norm(x, layer.attn_norm, layer.attn_norm_bias)
        qkv = h @ layer.wqkv if layer.bqkv is None else torch.addmm(layer.bqkv, h, layer.wqkv)
        qk = qkv[:, : spec.q_dim + spec.kv_dim].view(n, hq + spec.num_kv_heads, d)
        if rot is not None:
            qk = rope(qk, *rot)  # q and k in one pass: half the kernels of rotating each
        parts = (qk[:, :hq], qk[:, hq:], qkv[:, spec.q_dim + spec.kv_dim:].view(n, spec.num_kv_heads, d))
        if out is None:
            return tuple(t.contiguous() for t in parts)
        for src, dst in zip(parts, out, strict=True):
            torch.mul(src, 1, out=dst)  # one elementwise kernel, as .contiguous() is; not a cudaMemcpy (_graph_post)
        return out

    def _post(self, index: int, layer: LayerWeights, x: torch.Tensor, out: torch.Tensor, part: int | None = None,
              dest: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection and MLP with residuals, given the attention output `out` `[n, Hq, D]`; the new x
        `[n, hidden]` is written into `dest` (a graph's static output) when given."""
        spec = self.spec
        n = x.shape[0]
        self._check_attention(index, out, n, x.device, part)
        # A kernel may accumulate and return float32; the residual stream stays in the model dtype.
        out = out.to(x.dtype).reshape(n, spec.q_dim)
        x = x + (out @ layer.wo if layer.bo is None else torch.addmm(layer.bo, out, layer.wo))
        h = self._norm(x, layer.mlp_norm, layer.mlp_norm_bias)
        return torch.add(x, mlp(h, layer, spec.family), out=dest)

    def _check_attention(self, index: int, out, n: int, device: torch.device, part: int | None) -> None:
        """`out` must be the attention output `[n, Hq, D]` on `device` (message built only on failure: this
        runs once per layer and step)."""
        want = (n, self.spec.num_heads, self.spec.head_dim)
        if not (isinstance(out, torch.Tensor) and tuple(out.shape) == want and out.device == device):
            where = f"attend(layer={index})" if part is None else f"attend_async(layer={index}, part {part})"
            check(False, f"{where} must return [n, Hq, D] = {list(want)} on {device}; got "
                  + (f"{list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__))

    @staticmethod
    def _graph_pre(gs: GraphSet, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay layer `index`'s pre graph; q, k, v of the step's n rows (views of the static outputs)."""
        gs.pre[index]()
        q, k, v = gs.pre_out[index]
        return q[:n], k[:n], v[:n]

    def _graph_post(self, gs: GraphSet, index: int, n: int, out, part: int | None = None) -> torch.Tensor:
        """Copy the attention output of the n rows in and replay layer `index`'s post graph; the new x of the
        n rows (a view of the static output, read by the next layer's pre graph)."""
        self._check_attention(index, out, n, gs.attn.device, part)
        # An elementwise kernel, not copy_: a contiguous copy_ is a device-to-device cudaMemcpy, which seems to
        # queue behind a side stream's host-to-device copies (ZeroCopyPath's note). H200, 2026-12-01, one call:
        # stream 42.9 vs 43.9 ms per token on ShareGPT at 10 req/s, 15.9 vs 16.2 / 28.5 vs 29.5 at 4 x 1K / 2K.
        # _check_attention above has checked out's shape: mul would resize a mismatched output view, not raise.
        torch.mul(out, 1, out=gs.attn[:n])
        gs.post[index]()
        return gs.post_out[index][:n]

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return rms_norm(x, weight) if bias is None else layer_norm(x, weight, bias)

    def _inputs(self, tokens: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validate shapes/dtypes (and values, see check_ranges); move to the model's device."""
        named = {"tokens": tokens, "positions": positions, "logits_rows": logits_rows}
        for name, t in named.items():
            check(isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int64,
                  f"{name} must be a 1-D int64 tensor; got "
                  + (f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__))
        n = tokens.numel()
        check(n >= 1, "tokens must hold at least one token; got an empty batch")
        check(positions.numel() == n, f"positions must have one entry per token ({n}); got {positions.numel()}")
        check(logits_rows.numel() >= 1, "logits_rows must select at least one row; got none")
        inputs = (tokens, positions, logits_rows)
        if len({t.device for t in inputs}) > 1:
            inputs = tuple(t.to(self.device) for t in inputs)
        if self.check_ranges and inputs[0].device.type != "meta":
            self._check_ranges(*inputs)
        if inputs[0].device.type == "cpu" and self.device.type == "cuda":
            # one host-to-device copy, then views: each small pageable copy costs ~20 us of host time
            return torch.cat(inputs).to(self.device, non_blocking=True).split([t.numel() for t in inputs])
        return tuple(t.to(self.device, non_blocking=True) for t in inputs)

    def _check_ranges(self, tokens: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor) -> None:
        # Checked where the inputs live (free on the CPU); one combined fetch, so one sync on a GPU.
        lo, hi = torch.stack([torch.stack([t.min(), t.max()]) for t in (tokens, positions, logits_rows)]).cpu().unbind(1)
        limits = {"tokens": self.spec.vocab_size, "positions": self.max_positions, "logits_rows": tokens.numel()}
        for (name, limit), low, high in zip(limits.items(), lo.tolist(), hi.tolist(), strict=True):
            check(low >= 0 and high < limit,
                  f"{name} must lie in [0, {limit}) for {self.spec.name!r}; got values in [{low}, {high}]")
