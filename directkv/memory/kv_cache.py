"""Paged KV cache with two tiers and a budget per tier.

Accounting and storage are separate: the simulation only needs page counts (a 32K-context batch of 24 is
100 GB it never allocates), while the GPU executor and the tests materialise the pools and read them
through `PagedKV` views. Block-table entries follow `directkv.kernels.paged`: e >= 0 is host page e,
e < 0 is HBM page -(e + 1).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from directkv.errors import ConfigError, KVCapacityError, check
from directkv.kernels.paged import PagedKV
from directkv.memory.arena import HostArena
from directkv.specs import ModelSpec

TIERS = ("hbm", "host")


def pool_page(entry: int) -> int:
    """The page index within its tier's pool of a block-table entry (host e >= 0, HBM -(e + 1))."""
    return entry if entry >= 0 else -(entry + 1)


@dataclass(frozen=True)
class KVStats:
    hbm_bytes: int  # bytes of pages held now
    host_bytes: int
    hbm_peak_bytes: int
    host_peak_bytes: int
    hbm_budget_bytes: int
    host_budget_bytes: int


@dataclass
class _Seq:
    tier: str
    pages: list[int]  # encoded block-table entries
    length: int = 0  # tokens written


class KVCacheManager:
    """Allocates KV pages per request in one tier, within that tier's budget.

    Parameters
    ----------
    model : ModelSpec whose layers/heads set the page shape.
    page_size : tokens per page.
    hbm_budget_bytes, host_budget_bytes : capacity of each tier for KV (>= 0).
    bytes_per_token : KV bytes of one token over all layers; defaults to the model's bf16 size
        (a compressed cache such as FlexGen's 4-bit one passes its smaller size).
    materialize : allocate real page pools so kernels can run: the HBM tier's on `hbm_device` (required then), the
        host tier's pinned with a zero-copy view when that device is CUDA.
    """

    def __init__(self, model: ModelSpec, *, page_size: int = 16, hbm_budget_bytes: float, host_budget_bytes: float,
                 bytes_per_token: int | None = None, materialize: bool = False, dtype: torch.dtype = torch.bfloat16,
                 hbm_device: str | torch.device | None = None, arena: HostArena | None = None):
        if page_size < 1 or page_size & (page_size - 1):
            raise ConfigError(f"page_size must be a power of two >= 1, got {page_size}")
        for tier, b in (("hbm", hbm_budget_bytes), ("host", host_budget_bytes)):
            if b < 0:
                raise ConfigError(f"{tier} KV budget must be >= 0 bytes, got {b}")
        self.model = model
        self.dtype = dtype
        self.page_size = page_size
        self.bytes_per_token = int(bytes_per_token or model.kv_bytes_per_token())
        self.page_bytes = self.page_size * self.bytes_per_token
        self.budget = {"hbm": int(hbm_budget_bytes), "host": int(host_budget_bytes)}
        self.capacity_pages = {t: self.budget[t] // self.page_bytes for t in TIERS}
        if arena is not None:  # reuse an arena across runs: pinning one is slow (DESIGN.md §2)
            self.capacity_pages["host"] = min(self.capacity_pages["host"], arena.k.shape[1])
        self._recycled: dict[str, list[int]] = {"hbm": [], "host": []}  # freed page ids (min-heaps), reused first
        self._used = {"hbm": 0, "host": 0}
        self._next = {"hbm": 0, "host": 0}
        self._peak = {"hbm": 0, "host": 0}
        self._seqs: dict[int, _Seq] = {}
        self.arena: HostArena | None = None
        self.hbm_k = self.hbm_v = None
        if materialize:
            self._materialize(dtype, hbm_device, arena)

    # ---- storage ---------------------------------------------------------------------------
    def _materialize(self, dtype: torch.dtype, hbm_device, arena: HostArena | None) -> None:
        m = self.model
        # the device is named, not guessed from CUDA's presence, and the host tier is pinned (with a zero-copy
        # view) only for a CUDA one: a CPU run on a machine with a GPU stays on the CPU
        check(hbm_device is not None, "a materialized KV cache needs hbm_device, the run's device (e.g. 'cpu', "
              "'cuda'); got None")
        self.arena = arena or HostArena.allocate(m, self.capacity_pages["host"], self.page_size, dtype=dtype,
                                                 pin=torch.device(hbm_device).type == "cuda")
        shape = (m.num_layers, self.capacity_pages["hbm"], self.page_size, m.num_kv_heads, m.head_dim)
        self.hbm_k = torch.empty(shape, dtype=dtype, device=hbm_device)
        self.hbm_v = torch.empty(shape, dtype=dtype, device=hbm_device)

    # ---- page accounting ---------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    def free_pages(self, tier: str) -> int:
        return self.capacity_pages[tier] - self._used[tier]

    def can_fit(self, num_tokens: int, tier: str) -> bool:
        return self.pages_for(num_tokens) <= self.free_pages(tier)

    def could_ever_fit(self, num_tokens: int, tier: str) -> bool:
        return self.pages_for(num_tokens) <= self.capacity_pages[tier]

    def _take(self, tier: str, n: int) -> list[int]:
        if n > self.free_pages(tier):
            raise KVCapacityError(tier, n * self.page_bytes, self.free_pages(tier) * self.page_bytes, self.budget[tier])
        self._used[tier] += n
        self._peak[tier] = max(self._peak[tier], self._used[tier])
        # freed ids first, then fresh ones; fresh ids only grow when every earlier id is in use, so every
        # id stays below the tier's capacity and indexes its pool. Freed ids come lowest first, ascending: a
        # request's pages then form long runs of consecutive ids, which whoever copies pages in bulk (swap's
        # stager) moves with one copy per run
        recycled = self._recycled[tier]
        reuse = min(n, len(recycled))
        ids = [heapq.heappop(recycled) for _ in range(reuse)]
        ids += range(self._next[tier], self._next[tier] + n - reuse)
        self._next[tier] += n - reuse
        return ids if tier == "host" else [-(i + 1) for i in ids]

    def reserve(self, req_id: int, num_tokens: int, tier: str) -> None:
        """Make room for `num_tokens` tokens in total for `req_id` (allocating pages in `tier`)."""
        if tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r}; valid: {', '.join(TIERS)}")
        seq = self._seqs.setdefault(req_id, _Seq(tier, []))
        if seq.tier != tier:
            raise ValueError(f"request {req_id} already holds pages in {seq.tier}, not {tier}")
        extra = self.pages_for(num_tokens) - len(seq.pages)
        if extra > 0:
            try:
                seq.pages += self._take(tier, extra)
            except KVCapacityError:
                if not seq.pages:
                    del self._seqs[req_id]
                raise

    def append(self, req_id: int, num_tokens: int) -> None:
        """Record `num_tokens` new tokens written (prefill chunk or decode step), growing pages if needed."""
        seq = self._seqs[req_id]
        self.reserve(req_id, seq.length + num_tokens, seq.tier)
        seq.length += num_tokens

    def free(self, req_id: int) -> None:
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return
        self._used[seq.tier] -= len(seq.pages)
        for e in seq.pages:
            heapq.heappush(self._recycled[seq.tier], pool_page(e))

    def seq_len(self, req_id: int) -> int:
        return self._seqs[req_id].length

    def tier_of(self, req_id: int) -> str:
        return self._seqs[req_id].tier

    def stats(self) -> KVStats:
        pb = self.page_bytes
        return KVStats(self._used["hbm"] * pb, self._used["host"] * pb, self._peak["hbm"] * pb, self._peak["host"] * pb,
                       self.budget["hbm"], self.budget["host"])

    # ---- views and writes (materialised caches only) -----------------------------------------
    def _need_storage(self) -> None:
        if self.arena is None:
            raise RuntimeError("this KV cache is accounting-only (materialize=False)")

    def view(self, layer: int, req_ids: list[int]) -> PagedKV:
        """PagedKV of one layer for these requests, host pools as zero-copy device views."""
        self._need_storage()
        table = self.block_table(req_ids)
        lens = torch.tensor([self._seqs[r].length for r in req_ids], dtype=torch.int32)
        dev = self.hbm_k.device
        return PagedKV(self.arena.k_view[layer], self.arena.v_view[layer], self.hbm_k[layer], self.hbm_v[layer],
                       table.to(dev), lens.to(dev))

    def pages(self, req_id: int) -> list[int]:
        """Encoded block-table entries of a request's pages, in token order."""
        return self._seqs[req_id].pages

    def slots(self, req_id: int, start: int, n: int) -> torch.Tensor:
        """Flat slot index (page * page_size + offset, within the request's tier pool) of tokens start..start+n-1."""
        pages = torch.tensor([pool_page(e) for e in self._seqs[req_id].pages], dtype=torch.int64)
        pos = torch.arange(start, start + n, dtype=torch.int64)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def block_table(self, req_ids: list[int], width: int | None = None) -> torch.Tensor:
        """[len(req_ids), width] int32 table of encoded page entries (padding 0 past each request's pages)."""
        width = width or max((len(self._seqs[r].pages) for r in req_ids), default=0) or 1
        if not req_ids:
            return torch.zeros((0, width), dtype=torch.int32)
        # one tensor from padded lists: a tensor per row cost ~15 us each, per step, before its first copy
        rows = [self._seqs[r].pages[:width] for r in req_ids]
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32)

    def decode_slots(self, req_ids: list[int], positions: list[int]) -> torch.Tensor:
        """[len(req_ids)] int64 flat slot (as `slots`) of one token per request, at its position: a serving
        step's new decode tokens, found without a tensor per request."""
        ps = self.page_size
        return torch.tensor([pool_page(self._seqs[r].pages[p // ps]) * ps + p % ps
                             for r, p in zip(req_ids, positions, strict=True)], dtype=torch.int64)

    def pools(self, layer: int, tier: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Device-visible K, V pools `[num_pages, page_size, num_kv_heads, head_dim]` of one layer and tier."""
        self._need_storage()
        if tier == "host":
            return self.arena.k_view[layer], self.arena.v_view[layer]
        return self.hbm_k[layer], self.hbm_v[layer]

    def write(self, layer: int, req_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V `[n, num_kv_heads, head_dim]` at token positions start..start+n-1 (pages must be reserved)."""
        self._need_storage()
        seq = self._seqs[req_id]
        p = start
        while p < start + k.shape[0]:
            entry = seq.pages[p // self.page_size]
            off = p % self.page_size
            n = min(self.page_size - off, start + k.shape[0] - p)
            kp, vp = (self.arena.k_view, self.arena.v_view) if entry >= 0 else (self.hbm_k, self.hbm_v)
            idx = pool_page(entry)
            kp[layer, idx, off : off + n] = k[p - start : p - start + n]
            vp[layer, idx, off : off + n] = v[p - start : p - start + n]
            p += n
