"""The one results writer: `results.parquet` (one tidy row per point) and `manifest.json` per run.

Rows are written after every point (atomically), so a sweep that dies keeps what it finished, and
a sweep that is re-run with the same run directory can skip points already done.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from directkv import host_pace
from directkv.errors import ConfigError

REQUIRED = ("exp", "system", "variant", "model", "hardware", "mode", "status")
STANDARD = ("context_len", "rate", "time_ms", "tpot_ms", "ttft_ms", "gpu_mem_gb", "host_pinned_gb",
            "link_read_bytes", "link_write_bytes", "kv_bytes")
MODES = ("measured", "simulated", "projected")
STATUSES = ("ok", "oom", "error")
REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict:
    """Provenance of this process: code version, host (and its pace, host_pace.py), accelerator and library
    versions."""
    import torch

    sha = _run(["git", "rev-parse", "--verify", "-q", "HEAD"])
    env = {
        # a device machine gets a copy of the working tree without history: the caller passes the sha
        "git_sha": os.environ.get("DIRECTKV_GIT_SHA") or (sha if len(sha) == 40 else "unknown"),
        "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "driver": "none",
    }
    if torch.cuda.is_available():
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or "unknown"
    env.update(host_pace.probe())  # how fast this host dispatches: measured steps that wait for it depend on it
    return env


# Config keys a resumed run may change: they shape the console and the figures, not a row.
RESUME_FREE = ("progress", "render", "results_root", "run_id")


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain configs (RESUME_FREE keys at the top level left out)."""
    keys = sorted(set(old) | set(new), key=str)
    out = []
    for k in keys:
        if not prefix and k in RESUME_FREE:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


class ResultsWriter:
    """Collects rows of one run into `run_dir/results.parquet` and keeps `run_dir/manifest.json` current.

    A run directory that already holds rows is resumed (`done` skips its finished points) only under the
    configuration that wrote them; any other configuration is refused before a byte is written, so a
    manifest always describes the rows beside it.
    """

    def __init__(self, run_dir: str | Path, *, exp: str, config: dict, extra: dict | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "results.parquet"
        self.rows: list[dict] = pd.read_parquet(self.path).to_dict("records") if self.path.exists() else []
        old = _read_manifest(self.run_dir) if self.rows else {}
        if self.rows and "config" in old:
            diff = config_diff(old["config"], config)
            if diff:
                raise ConfigError(_refusal(self.run_dir, len(self.rows), diff, old["config"]))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.manifest = {
            "exp": exp,
            "run_id": self.run_dir.name,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "started_at": old.get("started_at", now),
            **({"resumed_at": now} if self.rows else {}),
            "finished_at": None,
            "config": config,
            **environment(),
            **(extra or {}),
        }
        self._write_manifest()

    def done(self, **key) -> bool:
        """True if a row with these column values and status ok/oom exists (resume skips it)."""
        return any(r.get("status") in ("ok", "oom") and all(_same(r.get(k), v) for k, v in key.items())
                   for r in self.rows)

    def forget(self, **key) -> int:
        """Drop the rows with these column values (a point about to be served again: its failed attempt and the
        simulated twin made beside it), rewrite the file, and return how many went."""
        keep = [r for r in self.rows if not all(_same(r.get(k), v) for k, v in key.items())]
        gone = len(self.rows) - len(keep)
        if gone:
            self.rows = keep
            self._write()
        return gone

    def add(self, row: dict) -> dict:
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"result row lacks {missing}")
        if row["mode"] not in MODES or row["status"] not in STATUSES:
            raise ValueError(f"row mode {row['mode']!r} / status {row['status']!r}; valid: {MODES} / {STATUSES}")
        full = {k: float("nan") for k in STANDARD} | {"error": ""} | row
        self.rows.append(full)
        self._write()
        return full

    def _write(self) -> None:
        write_parquet(pd.DataFrame(self.rows), self.path)

    def finish(self, **extra) -> Path:
        modes = sorted({r["mode"] for r in self.rows})
        self.manifest.update(
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            mode=modes[0] if len(modes) == 1 else ("mixed" if modes else "none"),
            rows=len(self.rows),
            statuses={s: sum(r["status"] == s for r in self.rows) for s in STATUSES},
            **extra,
        )
        self._write_manifest()
        return self.path

    def _write_manifest(self) -> None:
        tmp = self.run_dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=2, default=str))
        os.replace(tmp, self.run_dir / "manifest.json")


def _refusal(run_dir: Path, rows: int, diff: list[str], old: dict) -> str:
    """The one line that refuses to resume `run_dir` under another config: which keys differ, which the run predates."""
    def stored(key: str) -> bool:
        node = old
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def names(keys: list[str]) -> str:
        return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    changed, newer = [k for k in diff if stored(k)], [k for k in diff if not stored(k)]
    what = "; ".join(filter(None, [changed and f"{names(changed)} differ",
                                   newer and f"it predates {names(newer)}"]))
    return (f"{run_dir} holds {rows} row{'s' * (rows != 1)} of another configuration ({what}); resume it with the "
            f"overrides and code that wrote it, or choose a new run_id")


def manifest_config(run_dir: str | Path) -> dict | None:
    """The config in run_dir's manifest, rows or not, or None where the manifest is missing, unreadable or has no
    config."""
    manifest = _read_manifest(Path(run_dir))
    config = manifest.get("config") if isinstance(manifest, dict) else None
    return config if isinstance(config, dict) else None


def _read_manifest(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def write_parquet(df: pd.DataFrame, path: Path) -> None:
    """df at `path`, whole or not at all: written beside it, then moved over it (a run cut mid-write keeps the
    previous file, never half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def load_results(run_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    run_dir = Path(run_dir)
    path = run_dir / "results.parquet"
    if not path.exists():
        raise ConfigError(f"no results.parquet in {run_dir}")
    manifest = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").exists() else {}
    return pd.read_parquet(path), manifest
