"""Compile-only check of every native op (CUDA ops with nvcc, host ops with the C++ compiler), so a syntax error
never reaches the GPU machine (no GPU needed)."""

from __future__ import annotations

import subprocess

import pytest

from directkv.kernels.cuda import build

WGMMA_SLOW_NOTES = ("wgmma.mma_async instructions are serialized", "warpgroup.wait is injected")


@pytest.mark.parametrize("op", build.available_ops())
def test_op_compiles(op, tmp_path):
    if not build.can_build(op):
        pytest.skip(f"no compiler for {op} on this machine")
    cmds = build.compile_commands(op, tmp_path / f"_dkv_{op}.so", compile_only=True)
    # the launcher and the binding are independent translation units: compile them side by side
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in cmds]
    for cmd, proc in zip(cmds, procs, strict=True):
        log = proc.communicate()[0]
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{log}"
        assert (tmp_path / cmd[-1]).exists()
        # ptxas notes that it serialised wgmma or inserted a full wgmma wait: the math would still be right but
        # lose its overlap (a wait injected at every k step cost the GEMM ~20% before f9e2fff)
        slow = [line for line in log.splitlines() if any(note in line for note in WGMMA_SLOW_NOTES)]
        assert not slow, "\n".join(slow)


def test_ops_found():
    assert {"decode_attention", "prefill_attention", "proj_attention", "gemm_case_study", "probe",
            "cpu_decode_attention"} <= set(build.available_ops())
    assert build.is_host_op("cpu_decode_attention") and not build.is_host_op("decode_attention")
