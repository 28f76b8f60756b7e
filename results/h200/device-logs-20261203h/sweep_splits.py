"""Thirty-fifth session (copied from device-logs-20261203e/sweep_splits.py, points and counts from the environment): tiled decode time against the forced split count, KV all in pinned host memory, beside the
plain read of the same bytes (read_probe), at several (context, batch) points. Timing as bench_decode: CUDA events
around N back-to-back calls rotating over copies of the cache that together exceed 3x L2; median of 7 repeats."""
import json, os, sys
import torch
from directkv.kernels.cuda.bench_decode import _calls, _Point
from directkv.kernels.cuda.zero_copy import pinned_empty
from directkv.kernels.cuda import decode_attention as dec
from directkv.timing import time_fn

N = 40
TAG = os.environ.get("TAG", "tree")
POINTS = [tuple(int(x) for x in p.split("x")) for p in os.environ.get("POINTS", "4096x1,4096x2,8192x1,16384x1,32768x1").split(",")]
SPLITS = [None] + [int(s) for s in os.environ.get("SPLITS", "1,2,4,8").split(",")]
l2 = torch.cuda.get_device_properties(0).L2_cache_size
out = []
for ctx, batch in POINTS:
    kvb = 2 * batch * ctx * 8 * 128 * 2
    copies = max(1, -(-3 * l2 // kvb))
    arena = pinned_empty((copies * kvb,), torch.uint8)
    pt = _Point(arena, ctx, batch, copies, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                page_size=16, page_order="random", gen=torch.Generator(device="cuda").manual_seed(0))
    rows = {}
    for tag, name, opts in [("read_probe", "read_probe", {})] + [(f"s{s}", "tiled", dict(tile_kv=64, num_splits=s)) for s in SPLITS] + [("read_probe2", "read_probe", {})]:
        try:
            call, _, _ = _calls(pt, name, opts)
            call(0, 1); torch.cuda.synchronize()
            rows[tag] = time_fn(lambda: [call(i, N) for i in range(N)], warmup=2, repeats=7).median_ms / N * 1e3
        except Exception as e:  # noqa: BLE001
            rows[tag] = f"{type(e).__name__}: {e}"[:200]
    try:
        plan = dec.plan_splits(batch * 8, -(-ctx // 64), 264, host_only=True, cap_tiles=dec.table_cap_tiles(16, 64))
    except (TypeError, AttributeError):
        plan = dec.plan_splits(batch * 8, -(-ctx // 64), 264)
    print(f"{TAG} {ctx}x{batch} plan={plan} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows.items()), flush=True)
    out.append(dict(ctx=ctx, batch=batch, auto_plan=plan, us=rows))
    del pt, arena
json.dump(out, open(os.path.join(os.environ["OUT"], f"splits_{TAG}.json"), "w"), indent=1)
