"""Run a preset on a local Flower deployment (one SuperLink + N SuperNodes on loopback) and check it.

    hybridfl run [PRESET] [KEY=VALUE ...] --mode deployment [--supernodes N] [--latency I=SECONDS ...] [--plain-http]
    e.g.  hybridfl run --mode deployment --supernodes 2 clients-per-round=2 num-rounds=2
          hybridfl run fedasync-digits --mode deployment --supernodes 3 --latency 2=4 clock="wall" concurrency=3

KEY=VALUE pairs are run-config overrides with ``flwr run -c`` syntax.
:func:`deploy` validates the config first, then starts ``flower-superlink`` (in-memory state) and N
``flower-supernode`` processes on free loopback ports, node i holding partition i of N (N defaults to
num-clients; a different --supernodes sets num-clients=N), each with its own ``flower-superexec`` (Flower's
process isolation): the SuperLink's Runtime API and each SuperNode's accept only the SuperExec that holds its
shared secret (``<flwr-home>/pki/superlink.secret``, ``supernode-I.secret``; hybridfl/launch/pki.py). Every SuperLink
API is served over HTTPS with a private CA (kept in <flwr-home>/pki), and only SuperNodes whose keys were registered
(as ``flwr supernode register`` does, all over one Control API connection) before they start are admitted: the
loopback ports are open to every user of the machine, not only this one's processes (docs/security.md).
``--plain-http`` drops both, and warns.
It runs ``flwr run . --stream`` against them, checks that the run *finished:completed* and wrote
``summary.json``, and stops exactly the processes it started (logs in <run>/flower-logs/). The ServerApp's SuperExec
is started again whenever it exits (:meth:`ProcessGroup.keep`), so that the deployment's next run still finds one.
With a ``fleet`` (a run key: common/fleet.py), every node is made the device its profile draws: a shaped link,
paced work, a memory limit, its availability windows (hybridfl/launch/real_fleet.py; what it did: ``<run>/fleet.json``).
Each device runs warm by default (``--executor``, :data:`EXECUTORS`): about 0.3 s per message besides its training
on a quiet machine, against 5–6 s with Flower's own SuperNode and SuperExec (BENCHMARKS, "Warm devices").
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.config import ConfigError
from common.fleet import load_fleet
from flower_internals.control import register_keys
from hybridfl.launch.compose import PLAIN_HTTP_WARNING
from hybridfl.launch.flwr_cli import check_completed, flwr_run, write_connection
from hybridfl.launch.job import app_run_config, prepare
from hybridfl.launch.linkdb import private_file
from hybridfl.launch.pki import make_pki, make_secrets
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, wait_healthy
from hybridfl.launch.real_fleet import RealFleet

CONNECTION = "hybridfl-local"
# A device's two processes, (SuperNode, ClientApp executor), with Flower's flags: Flower's own (a process per
# message, 3 s idle polls); the warm executor (client_app/warm_executor.py) with the SuperNode's waits paced
# (client_app/supernode.py); or the warm executor alone
# (-P: the folder it runs in, the user's, is not searched first, so a package of theirs named as ours is never run)
_WARM_EXECUTOR = (sys.executable, "-P", "-m", "client_app.warm_executor")
EXECUTORS = {"flower": (("flower-supernode",), ("flower-superexec",)),
             "warm": ((sys.executable, "-P", "-m", "client_app.supernode"), _WARM_EXECUTOR),
             "warm-executor": (("flower-supernode",), _WARM_EXECUTOR)}
# The ServerApp's SuperExec: Flower's, its task poll patient with server errors and paced when idle
# (server_app/superexec.py)
SERVERAPP_EXECUTOR = (sys.executable, "-P", "-m", "server_app.superexec")


def deploy(overrides: dict[str, Any], flwr_home: Path, supernodes: int | None = None,
           latency: dict[int, float] | None = None,
           on_started: Callable[[ProcessGroup, Path], None] | None = None,
           plain_http: bool = False, node_config: str = "",
           app_dir: Path | None = None, executor: str = "warm") -> tuple[Path, set[int]]:
    """Run one job on a fresh deployment; return its run folder and the PIDs started (all stopped by now).

    `latency` slows SuperNode i's train replies by that many seconds (node config ``latency-s``);
    `on_started(processes, run_folder)` is called once every process is up, before the run starts
    (tests use it to stop a SuperNode mid-run). `plain_http` as ``--plain-http``; `node_config`
    is added to every SuperNode's ``--node-config``; `app_dir` is the Flower app to run (default: hybridfl's own;
    a user's project that runs hybridfl's apps, such as examples/tabular); `executor` runs each node's ClientApp
    tasks: ``flower`` (Flower's SuperNode and SuperExec, a process per message), ``warm`` (client_app/warm_executor.py
    and the SuperNode's waits paced, client_app/supernode.py) or ``warm-executor`` (the first alone). Raises
    ConfigError for a bad config and RuntimeError with the reason when the run fails.
    """
    paths, pids = deploy_runs([overrides], flwr_home, supernodes, latency, on_started, plain_http=plain_http,
                              node_config=node_config, app_dir=app_dir, executor=executor)
    return paths[0], pids


def deploy_runs(runs: list[dict[str, Any]], flwr_home: Path, supernodes: int | None = None,
                latency: dict[int, float] | None = None,
                on_started: Callable[[ProcessGroup, Path], None] | None = None,
                plain_http: bool = False, node_config: str = "",
                app_dir: Path | Sequence[Path | None] | None = None, executor: str = "warm",
                database: Path | None = None, after_run: Callable[[int, Path], None] | None = None
                ) -> tuple[list[Path], set[int]]:
    """Run several jobs one after the other on the same SuperLink and SuperNodes (all must agree on
    num-clients); see :func:`deploy`. `on_started` gets the first run's folder; `node_config` is added to
    every SuperNode's ``--node-config`` (e.g. ``cache-dir=""``); `app_dir` is every run's app, or one per run.
    `database`: the SuperLink keeps its state in this SQLite file (``--database``, created private: mode 0600) instead
    of in memory; `after_run(run_id, run_folder)` is called after each run has ended, the deployment still up."""
    app_dirs = [app_dir] * len(runs) if app_dir is None or isinstance(app_dir, Path) else list(app_dir)
    if len(app_dirs) != len(runs):
        raise ValueError(f"{len(runs)} runs, {len(app_dirs)} app folders")
    if executor not in EXECUTORS:
        raise ConfigError("--executor", executor, " or ".join(EXECUTORS))
    if supernodes is not None:
        runs = [{**o, "num-clients": supernodes} if supernodes != app_run_config(o, a).num_clients else o
                for o, a in zip(runs, app_dirs)]
    prepared = [prepare(o, a)[:2] for o, a in zip(runs, app_dirs)]  # every config validated before anything starts
    configs = [app_run_config(o, a) for (o, _), a in zip(prepared, app_dirs)]
    sizes = {cfg.num_clients for cfg in configs}
    if len(sizes) != 1:
        raise RuntimeError(f"runs on one deployment must share num-clients, got {sorted(sizes)}")
    n = sizes.pop()
    fleets = {(cfg.fleet, cfg.seed) for cfg in configs}
    if len(fleets) != 1:
        raise RuntimeError(f"runs on one deployment must share its fleet and seed, got {sorted(fleets)}")
    fleet = load_fleet(configs[0].fleet, n, configs[0].seed)
    env = flower_env(flwr_home)
    port = free_port()
    node_ports = [free_port() for _ in range(n)]  # never the same twice
    if plain_http:
        print(PLAIN_HTTP_WARNING, file=sys.stderr)
    pki = None if plain_http else make_pki(flwr_home / "pki", nodes=n)
    ca = pki / "ca.crt" if pki else None
    secret = make_secrets(flwr_home / "pki", n)
    link_security = ["--insecure"] if pki is None else [
        "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(pki / "server.crt"),
        "--ssl-keyfile", str(pki / "server.key"), "--enable-supernode-auth"]
    state = [] if database is None else ["--database", str(private_file(database))]
    to_link = ["--insecure"] if ca is None else ["--root-certificates", str(ca)]
    supernode_cmd, executor_cmd = EXECUTORS[executor]
    real = None if not fleet.limited else RealFleet(fleet, port, free_port)
    try:
        with ProcessGroup(prepared[0][1] / "flower-logs", env) as procs:
            link = procs.start("superlink", ["flower-superlink", *link_security, *runtime_api(secret["superlink"]),
                                             *state, "--host", "127.0.0.1", "--port", str(port),
                                             "--disable-runtime-dependency-installation"])
            wait_healthy(port, link, ca=ca)
            write_connection(flwr_home, CONNECTION, port, ca)
            if pki:  # every node's key, in this process: `flwr supernode register` is a process per key
                register_keys(flwr_home, CONNECTION, [pki / f"supernode-{i}.pub" for i in range(n)])
            procs.keep("superexec-serverapp", superexec(to_link, f"127.0.0.1:{port}", secret["superlink"]))
            starts = [0] * n

            def start_node(i: int) -> None:
                """Node i's SuperNode and ClientApp executor (again, under a new log, when a fleet restarts it)."""
                node_config_i = f"partition-id={i} num-partitions={n}"
                if (latency or {}).get(i):
                    node_config_i += f" latency-s={float(latency[i])}"
                node_config_i += f" {real.node_config(i)}" if real else ""
                node_config_i += f" {node_config}" if node_config else ""
                security = list(to_link)
                if pki:
                    security += ["--auth-supernode-private-key", str(pki / f"supernode-{i}")]
                node_secret = secret[f"supernode-{i}"]
                again = f".{starts[i]}" if starts[i] else ""
                starts[i] += 1
                superlink = real.address(i) if real else f"127.0.0.1:{port}"
                node = procs.start(f"supernode-{i}{again}", [
                    *supernode_cmd, *security, "--superlink", superlink, *runtime_api(node_secret),
                    "--host", "127.0.0.1", "--port", str(node_ports[i]), "--node-config", node_config_i])
                # the node's ClientApp executor: plain HTTP on the device's loopback, authenticated by its secret
                executor_proc = procs.start(f"superexec-clientapp-{i}{again}", superexec(
                    ["--insecure"], f"127.0.0.1:{node_ports[i]}", node_secret, executor_cmd))
                if real:
                    real.started(i, [node, executor_proc])

            def stop_node(i: int) -> None:
                again = f".{starts[i] - 1}" if starts[i] > 1 else ""
                procs.terminate(f"supernode-{i}{again}")
                procs.terminate(f"superexec-clientapp-{i}{again}")

            for i in range(n):
                start_node(i)
            if on_started:
                on_started(procs, prepared[0][1])
            if real:
                real.follow(prepared[0][1], start_node, stop_node)
            outcomes = []
            try:
                for (o, path), a in zip(prepared, app_dirs):
                    outcomes.append((flwr_run(env, CONNECTION, o, app_dir=a), path))
                    if after_run:
                        after_run(outcomes[-1][0][0], path)
            finally:
                if real:
                    real.halt()
    finally:
        if real:
            real.close(prepared[0][1])
    for (run_id, status), path in outcomes:
        check_completed(run_id, status, path)
    return [path for _, path in outcomes], procs.pids


def runtime_api(secret: Path) -> list[str]:
    """A SuperLink's or SuperNode's flags for a Runtime API that only the holder of `secret` may use: the process
    isolation (its SuperExec is started apart; in Flower's subprocess isolation the secret is ignored)."""
    return ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]


def superexec(security: list[str], address: str, secret: Path, command: tuple[str, ...] = SERVERAPP_EXECUTOR
              ) -> list[str]:
    """A SuperExec serving the Runtime API at `address` with its `secret` (the ServerApp's or a node's ClientApp)."""
    return [*command, *security, "--runtime-api-address", address, "--superexec-auth-secret-file", str(secret)]
