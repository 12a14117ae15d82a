"""What every launcher runs: the main job, the command line's run-config overrides, and a run's folder pinned
before it starts."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.user_code import import_paths
from hybridfl.launch.bundle import app_config
from server_app.app import user_keys
from server_app.config import RunConfig, load_config
from server_app.outputs import run_dir

MAIN_JOB = "feddle-digits"  # README command (1): Feddle-ID on digits


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict. A value is read as TOML (``3``, ``0.5``, ``true``, ``"x"``, as ``flwr run -c``);
    one that is not TOML is a string, so that ``preset=fedbuff-digits`` works too (``make demo
    ARGS='preset="x"'`` loses its quotes to make's shell)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError("override", pair, "KEY=VALUE", f"bad override {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def app_run_config(overrides: dict[str, Any], app_dir: Path | None = None) -> RunConfig:
    """The configuration the ServerApp of the Flower app in `app_dir` (None: hybridfl's own) builds from `overrides`
    (``flwr run -c``) and that app's own config table (a user's project names its preset there;
    server_app.app.user_keys)."""
    return load_config(user_keys(app_config(app_dir), overrides))


def prepare(overrides: dict[str, Any], app_dir: Path | None = None) -> tuple[dict[str, Any], Path, RunConfig]:
    """Validate `overrides` as the ServerApp of the Flower app in `app_dir` will read them (with that app's own
    config table: a user's project names its preset there), pin an absolute output-dir (a relative one is under the
    folder this runs in, as in-process), an absolute fleet file and a run-name (or, with ``resume``, the absolute
    folder of the run to continue, with the checkpoint's code keys given again: a device runs only the code its run's
    configuration names at the start, and it cannot read the checkpoint; equal values, which a resumed run accepts);
    return them, the run folder and the run's configuration."""
    cfg = app_run_config(overrides, app_dir)
    if cfg.resume:
        return {**import_paths(cfg.to_dict()), **overrides, "resume": cfg.resume}, Path(cfg.resume), cfg
    out_root = Path(cfg.output_dir).resolve()
    name = run_dir(cfg, out_root).name  # created now, so a parallel run cannot take it
    fleet = {"fleet": str(Path(cfg.fleet).resolve())} if cfg.fleet.endswith((".yaml", ".yml")) else {}
    return {**overrides, **fleet, "output-dir": str(out_root), "run-name": name}, out_root / name, cfg
