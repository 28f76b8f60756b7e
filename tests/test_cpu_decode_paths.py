"""Every item of the CPU decode attention kernel against float64, on one machine.

The kernel picks its bf16 item when it is compiled: AVX512-BF16 dot products, AVX-512 without them, or the
generic loops. The op the package builds (-march=native) runs only the first the CPU allows, so this test
builds a small checker (tests/cpp/cpu_decode_paths.cpp, its own float64 reference) three times, taking
AVX512-BF16 and then AVX-512 away, and checks each build's items (as each call reports the one it ran) and
errors. Seeded random bf16 inputs, shuffled pages, odd lengths, pages of 7, 16 and 32 tokens, every specialised
(GQA, head_dim) pair plus GQA 16 and head_dim 48, and a large scale (weights far below the running max).
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from directkv.hostinfo import cpuinfo_field
from directkv.kernels.cuda.build import CXX_FLAGS, can_build, cxx_path

REPO = Path(__file__).resolve().parents[1]
CXX = cxx_path() if can_build("cpu_decode_attention") else None
FLAGS = set((cpuinfo_field("flags") or "").split())
BEST = "avx512bf16" if "avx512_bf16" in FLAGS else "avx512f" if "avx512f" in FLAGS else "generic"
BUILDS = [  # (extra flags, the item the specialised cases must take)
    ([], BEST),
    (["-mno-avx512bf16"], "avx512f" if "avx512f" in FLAGS else "generic"),
    (["-mno-avx512f"], "generic"),
]


@pytest.mark.skipif(CXX is None or platform.machine() != "x86_64", reason="needs an x86-64 C++ compiler")
@pytest.mark.parametrize("extra,item", BUILDS, ids=["native", "no-avx512bf16", "no-avx512f"])
def test_every_item_matches_float64(extra, item, tmp_path):
    exe = tmp_path / "paths"
    built = subprocess.run([CXX, *CXX_FLAGS, *extra,
                            f"-I{REPO / 'csrc' / 'include'}", str(REPO / "tests" / "cpp" / "cpu_decode_paths.cpp"),
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    if built.returncode and extra and "unrecognized" in built.stderr:
        pytest.skip(f"this compiler does not take {extra}")
    assert built.returncode == 0, built.stderr[-2000:]
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert len(lines) >= 10 and any(ln.split()[1] == "specialised" for ln in lines), lines
    for line in lines:
        case, kind, ran, err = line.split()
        assert ran == (item if kind == "specialised" else "generic"), line
        assert float(err) < 1e-5, f"{case}: rel. error {err} with {extra or 'native flags'}"
