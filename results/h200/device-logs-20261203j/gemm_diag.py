"""Session 37, device call 1: where the GEMM `tiled` kernel's time goes. k_splits swept with B on the host and in
HBM, beside pipelined, naive with B in HBM and cuBLAS; one JSON line per row. With PROFILE=host|hbm: one tiled call
inside an NVTX range `measure` (for ncu)."""
import json, os, sys, time
import torch
from directkv.kernels.cuda.gemm_case_study import gemm, plan_k_splits
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.timing import time_fn

n = int(os.environ.get("N", 10240))
torch.manual_seed(0)
a = torch.randn(n, n, dtype=torch.float16, device="cuda")
b_hbm = torch.randn(n, n, dtype=torch.float16, device="cuda")
host = pinned_empty((n, n), torch.float16)
host.copy_(b_hbm.cpu())
b_host = device_view(host)
ref = (a.float() @ b_hbm.float())
prof = os.environ.get("PROFILE")
if prof:
    b = b_host if prof == "host" else b_hbm
    gemm(a, b, variant="tiled"); torch.cuda.synchronize()
    with torch.cuda.nvtx.range("measure"):
        gemm(a, b, variant="tiled")
    torch.cuda.synchronize(); sys.exit(0)
sms = torch.cuda.get_device_properties(0).multi_processor_count
plan = plan_k_splits(n, n, n, sms=sms)
def row(name, fn, **kw):
    out = fn()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    t = time_fn(fn, warmup=1, repeats=3)
    r = dict(tag=os.environ.get("TAG", "main"), n=n, name=name, ms=round(t.median_ms, 3), tflops=round(2 * n**3 / t.median_ms / 1e9, 1), rel_err=err, **kw)
    print(json.dumps(r), flush=True)
if os.environ.get("TAG", "main") == "main":
    row("cublas_hbm", lambda: a @ b_hbm)
    row("naive_hbm", lambda: gemm(a, b_hbm, variant="naive")[0])
for tier, b in (("hbm", b_hbm), ("host", b_host)):
    for s in sorted({1, 2, 3, 4, 5, 7, 8, 10, 20, plan}):
        if s > -(-n // 512): continue
        row(f"tiled_{tier}", lambda: gemm(a, b, variant="tiled", k_splits=s)[0], k_splits=s, plan=plan)
    row(f"pipelined_{tier}", lambda: gemm(a, b, variant="pipelined")[0], k_splits=plan)
