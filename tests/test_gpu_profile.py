"""The serving profiler (directkv/engine/gpu/profile.py): its options, its step timings and summaries, and the
analyses of torch.profiler events it prints (device busy time, copy-engine gaps, blocking host calls). The
end-to-end runs use the tiny model on the CPU."""

import re

import pytest
import torch

CPU = ["--device", "cpu"]  # served on the CPU wherever the tests run, a machine with a GPU included


def test_profiler_refuses_bad_pipelining_in_one_line(capsys):
    from directkv.engine.gpu.profile import main

    assert main(["--system", "directkv", "--pipelined", "--min-kv-mb", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: executor.directkv_pipeline_min_kv_mb must be a number >= 0; got -1.0"]
    assert main(["--system", "swap", "--python", "--stacks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stacks" in err[0] and "--python" in err[0]


def test_profiler_python_mode_attributes_host_time_of_the_picked_steps(capsys):
    from directkv.engine.gpu.profile import main

    assert main([*CPU, "--system", "directkv", "--model", "tiny", "--context", "64", "--batch", "4", "--output", "6",
                 "--skip", "3", "--count", "2", "--python", "--rows", "12"]) == 0
    out = capsys.readouterr().out
    assert "0d+256p*" in out and "4d+0p*" in out  # the picked steps are marked
    # each step's device time beside the host's time to queue it, which on the CPU is nearly all of it
    times = [tuple(map(float, t.split("/"))) for t in re.findall(r"\dp\*? (\d+\.\d/\d+\.\d)", out)]
    assert len(times) >= 6 and all(0 < h <= t + 0.1 for t, h in times)
    # paths.py's attend ranks ~5th by cumulative time on the CPU, level with its neighbours: 12 rows (24 entries),
    # not 5, so its rank's jitter under load does not fail the test (it did with two suites on two cores)
    assert "Ordered by: cumulative time" in out and "paths.py" in out and "(attend)" in out
    # --min-decodes: the profile starts at the first decode-only step of >= 4 decodes, not at step --skip
    assert main([*CPU, "--system", "directkv", "--model", "tiny", "--context", "64", "--batch", "4", "--output", "6",
                 "--skip", "0", "--count", "1", "--min-decodes", "4", "--python", "--rows", "5"]) == 0
    kinds = re.findall(r"(\d+d\+\d+p\*?) \d", capsys.readouterr().out)
    assert [k for k in kinds if k.endswith("*")] == ["4d+0p*"] and kinds.index("4d+0p*") > 0


def test_device_busy_merges_each_kind_and_measures_their_overlap():
    """The profiler's device-busy summary: host-to-device copies and other device work each merged over
    overlapping intervals (and streams), their overlap counted once, CPU events ignored; None without device
    events."""
    from types import SimpleNamespace

    from directkv.engine.gpu.profile import device_busy

    def ev(name, start, end, kind=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))

    events = [ev("Memcpy HtoD (Pinned -> Device)", 0, 400), ev("Memcpy HtoD (Pinned -> Device)", 300, 1000),
              ev("Memcpy HtoD (Pinned -> Device)", 2000, 2500), ev("decode_attention_kernel", 900, 1200),
              ev("Memcpy DtoD (Device -> Device)", 1100, 1300), ev("nvjet_gemm", 2400, 3000),
              ev("aten::mm", -500, 5000, torch.autograd.DeviceType.CPU)]
    busy = device_busy(events)
    assert busy == pytest.approx({"span": 3.0, "h2d": 1.5, "kernels": 1.0, "both": 0.2})  # us -> ms
    assert device_busy([ev("aten::mm", 0, 1, torch.autograd.DeviceType.CPU)]) is None


def test_copy_gaps_finds_the_copy_engines_idle_time_and_what_host_and_device_did_then():
    """copy_gaps: gaps between merged host-to-device copies of >= min_us only, longest first, each with the
    device op that ended last before the copies restarted and the innermost host call over its start and end;
    None without copies."""
    from types import SimpleNamespace

    from directkv.engine.gpu.profile import copy_gaps

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, kind=cuda):
        return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))

    h2d = "Memcpy HtoD (Pinned -> Device)"
    events = [ev(h2d, 0, 100), ev(h2d, 90, 200), ev(h2d, 210, 300), ev(h2d, 400, 500), ev(h2d, 1500, 1600),
              ev("decode_attention_kernel", 250, 350), ev("merge", 360, 380),
              ev("run_step", 0, 2000, cpu), ev("cudaStreamSynchronize", 390, 1450, cpu),
              ev("aten::item", 1400, 1420, cpu),
              ev("plan_stream", 1450, 1550, cpu)]
    gaps = copy_gaps(events, min_us=20)
    assert gaps["count"] == 2 and gaps["total"] == pytest.approx(1.1)  # 300-400 and 500-1500; 200-210 is too short
    assert gaps["top"] == [(0.5, 1000, "merge", "cudaStreamSynchronize", "plan_stream"),
                           (0.3, 100, "merge", "run_step", "cudaStreamSynchronize")]
    assert copy_gaps(events, min_us=5)["count"] == 3
    assert copy_gaps([ev("merge", 0, 1)]) is None


def test_print_blocking_stacks_lists_the_longest_blocking_host_calls_with_our_frames(capsys):
    from types import SimpleNamespace

    from directkv.engine.gpu.profile import print_blocking_stacks

    def ev(name, start, end, stack=()):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CPU, stack=list(stack),
                               time_range=SimpleNamespace(start=start, end=end))

    print_blocking_stacks([ev("cudaMemcpyAsync", 0, 50, ["torch/x.py(1): f", "directkv/a.py(3): g"]),
                           ev("aten::item", 0, 900, ["directkv/b.py(7): h"]), ev("aten::mm", 0, 5000),
                           ev("cudaStreamSynchronize", 0, 10)], rows=5)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 3 and "aten::item" in lines[0] and "directkv/b.py(7): h" in lines[0]
    assert "cudaMemcpyAsync" in lines[1] and "directkv/a.py(3): g" in lines[1] and "torch/x.py" not in lines[1]
    assert "cudaStreamSynchronize" in lines[2] and "(no Python frames)" in lines[2]  # runtime calls carry no stack


def test_profiler_replays_a_saved_schedule_and_summarises_long_runs(tmp_path, capsys):
    """--schedule serves a rate sweep's saved requests (here 3 synthetic ones at spread arrivals); --count 0
    profiles nothing and prints only the step times. A run of more than 60 steps prints per-class statistics
    instead, whose counts add up to the steps."""
    from directkv.engine.gpu.profile import main, simulated_summary, step_summary
    from workloads import save_schedule, synthetic_workload, with_arrivals

    path = save_schedule(with_arrivals(synthetic_workload(3, 40, 5), 50.0), tmp_path / "s.parquet")
    assert main([*CPU, "--system", "swap", "--model", "tiny", "--schedule", str(path), "--count", "0"]) == 0
    out = capsys.readouterr().out
    assert f"schedule {path} (3 requests)" in out and "steps (kind" in out and "host calls" not in out
    assert main([*CPU, "--system", "swap", "--model", "tiny", "--schedule", str(tmp_path / "none.parquet")]) == 2
    assert "schedule file not found" in capsys.readouterr().err
    # a run of more than 60 steps: per-class lines, whose counts add up to the steps but the executor's warm-up
    long = save_schedule(with_arrivals(synthetic_workload(2, 30, 70), 50.0), tmp_path / "long.parquet")
    assert main([*CPU, "--system", "swap", "--model", "tiny", "--schedule", str(long), "--count", "0"]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r": (\d+) steps,", out).group(1))
    warm = int(re.search(r"the executor's (\d+) warm-up steps left out", out).group(1))
    measured, simulated = out.split("simulated (")
    counts = [int(line.split()[-6]) for line in measured.splitlines() if line.startswith(("decode-only", "prompt"))]
    assert warm >= 1 and total > 60 and sum(counts) == total
    # the cost model's run of the same requests beside it, per class: counts add up to its steps
    sim_total = int(re.search(r"same requests\): (\d+) steps,", simulated).group(1))
    sim_counts = [int(line.split()[-3]) for line in simulated.splitlines()
                  if line.startswith(("decode-only", "prompt"))]
    assert simulated.startswith("h200-pcie5 cost model") and sum(sim_counts) == sim_total > 0
    assert main([*CPU, "--system", "swap", "--model", "tiny", "--schedule", str(long), "--hardware", "h300"]) == 2
    assert "unknown hardware 'h300'" in capsys.readouterr().err
    steps = ([("4d+0p", 0.010, 0.004, 0.001)] * 50 + [("20d+0p*", 0.030, 0.029, 0.003)] * 5
             + [("3d+300p", 0.050, 0.020, 0.002)] * 7)
    lines = step_summary(steps)
    rows = {line[:22].strip(): line.split()[-6:] for line in lines[1:]}
    assert set(rows) == {"decode-only 1-8", "decode-only 17-32", "prompt > 256 tokens"}
    assert rows["decode-only 17-32"] == ["5", "30.0", "29.0", "3.0", "5", "0.15"]
    assert rows["decode-only 1-8"] == ["50", "10.0", "4.0", "1.0", "0", "0.50"]
    assert sum(int(r[0]) for r in rows.values()) == len(steps)
    sim = {line[:22].strip(): line.split()[-3:] for line in simulated_summary([(k, d) for k, d, _, _ in steps])[1:]}
    assert sim == {k: [v[0], v[1], v[-1]] for k, v in rows.items()}  # same steps: the device columns
