"""Session 37, call 4: the k-split plan A/B with an L2 flush before every call (as the benchmark times it)."""
import json, os
import torch
from directkv.kernels.cuda.bench_common import timed
from directkv.kernels.cuda.gemm_case_study import gemm
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
for n, old, new in ((4096, 4, 8), (10240, 3, 7)):
    a = torch.randn(n, n, dtype=torch.float16, device="cuda")
    bh = torch.randn(n, n, dtype=torch.float16, device="cuda")
    host = pinned_empty((n, n), torch.float16); host.copy_(bh.cpu())
    for r in range(2):
        for tier, b in (("host", device_view(host)), ("hbm", bh)):
            for s in (old, new):
                t = timed(lambda: gemm(a, b, variant="tiled", k_splits=s), warmup=2, repeats=7)
                print(json.dumps(dict(n=n, tier=tier, k_splits=s, round=r, ms=round(t["time_ms"], 3))), flush=True)
