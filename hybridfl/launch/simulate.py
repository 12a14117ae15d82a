"""Run a preset as a Flower local simulation (``flwr run .`` on a simulation SuperLink) and check it.

    hybridfl run --mode simulation [PRESET] [KEY=VALUE ...]

Without a ``preset`` it runs the main job, :data:`hybridfl.launch.job.MAIN_JOB` (README command (1)); with
``resume="<run folder>"`` it continues that run from its checkpoint.
KEY=VALUE pairs are run-config overrides with ``flwr run -c`` syntax (TOML values; strings quoted).
The script validates the config first (a bad key fails here, naming key, value and what is
allowed), starts a simulation SuperLink on free loopback ports with a project-local FLWR_HOME,
runs ``flwr run . --stream`` with one simulated SuperNode per client (1 CPU each), checks that the
run *finished:completed* and wrote ``summary.json``, and stops exactly the processes it started. The run's stream
is kept in ``<run folder>/flower-logs/flwr-run.log`` beside the SuperLink's log.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from hybridfl.launch import cluster
from hybridfl.launch.flwr_cli import check_completed, flwr_run, write_connection
from hybridfl.launch.job import prepare
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, wait_healthy

CONNECTION = "hybridfl-sim"
# What Ray says when its raylet has not registered within the 30 s that ray._private.node allows (hard-coded): on a
# busy machine, before any client ran
RAY_DID_NOT_START = "The current node timed out during startup"
# The run's stream (`flwr run --stream`: the simulation's Ray and the ServerApp speak there, not in the SuperLink's log)
STREAM_LOG = "flwr-run.log"
# How often a run whose Ray did not start is started, and the pause before each new start (times its number): on a
# loaded 2-core machine (CI: the suite's 4 workers) two starts in a row have both missed the 30 s
RAY_START_ATTEMPTS = 3
RAY_RETRY_PAUSE_S = 10.0


def ray_did_not_start(run_path: Path) -> bool:
    """Whether a failed run's Flower logs (its stream, :data:`STREAM_LOG`, among them) say that Ray did not start."""
    return any(RAY_DID_NOT_START in log.read_text(errors="replace") for log in (run_path / "flower-logs").glob("*.log"))


def set_aside(run_path: Path) -> Path:
    """Move a failed attempt's run folder to ``<run folder>-ray-did-not-start`` (``-2``, ``-3``... if taken) and
    leave an empty one in its place; return where it went."""
    aside, k = run_path.with_name(f"{run_path.name}-ray-did-not-start"), 1
    while aside.exists():
        k += 1
        aside = run_path.with_name(f"{run_path.name}-ray-did-not-start-{k}")
    run_path.rename(aside)
    run_path.mkdir()
    return aside


def local_client_gpus() -> float:
    """Each simulated client's share of a GPU for Ray on this machine: as many clients at once as there are CPUs
    share one GPU (every client's ``device`` is ``auto``, so it trains on the GPU); 0 where torch sees none."""
    import torch

    return round(1 / max(1, os.cpu_count() or 1), 4) if torch.cuda.is_available() else 0.0


def local_cpus() -> int:
    """The CPUs of the Ray a simulation starts on this machine: all of them, at least 2 (Flower's own default)."""
    return max(2, os.cpu_count() or 2)


def simulate(overrides: dict[str, Any], flwr_home: Path, app_dir: Path | None = None, ray_address: str | None = None,
             client_cpus: float = 1.0, client_gpus: float | None = None) -> Path:
    """Run the simulation of the Flower app in `app_dir` (default: hybridfl's own); return the run folder, or raise
    with the reason it failed. `ray_address`: an existing Ray cluster (:func:`hybridfl.launch.cluster.address`), which
    the simulation joins instead of starting a Ray of its own; the ServerApp runs here, each client on a cluster node
    with `client_cpus` CPUs and `client_gpus` GPUs (default: a share of this machine's GPU alone, 0 on a cluster)."""
    import torch

    overrides, run_path, cfg = prepare(overrides, app_dir)
    env = flower_env(flwr_home)
    cpus = local_cpus()
    if ray_address:
        with cluster.joined(ray_address) as ray:
            resources, where = cluster.nodes(ray), f"the Ray cluster at {ray_address}"
        gpus = 0.0 if client_gpus is None else client_gpus
        env["RAY_ADDRESS"] = ray_address  # Flower's backend joins it: ray.init() reads it
        init_args = ""  # Ray refuses num_cpus when it joins a cluster
    else:
        resources, where = [{"CPU": cpus, "GPU": torch.cuda.device_count()}], "this machine's Ray"
        gpus = local_client_gpus() if client_gpus is None else client_gpus
        env["RAY_ADDRESS"] = cluster.LOCAL  # never a cluster `ray start` left running on this machine
        init_args = f" init-args-num-cpus={cpus}"
    cluster.check_fits(resources, client_cpus, gpus, where)
    federation = (f"num-supernodes={cfg.num_clients} client-resources-num-cpus={client_cpus:g} "
                  f"client-resources-num-gpus={gpus:g}{init_args}")
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        port = free_port()
        with ProcessGroup(run_path / "flower-logs", env) as procs:
            link = procs.start("superlink", ["flower-superlink", "--insecure", "--simulation", "--isolation",
                                             "subprocess", "--host", "127.0.0.1", "--port", str(port)])
            wait_healthy(port, link)
            write_connection(flwr_home, CONNECTION, port)
            run_id, status = flwr_run(env, CONNECTION, overrides, federation_config=federation, app_dir=app_dir,
                                      log=run_path / "flower-logs" / STREAM_LOG)
        # Ray's own start has a fixed 30 s: on a busy machine it fails before any client ran. Then a fresh run
        # folder (a resumed run's is its checkpoint: never moved) and, after a pause, a fresh start
        if (attempt == RAY_START_ATTEMPTS or cfg.resume or status != "finished:failed"
                or not ray_did_not_start(run_path)):
            break
        aside = set_aside(run_path)
        print(f"warning: Ray did not start within its 30 s (a busy machine?): run {run_id} failed before any client "
              f"ran; its folder is now {aside}; starting the run once more (attempt {attempt + 1} of "
              f"{RAY_START_ATTEMPTS})", file=sys.stderr, flush=True)
        time.sleep(RAY_RETRY_PAUSE_S * attempt)
    check_completed(run_id, status, run_path)
    return run_path
