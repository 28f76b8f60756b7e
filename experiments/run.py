"""Entry point: `python -m experiments.run +exp=NAME [overrides]` (Hydra; `-m` for multirun).

Bad names and values end in one line on stderr and exit code 2, before or inside Hydra, never a traceback.
"""

from __future__ import annotations

import importlib
import logging
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
    if not any(a in ("-m", "--multirun") for a in argv):
        _compose_check([a for a in argv if not a.startswith("-")])


def _compose_check(overrides: list[str]) -> None:
    """Compose the config once so an unknown key or a malformed value is one line, not Hydra's report."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            compose("config", overrides=overrides)
    except Exception as e:  # noqa: BLE001 - any composition failure is a user error here
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ConfigError(f"bad override: {first}") from None
    finally:
        GlobalHydra.instance().clear()


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

    module = _experiment(cfg.exp_name)
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
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        path = run_experiment(cfg, run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"results: {path}")
    _print_summary(path)


def _print_summary(path: Path) -> None:
    import pandas as pd

    df = pd.read_parquet(path)
    cols = [c for c in ("system", "variant", "op", "dataset", "context_len", "rate", "mode", "status", "tpot_ms",
                        "time_ms", "gpu_mem_gb") if c in df.columns and df[c].notna().any()]
    with pd.option_context("display.width", 160, "display.max_rows", 60, "display.float_format", "{:.3g}".format):
        print(df[cols].to_string(index=False))


if __name__ == "__main__":
    try:
        check_argv(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
