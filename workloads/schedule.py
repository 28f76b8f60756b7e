"""The exact request schedule as a parquet file, so a GPU run and a simulation replay the same requests.

Columns: req_id (int64), prompt_len (int64), output_len (int64), arrival_s (float64), source (string).
The workload's dataset, path, tokenizer and params travel as JSON in the parquet schema metadata.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from directkv.errors import ConfigError
from workloads.request import Request, Workload

COLUMNS = ("req_id", "prompt_len", "output_len", "arrival_s", "source")
_META_KEY = b"directkv.workload"


def schedule_frame(workload: Workload) -> pd.DataFrame:
    """One row per request, columns ``COLUMNS``."""
    frame = pd.DataFrame([asdict(r) for r in workload.requests], columns=list(COLUMNS))
    return frame.astype(
        {
            "req_id": "int64",
            "prompt_len": "int64",
            "output_len": "int64",
            "arrival_s": "float64",
            "source": str,
        }
    )


def save_schedule(workload: Workload, path: str | os.PathLike) -> Path:
    """Write ``workload`` to ``path`` (parquet); returns the path. Parent folders are created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(schedule_frame(workload), preserve_index=False)
    meta = {
        "dataset": workload.dataset,
        "path": workload.path,
        "tokenizer": workload.tokenizer,
        "params": workload.params,
    }
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META_KEY: json.dumps(meta)})
    pq.write_table(table, out)
    return out


def load_schedule(path: str | os.PathLike) -> Workload:
    """Read a schedule written by ``save_schedule``; the Workload compares equal to the one saved.

    A parquet file with the five columns but no metadata (e.g. written by hand) loads as dataset
    ``"schedule"`` with that file as path.
    """
    src = Path(path).expanduser()
    if not src.is_file():
        raise ConfigError(f"schedule file not found: {str(src)!r}")
    table = pq.read_table(src)
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ConfigError(
            f"{src} is not a request schedule: missing columns {missing}; needs {list(COLUMNS)}"
        )
    raw = (table.schema.metadata or {}).get(_META_KEY)
    meta = json.loads(raw) if raw else {"dataset": "schedule", "path": str(src), "tokenizer": "unknown"}
    frame = table.select(list(COLUMNS)).to_pandas()
    requests = [
        Request(int(r.req_id), int(r.prompt_len), int(r.output_len), float(r.arrival_s), str(r.source))
        for r in frame.itertuples(index=False)
    ]
    return Workload(requests, meta["dataset"], meta["path"], meta["tokenizer"], meta.get("params", {}))
