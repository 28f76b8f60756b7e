"""JIT build of the native ops: one pybind11 module per op, cached on disk.

Each op `X` is `csrc/ops/X.cu` (launcher: checks, dtype dispatch, stream) plus `csrc/bindings/X.cpp`
(the pybind11 module `_dkv_X`), both including kernels from `csrc/include/directkv/`. Modules take raw
device pointers and sizes, so they are built with nvcc and pybind11 alone: no torch headers, which keeps a
build to seconds and makes the same sources work under any torch version. A host-only op (CPU code, no
CUDA) has `csrc/ops/X.cpp` instead and is built by the host C++ compiler with OpenMP and -march=native.

The cache key hashes every source and header, the flags, the GPU arch, the compiler's version and the Python
ABI (and the CPU model for host ops), so a second run loads the cached `.so` without rebuilding and any
change rebuilds.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

from directkv.hostinfo import cpu_name, cpuinfo_field

REPO = Path(__file__).resolve().parents[3]
CSRC = REPO / "csrc"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler", "-fPIC"]
# host ops: built on the machine that runs them, so -march=native is safe (the CPU model is in the key)
CXX_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-march=native"]
_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}


class BuildError(RuntimeError):
    pass


def nvcc_path() -> str:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    raise BuildError("nvcc not found: set NVCC or put CUDA's bin/ on PATH")


def cxx_path() -> str:
    for cand in (os.environ.get("CXX"), shutil.which("c++"), shutil.which("g++")):
        if cand and (Path(cand).exists() or shutil.which(cand)):
            return cand
    raise BuildError("no C++ compiler found: set CXX or install g++")


def is_host_op(op: str) -> bool:
    """True for a CPU-only op (csrc/ops/<op>.cpp), built without nvcc."""
    return (CSRC / "ops" / f"{op}.cpp").exists()


def can_build(op: str) -> bool:
    """Whether this machine has the compiler `op` needs (nvcc for CUDA ops, a C++ compiler for host ops)."""
    try:
        _compiler(op)
    except BuildError:
        return False
    return True


def _compiler(op: str) -> str:
    return cxx_path() if is_host_op(op) else nvcc_path()


def _flags(op: str) -> list[str]:
    return CXX_FLAGS if is_host_op(op) else NVCC_FLAGS + ARCH_FLAGS


def cache_dir() -> Path:
    root = os.environ.get("DIRECTKV_CACHE", str(Path.home() / ".cache" / "directkv" / "cuda"))
    return Path(root)


def _sources(op: str) -> list[Path]:
    srcs = [CSRC / "ops" / f"{op}.{'cpp' if is_host_op(op) else 'cu'}", CSRC / "bindings" / f"{op}.cpp"]
    missing = [str(s) for s in srcs if not s.exists()]
    if missing:
        raise BuildError(f"op {op!r} has no sources {missing}; ops: {', '.join(available_ops())}")
    return srcs


def available_ops() -> list[str]:
    launchers = [*(CSRC / "ops").glob("*.cu"), *(CSRC / "ops").glob("*.cpp")]
    return sorted(p.stem for p in launchers if (CSRC / "bindings" / f"{p.stem}.cpp").exists())


def _includes() -> list[str]:
    import pybind11

    return [f"-I{CSRC / 'include'}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]


def _key(op: str, compiler: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    files = sorted((CSRC / "include").rglob("*")) + _sources(op)
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(CSRC)).encode())
            h.update(f.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
    if is_host_op(op):
        h.update((cpu_name() + (cpuinfo_field("flags") or "")).encode())
    h.update(" ".join(flags).encode())
    h.update(sys.implementation.cache_tag.encode())
    return h.hexdigest()[:16]


def compile_commands(op: str, out: Path, *, compile_only: bool = False) -> list[list[str]]:
    """The compiler command lines that build `op` into `out` (object files only when compile_only): nvcc for
    CUDA ops, the host C++ compiler for host ops."""
    compiler, flags = _compiler(op), _flags(op)
    base = [compiler, *flags, *_includes()]
    objs = [out.with_suffix(f".{i}.o") for i in range(2)]
    cmds = [[*base, "-c", str(src), "-o", str(obj)] for src, obj in zip(_sources(op), objs, strict=True)]
    if not compile_only:
        link = ["-fopenmp"] if is_host_op(op) else ARCH_FLAGS
        cmds.append([compiler, *link, "-shared", *map(str, objs), "-o", str(out)])
    return cmds


def build(op: str, *, verbose: bool = False) -> Path:
    """Build (or find in the cache) the shared object of `op`; returns its path."""
    ext = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = cache_dir() / f"{op}-{_key(op, _compiler(op), _flags(op))}" / f"_dkv_{op}{ext}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    for cmd in compile_commands(op, tmp):
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise BuildError(f"building {op} failed:\n{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    os.replace(tmp, target)  # atomic: a concurrent builder never loads a half-written module
    return target


def load(op: str) -> ModuleType:
    """Import the pybind11 module of `op`, building it first if needed."""
    with _lock:
        if op not in _loaded:
            path = build(op)
            spec = importlib.util.spec_from_file_location(f"_dkv_{op}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            _loaded[op] = mod
        return _loaded[op]


def build_all(ops: list[str] | None = None, *, jobs: int | None = None) -> dict[str, Path]:
    """Build several ops in parallel (a fresh GPU machine builds everything once, up front)."""
    from concurrent.futures import ThreadPoolExecutor

    ops = ops or available_ops()
    with ThreadPoolExecutor(max_workers=jobs or min(len(ops), os.cpu_count() or 1) or 1) as pool:
        return dict(zip(ops, pool.map(build, ops), strict=True))
