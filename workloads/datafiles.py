"""Locating dataset files: explicit path, then an installed data package, then the bundled samples."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from directkv.errors import ConfigError

DATA_DIR_ENV = "DIRECTKV_DATA_DIR"
# workloads/ sits in the repository root; the samples live beside the repository in ../shared/data.
REPO_ROOT = Path(__file__).resolve().parent.parent


def package_file(package: str, relative: str) -> Path | None:
    """A file inside an installed package, found without importing the package (its import may fail)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    return None


def sample_candidates(subdir: str, filename: str) -> list[Path]:
    """Where a bundled sample may be: ``$DIRECTKV_DATA_DIR/<subdir>/`` first, then ``../shared/data/``."""
    roots = []
    if os.environ.get(DATA_DIR_ENV):
        roots.append(Path(os.environ[DATA_DIR_ENV]).expanduser())
    roots.append(REPO_ROOT.parent / "shared" / "data")
    return [root / subdir / filename for root in roots]


def find_sample(subdir: str, filename: str) -> Path | None:
    """The first existing ``sample_candidates`` file, or None."""
    return next((p for p in sample_candidates(subdir, filename) if p.is_file()), None)


def resolve_data_file(
    dataset: str,
    path: str | os.PathLike | None,
    *,
    package: tuple[str, str] | None,
    sample: tuple[str, str],
    hint: str,
) -> Path:
    """Pick the file a loader reads.

    Parameters
    ----------
    dataset : str
        Name used in error messages (``"ShareGPT"``).
    path : str | PathLike | None
        User-given file; when set it is the only place looked at.
    package : (package_name, relative_path) | None
        Data package to look in next, located with ``find_spec`` without importing it.
    sample : (subdir, filename)
        Bundled sample, looked for by ``sample_candidates``.
    hint : str
        How the user gets the data, appended to the not-found message.

    Returns
    -------
    Path
        Absolute path of an existing file.
    """
    if path is not None:
        explicit = Path(path).expanduser()
        if not explicit.is_file():
            raise ConfigError(f"{dataset} file not found: {str(explicit)!r}")
        return explicit.resolve()
    looked: list[str] = []
    if package is not None:
        found = package_file(*package)
        if found is not None:
            return found.resolve()
        looked.append(f"package {package[0]} ({package[1]})")
    for candidate in sample_candidates(*sample):
        if candidate.is_file():
            return candidate.resolve()
        looked.append(str(candidate))
    raise ConfigError(f"no {dataset} data found; looked in: {'; '.join(looked)}; {hint}")


def file_key(path: Path) -> tuple[str, int, int]:
    """Cache key that changes when the file is rewritten in place."""
    st = path.stat()
    return (str(path), st.st_mtime_ns, st.st_size)
