"""GPU stepper: one engine step for real — the model's layers with the system's KV path, timed by CUDA events.

Runs on the CPU too (reference kernels, perf_counter), which is how the tests check it at toy sizes.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from directkv.engine.gpu.cpu_attn_path import CpuAttnPath
from directkv.engine.gpu.flexgen_path import FlexgenPath
from directkv.engine.gpu.paths import StagedPath, ZeroCopyPath, kernel_backend
from directkv.engine.gpu.plan import plan_step
from directkv.engine.state import Step
from directkv.engine.systems import (
    DEFAULT_CPU_ATTN_KERNEL,
    DEFAULT_NO_PAST_PREFILL,
    NO_PIPELINING,
    Pipelining,
    StepCost,
    SystemPolicy,
    check_hbm_prefill,
    check_no_past_prefill,
)
from directkv.errors import ConfigError, unknown_name
from directkv.kernels.cuda.prefill_attention import NEW_PASSES
from directkv.kernels.traffic_model import SERVING_STREAM_CHUNK_MIB, SERVING_STREAM_SLOTS
from directkv.memory import KVCacheManager
from directkv.model.runner import ModelRunner


def make_path(policy: SystemPolicy, kv: KVCacheManager, device: torch.device, *, cpu_threads: int | None = None,
              cpu_attn_kernel: str = DEFAULT_CPU_ATTN_KERNEL, directkv_side_ctas: int | None,
              prefill_new_pass: str = "kernel", stream_slots: int = SERVING_STREAM_SLOTS,
              stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB, hbm_prefill: str = "kernel",
              no_past_prefill: str = DEFAULT_NO_PAST_PREFILL):
    if prefill_new_pass not in NEW_PASSES:  # before anything is pinned or captured, not at the first prompt
        raise unknown_name("prefill_new_pass", prefill_new_pass, NEW_PASSES)
    check_hbm_prefill(hbm_prefill)
    check_no_past_prefill(no_past_prefill)
    path = _system_path(policy, kv, device, cpu_threads=cpu_threads, cpu_attn_kernel=cpu_attn_kernel,
                        directkv_side_ctas=directkv_side_ctas, stream_slots=stream_slots,
                        stream_chunk_mib=stream_chunk_mib)
    path.prefill_new_pass = prefill_new_pass  # every path is a ZeroCopyPath: its _chunks reads both
    path.hbm_prefill = hbm_prefill
    path.no_past_prefill = no_past_prefill if policy.name == "directkv" else "kernel"  # the others': hbm_prefill
    return path


def _system_path(policy: SystemPolicy, kv: KVCacheManager, device: torch.device, *, cpu_threads: int | None,
                 cpu_attn_kernel: str, directkv_side_ctas: int | None, stream_slots: int = SERVING_STREAM_SLOTS,
                 stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB):
    if policy.name in ("directkv", "hbm"):
        if policy.variant == "fused":
            raise ConfigError("directkv variant 'fused' is not served by the GPU executor (its kernel, proj_attention, "
                              "runs in kernel_ablation); valid on the GPU: naive, tiled, stream")
        if policy.variant == "stream" and kernel_backend(device) != "cuda":
            raise ConfigError(f"directkv variant 'stream' needs a CUDA device (a GPU); this run is on {device}; valid "
                              "there: naive, tiled")
        return ZeroCopyPath(kv, policy.kv_tier, policy.variant or "tiled", side_ctas=directkv_side_ctas,
                            stream_slots=stream_slots, stream_chunk_mib=stream_chunk_mib)
    if policy.name == "swap":
        return StagedPath(kv)
    if policy.name == "cpu_attn":
        return CpuAttnPath(kv, threads=cpu_threads, kernel=cpu_attn_kernel)
    return FlexgenPath(kv, device)


class GPUStepper:
    def __init__(self, policy: SystemPolicy, runner: ModelRunner, kv: KVCacheManager, device: torch.device, *,
                 seed: int = 0, cpu_threads: int | None = None, cpu_attn_kernel: str = DEFAULT_CPU_ATTN_KERNEL,
                 pipelining: Pipelining = NO_PIPELINING, prefill_new_pass: str = "kernel",
                 stream_slots: int = SERVING_STREAM_SLOTS, stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB,
                 hbm_prefill: str = "kernel", no_past_prefill: str = DEFAULT_NO_PAST_PREFILL):
        self.policy, self.runner, self.kv, self.device = policy, runner, kv, torch.device(device)
        pipelining.check_system(policy)
        self.pipelining = pipelining
        self.path = make_path(policy, kv, self.device, cpu_threads=cpu_threads, cpu_attn_kernel=cpu_attn_kernel,
                              directkv_side_ctas=pipelining.side_ctas, prefill_new_pass=prefill_new_pass,
                              stream_slots=stream_slots, stream_chunk_mib=stream_chunk_mib, hbm_prefill=hbm_prefill,
                              no_past_prefill=no_past_prefill)
        self.gen = torch.Generator().manual_seed(seed)
        self.last_token: dict[int, int] = {}  # request -> token to feed at its next decode
        self.outputs: dict[int, list[int]] = {}  # request -> generated ids (tests compare systems on them)
        self.vocab = runner.spec.vocab_size
        # (device s, host s to queue it, host s of its plan: plan_step and the path's begin, which issues the
        # step's first copies) of every step run
        self.step_times: list[tuple[float, float, float]] = []
        # (decodes, prompt tokens, host clock at its start) of each step in step_times
        self.step_shapes: list[tuple[int, int, float]] = []

    def forget_steps(self) -> None:
        """Drop the steps recorded so far (step_times and step_shapes together): a warm-up's are not the run's."""
        self.step_times.clear()
        self.step_shapes.clear()

    def _tokens(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat input ids and the rows whose logits are needed (decodes + prompt-finishing chunks)."""
        ids = [self.last_token[s.req_id] for s in step.decodes]
        rows = list(range(len(step.decodes)))
        n = len(ids)
        for c in step.prefills:  # prompts are lengths only; their ids are random, seeded
            ids += torch.randint(0, self.vocab, (c.chunk_len,), generator=self.gen).tolist()
            n += c.chunk_len
            if c.past_len + c.chunk_len >= c.state.req.prompt_len:
                rows.append(n - 1)
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)

    def split(self, step: Step) -> int | None:
        """Row where a software-pipelined step is cut into its two parts, or None to run it as one batch
        (Pipelining.cut: the simulation cuts the same steps)."""
        return self.pipelining.cut(self.policy, step, self.runner.spec.kv_bytes_per_token_per_layer())

    def run_step(self, step: Step) -> StepCost:
        ids, rows = self._tokens(step)
        cuda = self.device.type == "cuda"
        before = replace(self.path.traffic)  # paths add to their record in place
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        plan = plan_step(step, self.kv, self.device)
        self.path.begin(plan)
        prep_s = time.perf_counter() - t0
        # a step of mid-prompt chunks only needs no logits; the runner wants one row, which is then dropped
        want = rows if rows.numel() else torch.tensor([ids.numel() - 1])
        split = self.split(step)
        # host tensors: the runner checks their ranges on the host, then moves them (no device sync)
        if split is not None:  # one part's attention (CPU, or zero-copy on a side stream) overlaps the other part's layers
            logits = self.runner.forward_pipelined(ids, plan.positions, self.path.attend_async, want, split=split)
        else:
            logits = self.runner.forward(ids, plan.positions, self.path.attend, want)
        # the host has queued the whole step: on a GPU, a host time near the step's device time means the device
        # waited for the host (step_times; profile prints both)
        host_s = time.perf_counter() - t0
        nxt = logits.argmax(-1).tolist()[: rows.numel()]  # greedy; ignore_eos: lengths come from the workload
        if cuda:
            stop.record()
            stop.synchronize()
            seconds = start.elapsed_time(stop) / 1e3
        else:
            seconds = time.perf_counter() - t0
        owners = [s.req_id for s in step.decodes] + [
            c.state.req_id for c in step.prefills if c.past_len + c.chunk_len >= c.state.req.prompt_len]
        self.last_token.update(zip(owners, nxt, strict=True))
        for r, t in zip(owners, nxt, strict=True):
            self.outputs.setdefault(r, []).append(t)
        self.step_times.append((seconds, host_s, prep_s))
        self.step_shapes.append((len(step.decodes), sum(c.chunk_len for c in step.prefills), t0))
        after = self.path.traffic
        delta = type(after)(**{k: getattr(after, k) - getattr(before, k) for k in after.as_dict()})
        return StepCost(seconds, delta, self.path.staging_bytes)
