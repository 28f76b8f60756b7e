"""FlexGen-like compressed offload: KV stored in pinned host memory as 4-bit codes, group 64, fp16 min/max.

New K/V are quantised on the GPU and stored zero-copy; each layer's codes and scales are staged into HBM
by the copy engine one layer ahead (as swap does, with ~28% of the bytes), dequantised to bf16, attended.
Accuracy: layer 0 also keeps an exact bf16 shadow cache in HBM (not counted as system memory), and the
decode attention output over the dequantised cache is compared with it every step.
"""

from __future__ import annotations

import torch

from directkv.engine.gpu.paths import StagedPath
from directkv.kernels.cuda.scatter_rows import scatter_rows
from directkv.kernels.cuda.zero_copy import host_buffer
from directkv.kernels.paged import PagedKV
from directkv.memory import KVCacheManager

GROUP = 64


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., D]` -> (codes uint8 `[..., D // 2]`, min/max fp16 `[..., D // 64, 2]`)."""
    g = x.float().unflatten(-1, (-1, GROUP))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    q = ((g - lo) / (hi - lo).clamp_min(1e-8) * 15).round().clamp(0, 15).to(torch.uint8).flatten(-2)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, torch.cat([lo, hi], -1).to(torch.float16)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).float().unflatten(-1, (-1, GROUP))
    lo, hi = scales[..., :1].float(), scales[..., 1:].float()
    return (lo + q / 15 * (hi - lo)).flatten(-2).to(dtype)


class FlexgenPath(StagedPath):
    def __init__(self, kv: KVCacheManager, device: torch.device):
        # the base class's pinned bf16 arena is replaced by compressed pools of the same page count
        m, pages, ps = kv.model, kv.capacity_pages["host"], kv.page_size
        shape = (m.num_layers, pages, ps, m.num_kv_heads)
        dev = torch.device(device)
        pools = {name: host_buffer((*shape, *tail), dt, pin=dev.type == "cuda") for name, tail, dt in (
            ("ck", (m.head_dim // 2,), torch.uint8), ("cv", (m.head_dim // 2,), torch.uint8),
            ("sk", (m.head_dim // GROUP, 2), torch.float16), ("sv", (m.head_dim // GROUP, 2), torch.float16))}
        self.host = {k: host for k, (host, _) in pools.items()}
        self.views = {k: view for k, (_, view) in pools.items()}
        super().__init__(kv, device=device,
                         host_pools=lambda layer: [self.host[n][layer] for n in ("ck", "cv", "sk", "sv")])
        self.shadow = torch.empty((pages, ps, m.num_kv_heads, m.head_dim), dtype=kv.dtype, device=dev), \
            torch.empty((pages, ps, m.num_kv_heads, m.head_dim), dtype=kv.dtype, device=dev)
        self._errors: list[torch.Tensor] = []  # 0-d, on the device: read once at the end, not synced per step

    @property
    def errors(self) -> list[float]:
        """Relative error of layer 0's decode attention output against the exact shadow, one per decode step."""
        return [float(e) for e in self._errors]

    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        slots = self.plan.slots
        for (cn, sn), x in ((("ck", "sk"), k), (("cv", "sv"), v)):
            codes, scales = quantize(x)
            self.views[cn][layer].flatten(0, 1)[slots] = codes
            self.views[sn][layer].flatten(0, 1)[slots] = scales
            self.traffic.link_write_bytes += codes.numel() + scales.numel() * 2
        if layer == 0:
            self.shadow[0].flatten(0, 1)[slots] = k
            self.shadow[1].flatten(0, 1)[slots] = v
        return None, None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv, sk, sv = self.stager.acquire(layer)
        if layer + 1 < self.kv.model.num_layers:
            self.stager.issue(layer + 1)
        self.store(layer, k, v)
        k_st, v_st = dequantize(ck, sk, k.dtype), dequantize(cv, sv, v.dtype)  # unfused, as FlexGen does
        self.stager.release(layer)
        scatter_rows((k_st, v_st), (k, v), self.remap)
        self.traffic.link_read_bytes += self.stager.layer_bytes
        self.staging_bytes = max(self.staging_bytes, self.stager.nbytes + 2 * k_st.numel() * k_st.element_size())
        out = self.attention(self.plan, "hbm", q, k, v, k_st, v_st, self.decode_table, self.chunk_tables,
                             tables_cpu=self.tables_cpu)
        if layer == 0 and self.plan.num_decodes:
            self._compare(q, out)
        return out

    def _compare(self, q: torch.Tensor, out: torch.Tensor) -> None:
        p, nd = self.plan, self.plan.num_decodes
        empty = self.shadow[0][:0]
        kv = PagedKV(empty, empty, *self.shadow, _as_hbm(p.decode_table), p.decode_lens)
        opts = {"host_table": (_as_hbm(p.decode_table_cpu), p.decode_lens_cpu)} if self.in_place else {}
        exact, _ = self.decode(q[:nd], kv, variant="tiled", **opts)
        ref = exact.float()
        self._errors.append((out[:nd].float() - ref).norm() / ref.norm().clamp_min(1e-12))



def _as_hbm(table: torch.Tensor) -> torch.Tensor:
    """Host page entries e -> the same page index in an HBM pool (the shadow mirrors host page ids)."""
    return -(table + 1)
