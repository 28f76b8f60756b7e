"""Decode math A/B with every page in HBM (the kernel then runs at SM pace, not the link's): time per call of tiled
and naive decode (tile_kv from env TILES, default 64) at Llama-3.1-8B shapes (32 / 8 heads, head_dim 128, bf16, 16-token pages in random order)."""
import json, os, sys
import torch
from directkv.kernels.paged import PagedKV
from directkv.kernels.cuda.decode_attention import decode_attention
from directkv.timing import time_fn

tag = sys.argv[1]
torch.manual_seed(0)
rows = []
for ctx, batch in [(4096, 1), (4096, 16), (32768, 1), (32768, 16), (8192, 64)]:
    pages = batch * ctx // 16
    hk = torch.randn(pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    hv = torch.randn_like(hk)
    host = torch.zeros(1, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    from directkv.kernels.cuda.zero_copy import device_view
    hostv = device_view(host)
    perm = torch.randperm(pages, device="cuda").int()
    table = (-(perm + 1)).view(batch, ctx // 16).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    kv = PagedKV(hostv, hostv, hk, hv, table, lens)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for variant, tile in [(v, t) for t in map(int, os.environ.get("TILES", "64").split(",")) for v in ("tiled", "naive")]:
        decode_attention(q, kv, variant=variant, out=out, tile_kv=tile)
        inner = 200
        t = time_fn(lambda: [decode_attention(q, kv, variant=variant, out=out, tile_kv=tile) for _ in range(inner)], warmup=2, repeats=7)
        rows.append(dict(tag=tag, ctx=ctx, batch=batch, variant=variant, tile=tile, us=1e3 * t.median_ms / inner,
                         gbps=2 * hk.numel() * 2 / (t.median_ms / inner) / 1e6))
        print(json.dumps(rows[-1]), flush=True)
    del hk, hv, kv
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "/tmp"), "hbm.jsonl"), "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
