"""Per-step layout shared by every KV path: where each token of the flat batch goes, and what it attends to.

The model runs one flat token batch per step: first one token per decoding request, then the prompt
chunks back to back. Everything here is computed once per step and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from directkv.engine.state import Step
from directkv.memory import KVCacheManager


@dataclass(frozen=True)
class ChunkPlan:
    req_id: int
    start: int  # first row of the chunk in the flat batch
    length: int
    past_len: int


@dataclass(frozen=True)
class StepPlan:
    decode_ids: list[int]
    decode_lens_host: list[int]
    decode_lens: torch.Tensor  # [num_decodes] int32: cached tokens incl. this step's, on device
    decode_table: torch.Tensor  # [num_decodes, width] int32 on device
    # the same two on the host, as built (cpu_attn's CPU kernel reads them; no copy back from the device)
    decode_lens_cpu: torch.Tensor
    decode_table_cpu: torch.Tensor
    chunks: list[ChunkPlan]
    chunk_tables: list[torch.Tensor]  # per chunk [1, width] int32 on device
    chunk_tables_cpu: list[torch.Tensor]  # the same on the host (stream plans its copies from them, no sync)
    slots: torch.Tensor  # [num_tokens] int64 flat slot of each new token in its tier pool, on device
    slots_cpu: torch.Tensor  # the same on the host (swap's staging remaps them there, no copy back)
    # [num_tokens] int64 absolute positions, on the host: the runner checks the inputs' ranges where they live,
    # and on the GPU that check was a device sync per step
    positions: torch.Tensor

    @property
    def num_decodes(self) -> int:
        return len(self.decode_ids)

    def page_lists(self, kv: KVCacheManager, *, decodes: bool = True) -> list[list[int]]:
        """Pages each decode (if `decodes`) and then each chunk touches this step, new tokens included."""
        ps = kv.page_size
        lists = ([kv.pages(r)[: -(-n // ps)] for r, n in zip(self.decode_ids, self.decode_lens_host, strict=True)]
                 if decodes else [])
        return lists + [kv.pages(c.req_id)[: -(-(c.past_len + c.length) // ps)] for c in self.chunks]

    def past_page_counts(self, kv: KVCacheManager, *, decodes: bool = True) -> list[int]:
        """Per entry of page_lists (same arguments), how many of its leading pages hold tokens cached before this
        step: the pages after them hold only this step's new tokens, which no copy from the host needs to bring."""
        ps = kv.page_size
        counts = [-(-(n - 1) // ps) for n in self.decode_lens_host] if decodes else []  # n counts the new token
        return counts + [-(-c.past_len // ps) for c in self.chunks]


def plan_step(step: Step, kv: KVCacheManager, device: torch.device) -> StepPlan:
    dec = [s.req_id for s in step.decodes]
    ctx = [s.context_len for s in step.decodes]
    slots, pos = [kv.decode_slots(dec, ctx)], [torch.tensor(ctx, dtype=torch.int64)]
    chunks, row = [], len(dec)
    for c in step.prefills:
        chunks.append(ChunkPlan(c.state.req_id, row, c.chunk_len, c.past_len))
        slots.append(kv.slots(c.state.req_id, c.past_len, c.chunk_len))
        pos.append(torch.arange(c.past_len, c.past_len + c.chunk_len))
        row += c.chunk_len
    to = dict(device=device, non_blocking=True)
    lens, table = torch.tensor([c + 1 for c in ctx], dtype=torch.int32), kv.block_table(dec)
    chunk_tables = [kv.block_table([c.req_id]) for c in chunks]
    slots_cpu = torch.cat(slots)
    return StepPlan(
        decode_ids=dec,
        decode_lens_host=[c + 1 for c in ctx],
        decode_lens=lens.to(**to),
        decode_table=table.to(**to),
        decode_lens_cpu=lens,
        decode_table_cpu=table,
        chunks=chunks,
        chunk_tables=[t.to(**to) for t in chunk_tables],
        chunk_tables_cpu=chunk_tables,
        slots=slots_cpu.to(**to),
        slots_cpu=slots_cpu,
        positions=torch.cat(pos),
    )
