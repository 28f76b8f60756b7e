"""Entry point: `python -m experiments.run +exp=NAME [overrides]` (Hydra; `-m` for multirun).

Bad names and values end in one line on stderr and exit code 2, before or inside Hydra, never a traceback.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from directkv.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("exp", "model", "hardware", "system", "workload")
log = logging.getLogger("directkv")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def check_argv(argv: list[str]) -> None:
    """Validate config-group choices up front so a typo gets one line listing the valid names."""
    chosen_exp = False
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.lstrip("+~").split("=", 1)
        if key not in GROUPS:
            continue
        chosen_exp |= key == "exp"
        valid = group_options(key)
        for v in value.split(","):
            if v not in valid:
                raise ConfigError(f"unknown {key} {v!r}; valid: {', '.join(valid)}")
    if not chosen_exp and not any(a in ("--help", "-h", "--cfg", "-c", "--info") for a in argv):
        raise ConfigError(f"choose an experiment with +exp=NAME; valid: {', '.join(group_options('exp'))}")
    overrides = [a for a in argv if not a.startswith("-")]
    parsed = _parse(overrides)
    for o in parsed:
        if o.key_or_group == "results_root":
            for root in _values(o):
                _check_results_root(root)
    if parsed and any(a in ("-m", "--multirun") for a in argv):  # a sweep's first value stands for it: same keys
        overrides = [f"{o.get_key_element()}={_values(o)[0]}" if o.is_sweep_override() and _values(o) else o.input_line
                     for o in parsed]
    _compose_check(overrides)


def _parse(overrides: list[str]) -> list:
    """The overrides as Hydra's own parser reads them (sweeps `a,b`, `range(...)`, `choice(...)` included); [] for a
    malformed line, which _compose_check then reports in one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - reported by _compose_check
        return []


def _values(o) -> list[str]:
    """A parsed override's values: a sweep's, or its one value."""
    return list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]


def _check_results_root(root: str) -> None:
    """Hydra makes the run folder before any of our code runs: a root it cannot make is refused here, in one line
    (as Hydra takes it: `~` is not expanded)."""
    path = Path(root).absolute()
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        raise ConfigError(f"results_root {root!r} lies under {str(path)!r}, a file, not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"results_root {root!r}: cannot write under {str(path)!r}")


def _compose_check(overrides: list[str]) -> None:
    """Compose the config once so an unknown key or a malformed value is one line, not Hydra's report."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            compose("config", overrides=overrides)
    except Exception as e:  # noqa: BLE001 - any composition failure is a user error here
        text = str(e)
        unknown = re.match(r"Could not override '([^']+)'", text)
        if unknown:
            others = [o for o in overrides if o.split("=")[0] != unknown.group(1)]
            raise ConfigError(_unknown_key(unknown.group(1), others)) from None
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
        raise ConfigError(f"bad override: {first}") from None
    finally:
        GlobalHydra.instance().clear()
    added = [o.split("=")[0] for o in overrides if o.startswith("+") and not o.startswith("+exp=")]
    if added:  # `+key=value` makes a key no experiment reads: a typo would be dropped silently
        raise ConfigError(f"{added[0]} adds a key no experiment reads; set an existing key without '+' "
                          f"(only +exp=NAME adds one)")


def _unknown_key(key: str, others: list[str]) -> str:
    """The one-line error for an override of a key the config lacks: its closest names and the keys at its level."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            node = compose("config", overrides=others)
        for part in filter(None, parent.split(".")):
            node = node[part]
        valid = sorted(str(k) for k in OmegaConf.to_container(node, resolve=False) if k != "hydra")
    except Exception:  # noqa: BLE001 - the key's parent is itself unknown: name the key alone
        return f"unknown config key {key!r}"
    finally:
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
    near = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" (did you mean {(parent + '.' if parent else '') + near[0]!r}?)" if near else ""
    return f"unknown config key {key!r}{hint}; keys{' of ' + parent if parent else ''}: {', '.join(valid)}"


def _experiment(name: str):
    valid = group_options("exp")
    if name not in valid:
        raise ConfigError(f"unknown exp {name!r}; valid: {', '.join(valid)}")
    return importlib.import_module(f"experiments.{name}")


def run_experiment(cfg: DictConfig, run_dir: Path) -> Path:
    """Run one configured experiment into `run_dir`; returns the results path. Raises ConfigError."""
    from directkv.device import resolve_device
    from directkv.results import ResultsWriter
    from experiments.common import plain
    from experiments.kernel_bench import check_counters

    module = _experiment(cfg.exp_name)
    check_counters(cfg)  # every experiment: a typo, or ncu where no kernel row is profiled, is not dropped silently
    device = resolve_device(cfg.device)
    extra = {"device": device}
    from dataclasses import asdict

    from directkv.costmodel import CALIBRATION, HOST_CALIBRATION, calibration_for

    extra["cost_model"] = {"efficiency": asdict(calibration_for(cfg.hardware.name)),
                           "calibrated": cfg.hardware.name in CALIBRATION,
                           "host_time": {k: asdict(v) for k, v in HOST_CALIBRATION.get(cfg.hardware.name, {}).items()}}
    writer = ResultsWriter(run_dir, exp=cfg.exp_name, config=plain(cfg), extra=extra)
    module.run(cfg, writer)
    path = writer.finish()
    if cfg.get("render", True):
        from plots.render import render_run

        try:
            for fig in render_run(run_dir):
                log.info("figure: %s", fig)
        except Exception as e:  # noqa: BLE001 - the results are on disk; a figure must not end a multirun
            log.error("figures not rendered (%s: %s); the results are in %s: python -m plots.render %s",
                      type(e).__name__, str(e)[:200], path, run_dir)
    return path


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.types import RunMode

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        run_dir = _sweep_job_dir(run_dir, cfg)
    fresh = not (run_dir / "manifest.json").exists()  # else an earlier run's folder: never dropped below
    try:
        path = run_experiment(cfg, run_dir)
    except ConfigError as e:
        if fresh:
            _drop_empty_run(run_dir)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"results: {path}")
    _print_summary(path)


def _sweep_job_dir(positional: Path, cfg: DictConfig) -> Path:
    """A multirun job's folder. Hydra numbers a sweep's folders by position (`{run_id}-N`); a sweep resumed with its
    values in another order, or with values added or dropped, would meet other jobs' rows there. So a job takes the
    sweep folder whose rows its own config wrote, else one its config began without writing a row, else its
    positional folder unless rows are there, else the next free number. A folder is this job's only where its
    manifest names this run_id too: a single run named `{run_id}-5` is not the sweep's. The job's log file (Hydra's,
    opened in the positional folder) follows it."""
    from directkv.results import config_diff, manifest_config
    from experiments.common import plain

    config = plain(cfg)
    # Its last part, matched as a plain prefix: a run_id with `/` puts the sweep's folders deeper, and one with
    # `[`, `*` or `?` would be a glob pattern that misses them.
    prefix = Path(f"{config['run_id']}-").name
    folder = positional.parent
    numbered = {}
    for p in folder.iterdir() if folder.is_dir() else ():
        num = p.name[len(prefix):]
        # not str.isdigit: it takes superscripts, which int() refuses
        if p.name.startswith(prefix) and re.fullmatch(r"\d+", num, re.ASCII) and p.is_dir():
            numbered[int(num)] = p
    if positional not in numbered.values():
        return positional

    def rows(p: Path) -> bool:
        return (p / "results.parquet").exists()

    def ours(p: Path) -> bool:
        old = manifest_config(p)
        return old is not None and old.get("run_id") == config["run_id"] and not config_diff(old, config)

    ordered = [p for _, p in sorted(numbered.items())]
    owned = [p for p in ordered if rows(p) and ours(p)] or [p for p in ordered if not rows(p) and ours(p)]
    if (owned and owned[0] == positional) or (not owned and not rows(positional)):
        return positional
    chosen = owned[0] if owned else folder / f"{prefix}{max(numbered, default=-1) + 1}"
    _move_log(positional, chosen)
    _drop_unused_job_dir(positional)
    if not owned:
        why = f"a new folder {chosen} (its positional folder holds another configuration's rows)"
    elif rows(chosen):
        why = f"resuming the rows its configuration wrote in {chosen}"
    else:
        why = f"resuming its configuration's earlier run in {chosen}, which wrote no rows"
    log.info("multirun job %s: %s", positional.name, why)
    return chosen


def _drop_unused_job_dir(positional: Path) -> None:
    """Remove the positional folder a multirun job moved away from when it holds nothing but Hydra's log, just opened
    and empty; an earlier attempt's manifest or log, even without rows, stays (unlike _drop_empty_run's fresh run)."""
    log_file = positional / "run.log"
    if [p.name for p in positional.iterdir()] == ["run.log"] and log_file.is_file() and not log_file.stat().st_size:
        log_file.unlink()
        positional.rmdir()


def _move_log(old: Path, new: Path) -> None:
    """Point the file handlers writing into `old` (Hydra's job log) at the same file name in `new` (appended)."""
    new.mkdir(parents=True, exist_ok=True)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == old:
            h.close()  # a closed handler in mode "a" reopens its (new) file at its next record
            h.baseFilename = str(new / Path(h.baseFilename).name)


# What a run refused before its first row has written into its fresh folder: its manifest and Hydra's log.
EMPTY_RUN_FILES = frozenset({"manifest.json", "manifest.json.tmp", "run.log"})


def _drop_empty_run(run_dir: Path) -> None:
    """Remove the fresh run folder of a refused run when it holds nothing but EMPTY_RUN_FILES (the experiment folder
    above it stays)."""
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - EMPTY_RUN_FILES:
        return
    for name in EMPTY_RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    run_dir.rmdir()


# Columns that tell a run's rows apart, then its measures, in the order the summary prints them.
SUMMARY_COLS = ("system", "variant", "op", "dataset", "m", "context_len", "batch", "batch_size", "q_len", "page_order",
                "rate", "mode", "status", "tpot_ms", "time_ms", "gpu_mem_gb")


def _print_summary(path: Path) -> None:
    import pandas as pd

    if not path.exists():  # a run whose points all wrote nothing
        print("(no rows)")
        return
    df = pd.read_parquet(path)
    cols = [c for c in SUMMARY_COLS if c in df.columns and df[c].notna().any()]
    df = df[cols].copy()
    for c in cols:  # sizes and counts print whole (32640 and 32768 apart), measures to 3 significant digits
        if pd.api.types.is_float_dtype(df[c]) and df[c].dropna().apply(float.is_integer).all():
            df[c] = df[c].astype("Int64")
    with pd.option_context("display.width", 160, "display.max_rows", 60, "display.float_format", "{:.3g}".format):
        print(df.to_string(index=False))


if __name__ == "__main__":
    try:
        check_argv(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
