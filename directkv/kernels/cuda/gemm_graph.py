"""The GEMM case study's calls captured once into a CUDA graph and replayed (capture_gemm).

The stream variant issues, per panel, a copy on a side stream, two event records, two waits and a cuBLAS
call, all from Python: ~30-40 us of host work per panel. At 4096^3 a panel's copy takes ~76 us and its
product ~23 us, so the host's pace, not the link, sets the call's time once panels get narrow (measured on
the H200, 2026-11-29: 16 panels 1.09 ms, 32 panels 2.02 ms, against a 0.61 ms link floor). A graph replays the
same copies, events and products with one launch. Measured on the H200 (2026-12-02, two runs,
results/h200/README.md): 16 panels of B stored in panel order 0.670-0.672 ms at 4096^3 and 4.04-4.07 ms at
10240^3, 0.96x and 0.93x the GEMM target (1.15x the link floor), where the same calls issued eagerly took
0.675-0.810 and 4.16-4.22 ms. The graph holds its copy of the call's arguments: it reads
`a` and B from the addresses it was captured with and writes `out`; rewriting their contents between replays is
seen by the next replay (tests/test_cuda_gemm_graph.py), reallocating them is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from directkv.errors import check
from directkv.kernels.cuda.capture import cuda_capture
from directkv.kernels.cuda.gemm_case_study import HostPanels, gemm
from directkv.kernels.traffic import Traffic


@dataclass(frozen=True, eq=False)  # eq would compare the tensors
class GemmGraph:
    """A captured gemm call: calling it replays the graph and returns (out, Traffic) as gemm does."""

    replay: Callable[[], None]
    out: torch.Tensor  # [M, N], written by every replay
    traffic: Traffic

    def __call__(self) -> tuple[torch.Tensor, Traffic]:
        self.replay()
        return self.out, self.traffic


def capture_gemm(a: torch.Tensor, b: torch.Tensor | HostPanels, *, out: torch.Tensor | None = None,
                 **options) -> GemmGraph:
    """Capture gemm(a, b, out=out, **options) into a CUDA graph (after one eager warm-up call, which also
    checks the arguments) and return it; `out` `[M, N]` is allocated here when not given. Every variant
    captures; only stream's many launches per call gain from it."""
    check(a.device.type == "cuda", f"capture_gemm needs a CUDA tensor a; got {a.device}")
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float16, device=a.device)
    with torch.cuda.device(a.device):
        replay, (c, traffic) = cuda_capture(lambda: gemm(a, b, out=out, **options), None)
    check(c.data_ptr() == out.data_ptr(), f"capture_gemm: gemm wrote its product at {c.data_ptr():#x}, not into out "
          f"at {out.data_ptr():#x}")
    return GemmGraph(replay, out, traffic)
