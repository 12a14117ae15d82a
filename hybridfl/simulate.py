"""Run a preset as a Flower local simulation (``flwr run .`` on a simulation SuperLink) and check it.

    hybridfl run --mode simulation [PRESET] [KEY=VALUE ...]

Without a ``preset`` it runs the main job, :data:`hybridfl.job.MAIN_JOB` (README command (1)); with
``resume="<run folder>"`` it continues that run from its checkpoint.
KEY=VALUE pairs are run-config overrides with ``flwr run -c`` syntax (TOML values; strings quoted).
The script validates the config first (a bad key fails here, naming key, value and what is
allowed), starts a simulation SuperLink on free loopback ports with a project-local FLWR_HOME,
runs ``flwr run . --stream`` with one simulated SuperNode per client (1 CPU each), checks that the
run *finished:completed* and wrote ``summary.json``, and stops exactly the processes it started.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hybridfl.job import prepare
from hybridfl.processes import (
    ProcessGroup,
    check_completed,
    flower_env,
    flwr_run,
    free_port,
    wait_healthy,
    write_connection,
)

CONNECTION = "hybridfl-sim"


def client_gpus() -> float:
    """Each simulated client's share of a GPU for Ray: as many clients at once as there are CPUs share one GPU
    (every client's ``device`` is ``auto``, so it trains on the GPU); 0 where torch sees none."""
    import torch

    return round(1 / max(1, os.cpu_count() or 1), 4) if torch.cuda.is_available() else 0.0


def simulate(overrides: dict[str, Any], flwr_home: Path, app_dir: Path | None = None) -> Path:
    """Run the simulation of the Flower app in `app_dir` (default: hybridfl's own); return the run folder, or raise
    with the reason it failed."""
    overrides, run_path, cfg = prepare(overrides, app_dir)
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
