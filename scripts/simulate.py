"""Run a preset as a Flower local simulation (``flwr run .`` on a simulation SuperLink) and check it.

    hybridfl run --mode simulation [PRESET] [KEY=VALUE ...]   (= python -m scripts.simulate [KEY=VALUE ...])

Without a ``preset`` it runs the main job, :data:`MAIN_JOB` (README command (1)); with
``resume="<run folder>"`` it continues that run from its checkpoint.
KEY=VALUE pairs are run-config overrides with ``flwr run -c`` syntax (TOML values; strings quoted).
The script validates the config first (a bad key fails here, naming key, value and what is
allowed), starts a simulation SuperLink on free loopback ports with a project-local FLWR_HOME,
runs ``flwr run . --stream`` with one simulated SuperNode per client (1 CPU each), checks that the
run *finished:completed* and wrote ``summary.json``, and stops exactly the processes it started.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from scripts.flower import (
    PROJECT_DIR,
    ProcessGroup,
    check_completed,
    flower_env,
    flwr_run,
    free_port,
    wait_healthy,
    write_connection,
)
from server_app.config import load_config
from server_app.outputs import run_dir

CONNECTION = "hybridfl-sim"
MAIN_JOB = "feddle-digits"  # README command (1): Feddle-ID on digits


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict. A value is read as TOML (``3``, ``0.5``, ``true``, ``"x"``, as ``flwr run -c``);
    one that is not TOML is a string, so that ``preset=fedbuff-digits`` works too (``make demo
    ARGS='preset="x"'`` loses its quotes to make's shell)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"bad override {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def prepare(overrides: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """Validate `overrides`, pin an absolute output-dir (a relative one is under the folder this runs in, as
    in-process) and a run-name (or, with ``resume``, the absolute folder of the run to continue); return them and
    the run folder."""
    cfg = load_config(overrides)
    if cfg.resume:
        return {**overrides, "resume": cfg.resume}, Path(cfg.resume)
    out_root = Path(cfg.output_dir).resolve()
    name = run_dir(cfg, out_root).name  # created now, so a parallel run cannot take it
    return {**overrides, "output-dir": str(out_root), "run-name": name}, out_root / name


def client_gpus() -> float:
    """Each simulated client's share of a GPU for Ray: as many clients at once as there are CPUs share one GPU
    (every client's ``device`` is ``auto``, so it trains on the GPU); 0 where torch sees none."""
    import torch

    return round(1 / max(1, os.cpu_count() or 1), 4) if torch.cuda.is_available() else 0.0


def simulate(overrides: dict[str, Any], flwr_home: Path, app_dir: Path = PROJECT_DIR) -> Path:
    """Run the simulation of the Flower app in `app_dir` (default: this project); return the run folder, or raise
    with the reason it failed."""
    overrides, run_path = prepare(overrides)
    cfg = load_config(overrides)
    env = flower_env(flwr_home)
    port = free_port()
    with ProcessGroup(run_path / "flower-logs", env) as procs:
        link = procs.start("superlink", ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
                                         "--host", "127.0.0.1", "--port", str(port)])
        wait_healthy(port, link)
        write_connection(flwr_home, CONNECTION, port)
        federation = (f"num-supernodes={cfg.num_clients} client-resources-num-cpus=1 "
                      f"client-resources-num-gpus={client_gpus()} init-args-num-cpus={max(2, os.cpu_count() or 2)}")
        run_id, status = flwr_run(env, CONNECTION, overrides, federation_config=federation, app_dir=app_dir)
    check_completed(run_id, status, run_path)
    return run_path


def main(argv: list[str] | None = None) -> int:
    """``hybridfl run --mode simulation`` (scripts/cli.py) with `argv`."""
    from scripts.cli import main as cli

    return cli(["run", "--mode", "simulation", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
