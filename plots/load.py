"""Reading one run directory (`results.parquet` + `manifest.json`) and finding run directories."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from directkv.errors import ConfigError
from plots.style import MODES, STATUSES

RESULTS_FILE = "results.parquet"
MANIFEST_FILE = "manifest.json"
COMMON_COLUMNS = ("exp", "system", "variant", "model", "hardware", "mode", "status")


def find_run_dirs(root: Path) -> list[Path]:
    """Run directories at or below `root`: `root` itself if it holds results.parquet, else every
    directory below it that does, sorted. Raises ConfigError if there is none."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"results directory {str(root)!r} does not exist or is not a directory")
    if (root / RESULTS_FILE).is_file():
        return [root]
    runs = sorted(p.parent for p in root.rglob(RESULTS_FILE) if p.is_file())
    if not runs:
        raise ConfigError(f"no {RESULTS_FILE} found in or below {str(root)!r}")
    return runs


def load_run(run_dir: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Rows and manifest of one run, validated against the results contract.

    Returns
    -------
    df : one row per point, with at least COMMON_COLUMNS; `variant` and `error` NaNs become "".
    manifest : the parsed manifest.json.
    """
    run_dir = Path(run_dir)
    results, manifest_path = run_dir / RESULTS_FILE, run_dir / MANIFEST_FILE
    if not results.is_file():
        raise ConfigError(f"{str(results)!r} not found")
    if not manifest_path.is_file():
        raise ConfigError(f"{str(manifest_path)!r} not found (every run writes one beside results.parquet)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(manifest_path)!r} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{str(manifest_path)!r} must hold a JSON object, got {type(manifest).__name__}")
    try:
        df = pd.read_parquet(results)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"cannot read {str(results)!r}: {str(e).splitlines()[0]}") from None
    if df.empty:
        raise ConfigError(f"{str(results)!r} has no rows")
    require_columns(df, COMMON_COLUMNS, str(results))
    df = df.copy()
    for col in ("variant", "error"):
        if col in df:
            df[col] = df[col].fillna("").astype(str)
    _check_values(df, "mode", MODES, str(results))
    _check_values(df, "status", STATUSES, str(results))
    return df, manifest


def run_exp(df: pd.DataFrame, manifest: Mapping[str, Any], where: str) -> str:
    """The experiment name of a run: manifest "exp", which must agree with the rows' `exp` column."""
    in_rows = sorted(df["exp"].dropna().astype(str).unique())
    name = manifest.get("exp")
    if name is None:
        if len(in_rows) != 1:
            raise ConfigError(
                f"{where}: manifest has no 'exp' and rows name {in_rows or 'none'}; need exactly one"
            )
        return in_rows[0]
    if in_rows and in_rows != [name]:
        raise ConfigError(f"{where}: manifest exp {name!r} but rows name {in_rows}")
    return str(name)


def require_columns(df: pd.DataFrame, columns: Iterable[str], where: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ConfigError(
            f"{where}: missing column(s) {', '.join(missing)}; present: {', '.join(df.columns)}"
        )


def _check_values(df: pd.DataFrame, column: str, valid: Iterable[str], where: str) -> None:
    bad = sorted(set(df[column].astype(str)) - set(valid))
    if bad:
        raise ConfigError(f"{where}: unknown {column} {bad[0]!r}; valid: {', '.join(valid)}")


def config_get(manifest: Mapping[str, Any], dotted: str) -> Any:
    """manifest["config"] looked up by a dotted key ("hardware.hbm_budget_gb"), nested or flat; None if absent."""
    node: Any = manifest.get("config") or {}
    if isinstance(node, Mapping) and dotted in node:
        return node[dotted]
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
