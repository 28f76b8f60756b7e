"""Merge of attention passes in any layout, one CUDA launch (csrc/include/directkv/merge_strided.cuh).

The prefill `stream` variant attends in passes (the new tokens', one per ring chunk, the HBM pages') whose O come
out of torch's flash kernel as permuted views in the query dtype, or in fp32 from the tiled kernel. merge_strided
reads each pass's O once where it lies and writes the merged rows; merge_passes (below), the torch-op
merge it replaces there, costs an fp32 read-modify-write of the whole output per pass (H200, 2026-12-02: at 16K
past and 2,048 new tokens 8 ring chunks were slower than 4, by about what that merge costs per pass).
RunningMerge folds the passes as they come, so a long past's passes are not all alive at once.
"""

from __future__ import annotations

from functools import cache

import torch

from directkv.errors import ConfigError, check
from directkv.kernels.cuda import build
from directkv.kernels.traffic_model import STREAM_HELD_PASSES

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MAX_PARTS = 32  # kMergeMaxParts


@cache
def _module():
    return build.load("merge_strided")  # once: load() takes a lock on every call


def _fits(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> bool:
    """One part's O `[A, B, C, D]` and LSE `[A, B, C]` as the kernel reads them: O of a float dtype with a unit
    last stride, its other strides multiples of 4 and its start on a 4-element boundary; LSE fp32; both on out's
    device."""
    return (o.dim() == 4 and o.shape == out.shape and lse.shape == out.shape[:-1] and o.dtype in DTYPE_CODES
            and lse.dtype == torch.float32 and o.stride(-1) == 1 and all(s % 4 == 0 for s in o.stride()[:3])
            and o.data_ptr() % (4 * o.element_size()) == 0 and o.device == lse.device == out.device)


def accepts(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> bool:
    """Whether merge_strided takes these passes and output (see merge_strided); callers with another merge
    for the rest ask first."""
    return (1 <= len(parts) <= MAX_PARTS and out.dim() == 4 and out.is_cuda and out.is_contiguous()
            and out.dtype in DTYPE_CODES and out.shape[-1] % 4 == 0 and all(_fits(o, lse, out) for o, lse in parts))


def merge_strided(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """out = sum over passes p of softmax_p(lse_p) * o_p, queued on the current stream; returns out.

    parts : 1 to MAX_PARTS pairs (O `[A, B, C, D]`, LSE `[A, B, C]`), any strides (O's last one 1, the others
        multiples of 4 elements, its start 4-element aligned), O fp16 / bf16 / fp32 (passes may differ), LSE fp32
        natural-log; -inf where a pass saw no key of a row (that pass's O is then not read; a row no pass saw
        gets zeros).
    out : `[A, B, C, D]` contiguous CUDA, fp16 / bf16 / fp32, D a multiple of 4.
    """
    # checked in one expression, the message built only on failure: this runs once per layer in serving
    if not accepts(parts, out):
        raise ConfigError(
            f"merge_strided wants 1 to {MAX_PARTS} passes (O [A, B, C, D] fp16 / bf16 / fp32 with a unit last "
            f"stride, other strides multiples of 4, start on a 4-element boundary; LSE [A, B, C] fp32) on out's "
            f"device, and out [A, B, C, D] contiguous CUDA with D a multiple of 4; got out {tuple(out.shape)} "
            f"{out.dtype} {out.device} contiguous={out.is_contiguous()} and {len(parts)} passes: "
            + "; ".join(f"O {tuple(o.shape)} {o.dtype} strides {o.stride()} at {o.data_ptr()}, LSE "
                        f"{tuple(lse.shape)} {lse.dtype}" for o, lse in parts[:4])
            + ("; ..." if len(parts) > 4 else ""))
    run(parts, out)
    return out


def run(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
    """merge_strided without its check, for a caller that asked accepts() first (once per layer in serving)."""
    a, b, c, d = out.shape
    _module().run(
        [o.data_ptr() for o, _ in parts], [lse.data_ptr() for _, lse in parts],
        [s for o, _ in parts for s in o.stride()[:3]], [s for _, lse in parts for s in lse.stride()],
        [DTYPE_CODES[o.dtype] for o, _ in parts], out.data_ptr(), a, b, c, d, DTYPE_CODES[out.dtype],
        torch.cuda.current_stream(out.device).cuda_stream)


def merge_passes(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
    """out = the softmax-over-LSE weighted sum of the stream passes' outputs (decode and prefill).

    parts: (O, natural-log LSE) per pass; every O has out's shape (or one it views as), every LSE that shape
    without the last dim; any strides and float dtypes, so a pass can hand over a permuted view instead of a
    copy. One fp32 accumulator, updated per pass: each pass's O is read once. The CUDA kernels merge_stacked and
    merge_strided do the same in one launch; this is the torch-op merge for passes they do not take.
    """
    # The merge kernels' rules (merge4 in merge_stacked.cuh): a row with no key in any pass (a sequence of length 0)
    # has only -inf LSEs and gets zeros; a pass of -inf LSE weighs 0 and its O (maybe never written) is not used;
    # a NaN LSE (a broken pass) makes its row NaN.
    lse = torch.stack([lse for _, lse in parts])
    weights = torch.softmax(lse, dim=0).masked_fill((lse == float("-inf")).all(0), 0.0).unsqueeze(-1)
    acc = torch.zeros(parts[0][0].shape, dtype=torch.float32, device=weights.device)
    for (o, _), w in zip(parts, weights, strict=True):
        acc += torch.where(w != 0, o * w, 0.0)  # w NaN: NaN; w 0: 0 whatever O holds
    out.view(acc.shape).copy_(acc)


def merge_any(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, kernel: bool = True) -> None:
    """out (contiguous `[A, B, C, D]`) = the passes merged: by merge_strided where `kernel` and it takes them,
    else by merge_passes. Either reads each element of every pass before it writes that element of out, so out
    may be one of the passes' O where that O has out's own layout (RunningMerge's running pass); an O laid out
    otherwise over out's memory would be read after other threads wrote it."""
    if kernel and accepts(parts, out):
        run(parts, out)
    else:
        merge_passes(parts, out)


class RunningMerge:
    """Passes (O `[A, B, C, D]`, LSE `[A, B, C]`) merged as they come: at most `held` of them are held (and the
    one being added, and the fp32 running pass, twice a half-precision one).

    A pass added to `held` held ones first folds those into one: O merged into an fp32 buffer kept for the call
    (merge_any, which may write over its own input, so the running pass is one of the folded ones), LSE their
    logsumexp. That pass stands for them exactly in a later merge: its weight exp(LSE - total) times its O is the
    sum of theirs. A row no pass saw keeps a -inf LSE and zeros. Each fold but the first reads the running O once
    more and every fold writes it (traffic_model.fold_count). `parts` holds what the final merge takes.
    """

    def __init__(self, held: int = STREAM_HELD_PASSES, kernel: bool = True):
        check(isinstance(held, int) and 2 <= held <= MAX_PARTS, f"RunningMerge holds 2..{MAX_PARTS} passes (the "
              f"kernel merges at most {MAX_PARTS}); got held={held!r}")
        self.held, self.kernel = held, kernel
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._running: torch.Tensor | None = None

    def add(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        if len(self.parts) == self.held:
            self._fold()
        self.parts.append((o, lse))

    def _fold(self) -> None:
        o0 = self.parts[0][0]
        if self._running is None:
            self._running = torch.empty(o0.shape, dtype=torch.float32, device=o0.device)
        lse = torch.logsumexp(torch.stack([lse for _, lse in self.parts]), dim=0)  # -inf where every pass is -inf
        merge_any(self.parts, self._running, self.kernel)
        self.parts = [(self._running, lse)]
