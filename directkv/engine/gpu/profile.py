"""Where a serving step's time goes: serve one fixed batch with torch.profiler on and print the top ops.

For finding executor overheads (host syncs, per-page copies, Python launches) rather than for results:
nothing is written to the results tree. Every step's CUDA-event time is printed beside its kind, so decode
steps and prompt-chunk steps can be told apart, and beside the host's time to queue the step (from its start
to the last launch, before the read back of the sampled tokens): a host time near the device time says the
device waited for the host's launches. Only the steps picked by `skip` / `count` (and `--min-decodes`: from the
first decode-only step of that many decodes on) run under the
profiler (a whole 16K-context run under it took minutes to parse on the H200).

Run: python -m directkv.engine.gpu.profile --system swap --context 16384 --batch 4 --output 4 --skip 8 --count 2
(on the GPU where one is visible; --device cpu serves on the CPU, as the tests do on any machine)

Under torch.profiler it also prints how busy the GPU was in the picked steps (device_busy): the host-to-device
copies' time (the copy engine's work in swap and directkv `stream`), the kernels' on any stream, and how much
of the two overlapped, each over the span from the first to the last device event; then the copy engine's
longest idle gaps (copy_gaps) with what the device and the host were doing then, and with --stacks the longest
host calls that can block on the device, with their callers. With --python the picked steps run under cProfile
instead (none of the above): host time per Python function (cumulative), to find which of the executor's calls
a host-bound step spends its time in. A run of more than 60 steps (a --schedule replay, typically) prints
per-class means instead of every step, then the cost model's run of the same requests per class (--hardware),
so the classes of step where the simulation is optimistic show. With --memory the caching allocator's history is
recorded for the whole run and the reserved segments and the allocated peak are printed by the code that allocated
them (memory_report; step times of such a run are slowed by the recording).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections import Counter

import torch

from directkv.costmodel import CostModel
from directkv.device import DEVICES, resolve_device
from directkv.engine.gpu import memory_report
from directkv.engine.gpu.executor import run_gpu
from directkv.engine.gpu.stepper import GPUStepper
from directkv.engine.scheduler import SchedulerConfig
from directkv.engine.sim_executor import MemoryConfig, simulate
from directkv.engine.systems import (
    DEFAULT_DIRECTKV_SIDE_CTAS,
    DEFAULT_NO_PAST_PREFILL,
    DEFAULT_PIPELINE_MIN_KV_MB,
    HBM_PREFILLS,
    NO_PAST_PREFILLS,
    NO_PIPELINING,
    SYSTEMS,
    Pipelining,
    SystemPolicy,
)
from directkv.errors import ConfigError, check
from directkv.kernels.cuda.prefill_attention import NEW_PASSES
from directkv.kernels.traffic_model import (
    SERVING_STREAM_CHUNK_MIB,
    SERVING_STREAM_SLOTS,
    STREAM_SLOTS_AUTO,
    resolve_stream_slots,
)
from directkv.specs import get_hardware, get_model
from workloads import load_schedule, synthetic_workload


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _split(events) -> tuple[list, list, list]:
    """(host-to-device copies, other device work, host calls) of torch.profiler FunctionEvents, each as
    (start us, end us, name); user annotations, which span other events, left out."""
    h2d, other, host = [], [], []
    for e in events:
        if getattr(e, "is_user_annotation", False):
            continue
        span = (e.time_range.start, e.time_range.end, e.name)
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            (h2d if e.name.startswith("Memcpy HtoD") else other).append(span)
        else:
            host.append(span)
    return h2d, other, host


def device_busy(events) -> dict[str, float] | None:
    """Milliseconds of the profiled device work (torch.profiler FunctionEvents; None without device events):
    `span` from the first device event's start to the last one's end, `h2d` the union of host-to-device copies,
    `kernels` the union of everything else on any stream (device-to-device and device-to-host copies included),
    `both` the time the two ran at once. A copy engine idle while the stream variant's kernels wait for it shows
    as h2d well under span where swap's is not."""
    h2d, other, _ = _split(events)
    if not (h2d or other):
        return None
    copies, kernels = _merged([(a, b) for a, b, _ in h2d]), _merged([(a, b) for a, b, _ in other])
    every = copies + kernels
    span = max(end for _, end in every) - min(start for start, _ in every)
    total = lambda spans: sum(end - start for start, end in spans)  # noqa: E731
    return {"span": span / 1e3, "h2d": total(copies) / 1e3, "kernels": total(kernels) / 1e3,
            "both": _overlap(copies, kernels) / 1e3}


def copy_gaps(events, *, min_us: float = 20.0, top: int = 8) -> dict | None:
    """The copy engine's idle gaps between its first and last host-to-device copy of the profiled steps
    (torch.profiler FunctionEvents; None without copies): `count` and `total` (ms) of the gaps of >= min_us, and
    the `top` longest as (ms from the first copy, gap us, the device op that ended last before the copy engine
    restarted (what a copy waiting on an event waited for), what the host was in when the gap began, what it was
    in when the gap ended). The host's innermost call is the CPU event of shortest duration over that instant,
    so a gap spent in a sync or a pageable copy names it, and one whose next copy was issued late names the host
    work before it."""
    h2d, other, host = _split(events)
    if not h2d:
        return None
    copies = _merged([(a, b) for a, b, _ in h2d])

    def before(t: float) -> str:
        ended = [(b, name) for a, b, name in other if b <= t]
        return max(ended)[1] if ended else "-"

    def host_at(t: float) -> str:
        over = [(b - a, name) for a, b, name in host if a <= t <= b]
        return min(over)[1] if over else "-"

    gaps = [(a, b) for (_, a), (b, _) in zip(copies, copies[1:], strict=False) if b - a >= min_us]
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return {"count": len(gaps), "total": sum(b - a for a, b in gaps) / 1e3,
            "top": [((a - copies[0][0]) / 1e3, b - a, before(b), host_at(a), host_at(b)) for a, b in longest]}


# host calls that can block on the device: torch.profiler records Python stacks on the aten ops (a D2H copy_,
# item, nonzero), not on the runtime calls under them (cudaMemcpyAsync, the syncs), which print without frames
BLOCKING = ("aten::copy_", "aten::_to_copy", "aten::item", "aten::_local_scalar_dense", "aten::nonzero",
            "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def print_blocking_stacks(events, *, rows: int, frames: int = 4) -> None:
    """The `rows` longest host calls that can block on the device (BLOCKING), each with the first `frames`
    Python frames of this package the profiler lists for it (torch.profiler's with_stack)."""
    calls = sorted((e for e in events if e.name in BLOCKING and getattr(e, "device_type", None)
                    != torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start - e.time_range.end)
    print(f"longest blocking host calls (us, name, first {frames} directkv frames):")
    for e in calls[:rows]:
        ours = [f for f in (getattr(e, "stack", None) or []) if "directkv" in f or "workloads" in f][:frames]
        where = " < ".join(ours) or "(no Python frames)"
        print(f"  {e.time_range.end - e.time_range.start:8.0f}  {e.name}  {where}")


def step_class(kind: str) -> str:
    """The class of a step of `kind` ("<decodes>d+<prompt tokens>p", "*" marks a profiled one): decode-only steps
    by decodes (1-8, 9-16, 17-32, 33-64, more), steps with prompt tokens by prompt tokens (<= 256, the largest
    CUDA-graph bucket, and more)."""
    decodes, prompt = (int(x) for x in kind.rstrip("*").rstrip("p").split("d+"))
    if prompt:
        return "prompt <= 256 tokens" if prompt <= 256 else "prompt > 256 tokens"
    top = next((b for b in (8, 16, 32, 64) if decodes <= b), None)
    return f"decode-only {top // 2 + 1 if top > 8 else 1}-{top}" if top else "decode-only > 64"


def _by_class(steps: list[tuple]) -> dict[str, list[tuple]]:
    """The (kind, *values) rows of `steps` grouped by step_class, each row's values as a tuple."""
    classes: dict[str, list[tuple]] = {}
    for kind, *values in steps:
        classes.setdefault(step_class(kind), []).append(tuple(values))
    return classes


def step_summary(steps: list[tuple[str, float, float, float]]) -> list[str]:
    """Lines of per-class (step_class) statistics of a long run (a replayed schedule): count, mean device ms, mean
    host ms to queue the step and to plan it (before its first copy), how many steps the host took >= 90% of the
    device time to queue (the device then likely waited for it), and their device seconds in all."""
    classes = _by_class(steps)
    lines = [f"{'steps':<22} {'count':>5} {'device ms':>9} {'host ms':>8} {'plan ms':>8} {'host >= 90%':>11} "
             f"{'device s':>8}"]
    for name in sorted(classes):
        xs = classes[name]
        dev, host, prep = (sum(x[i] for x in xs) for i in range(3))
        bound = sum(h >= 0.9 * d for d, h, _ in xs)
        lines.append(f"{name:<22} {len(xs):>5} {1e3 * dev / len(xs):>9.1f} {1e3 * host / len(xs):>8.1f} "
                     f"{1e3 * prep / len(xs):>8.1f} {bound:>11} {dev:>8.2f}")
    return lines


def simulated_summary(steps: list[tuple[str, float]]) -> list[str]:
    """Lines of per-class statistics of the cost model's steps (kind, seconds) of the same requests: count, mean
    step ms, seconds in all (the measured table's device columns, for the gap between model and measurement).
    The model's engine clock moves on its own step times, so its steps batch the requests differently: compare
    the classes' means, not step by step."""
    classes = _by_class(steps)
    lines = [f"{'steps':<22} {'count':>5} {'model ms':>9} {'model s':>8}"]
    for name in sorted(classes):
        xs = [seconds for seconds, in classes[name]]
        lines.append(f"{name:<22} {len(xs):>5} {1e3 * sum(xs) / len(xs):>9.1f} {sum(xs):>8.2f}")
    return lines


def step_kind(step) -> str:
    """"<decodes>d+<prompt tokens>p" of an engine Step (step_class reads it)."""
    return f"{len(step.decodes)}d+{sum(c.chunk_len for c in step.prefills)}p"


# host-side calls whose counts reveal a slow executor: syncs stall the launch queue, copies cost per call
WATCHED = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
           "cudaStreamWaitEvent", "cudaLaunchKernel", "aten::item", "aten::_local_scalar_dense", "aten::copy_")


def profile(system: str, *, model: str = "llama-3.1-8b", variant: str = "tiled", context: int = 16384,
            batch: int = 4, output: int = 4, max_batched_tokens: int = 2048, rows: int = 25,
            hbm_budget_gb: float = 96.0, skip: int = 8, count: int = 2, graphs: bool = False,
            pipelining: Pipelining = NO_PIPELINING, python: bool = False, stacks: bool = False,
            schedule: str | None = None, min_decodes: int = 0, hardware: str = "h200-pcie5",
            prefill_new_pass: str = "kernel", stream_slots: int = SERVING_STREAM_SLOTS,
            stream_chunk_mib: int = SERVING_STREAM_CHUNK_MIB, hbm_prefill: str = "kernel",
            no_past_prefill: str = DEFAULT_NO_PAST_PREFILL, memory: bool = False, device: str = "auto") -> None:
    device = resolve_device(device)
    check(not memory or device == "cuda", "--memory reads the CUDA caching allocator's history: it needs the run on "
          "a CUDA GPU (--device auto or cuda where one is visible); got the CPU")
    check(not (python and stacks), "--stacks records torch.profiler stacks and --python runs cProfile instead; "
          "got both: pass one")
    check(all(isinstance(x, int) and x >= 0 for x in (skip, count, min_decodes)),
          f"--skip, --count and --min-decodes must be ints >= 0; got {skip!r}, {count!r}, {min_decodes!r}")
    spec = get_model(model)
    cost_model = CostModel.for_hardware(get_hardware(hardware))  # a bad name fails before the GPU run, not after
    policy = SystemPolicy(system, variant if system == "directkv" else "")
    mem = MemoryConfig(hbm_budget_gb * 1e9, 0.9 * 128e9)
    sched = SchedulerConfig(256, max_batched_tokens)
    # a rate sweep's saved schedule (its run's schedules/*.parquet) replays those requests at their arrival times
    requests = (load_schedule(schedule) if schedule else synthetic_workload(batch, context, output)).requests
    steps: list[tuple[str, float, float, float]] = []
    inner = GPUStepper.run_step
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = cProfile.Profile() if python else torch.profiler.profile(activities=activities, with_stack=stacks)
    start, stop = (prof.enable, prof.disable) if python else (prof.start, prof.stop)

    first: list[int] = []  # index of the first picked step, once known
    warm: list[bool] = []  # per step: the executor's warm-up

    def run_step(self, step):  # records (kind, seconds) of every step, the executor's warm-up first
        if not first and len(steps) >= skip and count and len(step.decodes) >= min_decodes and (
                not min_decodes or not step.prefills):
            first.append(len(steps))
            start()
        picked = bool(first) and first[0] <= len(steps) < first[0] + count
        cost = inner(self, step)
        if picked and len(steps) == first[0] + count - 1:
            stop()  # the step has synchronized: its queued work is in the profile
        kind = step_kind(step)
        steps.append((kind + ("*" if picked else ""), *self.step_times[-1]))
        # the executor's warm-up requests have negative ids: their cold steps stay out of the summary
        warm.append(all(r < 0 for r in [*(d.req_id for d in step.decodes), *(c.state.req_id for c in step.prefills)]))
        return cost

    GPUStepper.run_step = run_step
    if memory:
        memory_report.start_recording()
    try:
        res, extra = run_gpu(requests, policy, spec, mem=mem, sched_cfg=sched,
                             device=device, cuda_graphs=graphs,
                             pipelining=pipelining, prefill_new_pass=prefill_new_pass, stream_slots=stream_slots,
                             stream_chunk_mib=stream_chunk_mib, hbm_prefill=hbm_prefill,
                             no_past_prefill=no_past_prefill)
    except BaseException:
        if memory:
            memory_report.discard()  # raises nothing, so the run's own error shows
        raise
    finally:
        GPUStepper.run_step = inner
    snapshot = memory_report.stop_recording() if memory else None
    what = f"schedule {schedule} ({len(requests)} requests)" if schedule else f"context {context} batch {batch} output {output}"
    print(f"== {system} {model} {what}: {res.steps} steps, "
          f"{res.duration_s:.2f} s engine time, TPOT {res.metrics['mean_tpot_ms']:.1f} ms, "
          f"GPU {res.gpu_mem_bytes / 1e9:.1f} GB, link read {res.traffic.link_read_bytes / 1e9:.1f} GB, {extra}")
    if len(steps) > 60:
        print(f"(the executor's {sum(warm)} warm-up steps left out)")
        print("\n".join(step_summary([st for st, w in zip(steps, warm, strict=True) if not w])))
        # the cost model's run of the same requests, per class: where the simulation beside a row is optimistic
        sim: list[tuple[str, float]] = []
        res_sim = simulate(requests, policy, spec, cost_model, mem=mem,
                           sched_cfg=sched, pipelining=pipelining, stream_slots=stream_slots,
                           stream_chunk_mib=stream_chunk_mib, hbm_prefill=hbm_prefill, no_past_prefill=no_past_prefill,
                           cuda_graphs=graphs, on_step=lambda step, cost: sim.append((step_kind(step), cost.time_s)))
        print(f"simulated ({hardware} cost model, same requests): {res_sim.steps} steps, "
              f"{res_sim.duration_s:.2f} s engine time, TPOT {res_sim.metrics['mean_tpot_ms']:.1f} ms")
        print("\n".join(simulated_summary(sim)))
    else:
        print("steps (kind: decodes d + prompt tokens p, * = profiled; device ms / host ms to queue the step / "
              "host ms to plan it):",
              ", ".join(f"{k} {t * 1e3:.1f}/{h * 1e3:.1f}/{p * 1e3:.1f}" for k, t, h, p in steps))
    if snapshot is not None:
        print("\n".join(memory_report.report(snapshot, top=rows)))
    if count == 0:
        return
    if not first or len(steps) < first[0] + count:
        print(f"only {len(steps)} steps: no {count} steps to profile from step {skip} on"
              + (f" starting with a decode-only step of >= {min_decodes} decodes" if min_decodes else ""))
        return
    if python:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(rows * 2)
        print(text.getvalue())
        return
    events = prof.key_averages()
    counts = Counter({e.key: e.count for e in events if e.key in WATCHED})
    print("host calls:", dict(counts))
    busy = device_busy(prof.events())
    if busy is None or busy["span"] <= 0:
        print("device busy: no device work in the picked steps")
    else:
        pct = {k: 100 * v / busy["span"] for k, v in busy.items() if k != "span"}
        print(f"device busy over {busy['span']:.1f} ms of the picked steps: host-to-device copies {busy['h2d']:.1f} ms "
              f"({pct['h2d']:.0f}%), kernels {busy['kernels']:.1f} ms ({pct['kernels']:.0f}%), both at once "
              f"{busy['both']:.1f} ms ({pct['both']:.0f}%)")
    gaps = copy_gaps(prof.events())
    if gaps is not None:
        print(f"copy engine idle gaps >= 20 us between its copies: {gaps['count']}, {gaps['total']:.2f} ms in all; "
              "longest (at ms, us, last device op to end in it, host call at its start, host call at its end):")
        for at, us, dev, h0, h1 in gaps["top"]:
            print(f"  {at:8.2f} {us:7.0f}  {dev[:50]} | {h0[:40]} | {h1[:40]}")
    if stacks:
        print_blocking_stacks(prof.events(), rows=rows)
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    print(events.table(sort_by="self_device_time_total" if hasattr(events[0], "self_device_time_total")
                       else "self_cuda_time_total", row_limit=rows))


def slot_count(value: str) -> int | str:
    """--stream-slots: an int, or the string itself for resolve_stream_slots to take ("auto") or refuse by name."""
    try:
        return int(value)
    except ValueError:
        return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=SYSTEMS, required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--variant", default="tiled")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--output", type=int, default=4)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--skip", type=int, default=8, help="steps (warm-up included) to run before profiling")
    ap.add_argument("--count", type=int, default=2, help="steps to profile (0: none, only the step times)")
    ap.add_argument("--min-decodes", type=int, default=0,
                    help="start profiling at the first decode-only step of at least this many decodes after --skip")
    ap.add_argument("--schedule", help="replay a rate sweep's saved schedule (schedules/*.parquet of its run) instead "
                    "of --context / --batch / --output; more than 60 steps print as per-class statistics")
    ap.add_argument("--hardware", default="h200-pcie5",
                    help="hardware spec of the cost model run beside a long replay (per-class model step times)")
    ap.add_argument("--device", choices=DEVICES, default="auto",
                    help="where to serve: auto is the GPU where one is visible, else the CPU")
    ap.add_argument("--memory", action="store_true", help="record the allocator's history and print GPU memory by the "
                    "code that allocated it (reserved segments, tensors at the allocated peak)")
    ap.add_argument("--python", action="store_true", help="cProfile the picked steps (host time per Python function)")
    ap.add_argument("--stacks", action="store_true",
                    help="record Python stacks and print the longest blocking host calls with their callers")
    ap.add_argument("--graphs", action="store_true", help="the dense layer parts as CUDA graphs (executor.cuda_graphs)")
    ap.add_argument("--pipelined", action="store_true", help="directkv's two-half steps (executor.directkv_pipelined)")
    ap.add_argument("--side-ctas", type=int, default=DEFAULT_DIRECTKV_SIDE_CTAS,
                    help="CTAs per side-stream kernel (executor.directkv_side_ctas; 0: the kernel's own plan)")
    ap.add_argument("--min-kv-mb", type=float, default=DEFAULT_PIPELINE_MIN_KV_MB,
                    help="host K/V MB per layer below which a step is not cut (executor.directkv_pipeline_min_kv_mb)")
    ap.add_argument("--no-mixed", action="store_true",
                    help="cut decode-only steps only (executor.directkv_pipeline_mixed=false)")
    ap.add_argument("--prefill-new-pass", choices=NEW_PASSES, default="kernel",
                    help="a tiled prompt chunk's new tokens: our kernel or FlashAttention-2 (executor.prefill_new_pass)")
    ap.add_argument("--stream-slots", type=slot_count, default=STREAM_SLOTS_AUTO,
                    help="directkv stream's rings' HBM in slots of 32 MiB, or auto by the model's K/V bytes per "
                         "token (executor.directkv_stream_slots)")
    ap.add_argument("--stream-chunk-mib", type=int, default=SERVING_STREAM_CHUNK_MIB,
                    help="MiB of K per slot of its decode ring (executor.directkv_stream_chunk_mib)")
    ap.add_argument("--hbm-prefill", choices=HBM_PREFILLS, default="kernel",
                    help="a prompt chunk over HBM pages (hbm, the staged systems): our tiled kernel or SDPA "
                         "(executor.hbm_prefill)")
    ap.add_argument("--no-past-prefill", choices=NO_PAST_PREFILLS, default=DEFAULT_NO_PAST_PREFILL,
                    help="directkv's prompt chunks with no past: its kernel or SDPA (executor.directkv_no_past_prefill)")
    a = ap.parse_args(argv)
    try:
        slots = resolve_stream_slots(a.stream_slots, get_model(a.model).kv_bytes_per_token_per_layer(), "--stream-slots")
        profile(a.system, model=a.model, variant=a.variant, context=a.context, batch=a.batch, output=a.output,
                max_batched_tokens=a.max_batched_tokens, rows=a.rows, skip=a.skip, count=a.count, graphs=a.graphs,
                pipelining=Pipelining(a.pipelined, a.side_ctas or None, a.min_kv_mb, not a.no_mixed), python=a.python,
                stacks=a.stacks, schedule=a.schedule, min_decodes=a.min_decodes, hardware=a.hardware,
                prefill_new_pass=a.prefill_new_pass, stream_slots=slots,
                stream_chunk_mib=a.stream_chunk_mib, hbm_prefill=a.hbm_prefill, no_past_prefill=a.no_past_prefill,
                memory=a.memory, device=a.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
