"""docker/compose.yml, run with Docker (``demo``); its files read as Compose reads them: compose_file.py.

    python -m hybridfl.launch.compose demo [--plain-http] [--gpu] [--host-network] [--no-build] [KEY=VALUE ...]
    python -m hybridfl.launch.compose check [--plain-http] [--gpu] [--host-network]    # the files' structure
    python -m hybridfl.launch.compose flwr [--plain-http] FLWR-ARGS ...     # the operator's flwr, e.g. `flwr ls`
    python -m hybridfl.launch.compose demo --fleet FLEET --nodes N ...      # N SuperNodes made a fleet's devices

``--fleet`` (a built-in fleet or a fleet file, common/fleet.py) adds a generated compose file
(hybridfl/launch/compose_fleet.py, written to ``outputs/compose/fleet.yml``): each device's link shaped, its ClientApp's
memory and cores limited, its work paced, and the demo switches devices off and on by their windows.

The deployment is secure by default (docker/compose.yml: TLS, SuperNode authentication, a SuperExec secret per
Runtime API); ``--plain-http`` adds ``plain-http.yml`` and warns. The demo makes the certificates, keys and secrets,
starts the SuperLink, registers the SuperNodes' keys, starts the rest, runs the main job on ``num-clients`` = the
compose file's SuperNodes with ``flwr run``, checks that it finished:completed and copies its outputs from the
``outputs`` volume; the deployment stays up for more runs. Ctrl-C or SIGTERM at any point takes it down (volumes
kept) and exits 130 or 143. It needs this checkout's docker/ folder: an installed wheel has no compose files.

No port of the SuperLink exists outside the server's network namespace (docker/compose.yml's `link`): the
operator's ``flwr`` runs inside it, in the on-demand ``operator`` service, with the folder it is called from mounted
(``flwr`` mode: e.g. ``python -m hybridfl.launch.compose flwr run . hybridfl-compose --stream`` from this checkout).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from common.errors import ConfigError
from common.fleet import Fleet, load_fleet
from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.compose_file import (
    COMPOSE_DIR,
    OUTPUTS,
    SERVERAPP,
    SUPERLINK,
    ComposeError,
    auth_key,
    compose_files,
    load,
    start_order,
    supernodes,
    volume_spec,
)
from hybridfl.launch.compose_fleet import ComposeSchedule, write_fleet_file
from hybridfl.launch.flwr_cli import Flwr, check_completed, flwr_run, register_supernode, run_and_report
from hybridfl.launch.job import MAIN_JOB, parse_overrides
from hybridfl.launch.pki import make_pki
from hybridfl.launch.processes import flower_env, interrupts_held, terminated
from server_app.config import load_config, used_keys

CONNECTION = "hybridfl-compose"
CERTS = COMPOSE_DIR / "certs"
OPERATOR = "operator"  # the operator's `flwr`, in the server's network namespace
IMAGE_UID = 49999  # the user `app` of Flower's images
FLEET_FILE = PROJECT_DIR / "outputs" / "compose" / "fleet.yml"  # the demo's generated fleet file


PLAIN_HTTP_WARNING = ("warning: --plain-http: no TLS and no SuperNode authentication; anyone who reaches the "
                      "SuperLink's port can join as a SuperNode or read the traffic. Use it on a closed test bench "
                      "only.")


def demo_run_config(compose: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The demo's run config: the main job (Feddle-ID on digits) on as many clients as the file has SuperNodes,
    all of them in every step and in every buffered step (buffer-size, where the job's strategy has one), for
    20 steps; written to the
    ServerApp's path of the ``outputs`` volume under a fresh run name; then the user's overrides. Checked
    (ConfigError) before anything starts."""
    n = len(supernodes(compose))
    for spec in compose["services"][SERVERAPP].get("volumes") or []:
        if volume_spec(spec)[0] == OUTPUTS:
            run_config = {"preset": MAIN_JOB, "num-clients": n, "clients-per-round": n,
                          "num-rounds": 20, "output-dir": volume_spec(spec)[1],
                          "run-name": time.strftime("compose-%Y%m%d-%H%M%S"), **overrides}
            if "buffer-size" not in run_config and "buffer-size" in used_keys(load_config(run_config)):
                run_config["buffer-size"] = n
            load_config(run_config)
            return run_config
    raise ComposeError(f"service {SERVERAPP}: no {OUTPUTS!r} volume for the run's outputs")


def hand_to_images(compose: dict[str, Any], directory: Path) -> None:
    """Give the images' user (UID 49999) the files of `directory` (the certificates' folder) that a service mounts,
    so that its containers can read their keys and secrets; nothing else there (``ca.key`` stays the operator's)."""
    mounted = {Path(volume_spec(spec)[0]).name for svc in compose["services"].values()
               for spec in svc.get("volumes") or [] if volume_spec(spec)[0].startswith("./certs/")}
    for name in sorted(mounted):
        os.chown(directory / name, IMAGE_UID, IMAGE_UID)


def certificates(compose: dict[str, Any], directory: Path) -> Path | None:
    """The CA, certificates, SuperNode keys and Runtime API secrets the files mount, made in `directory` (kept where
    they exist); the CA the CLI verifies the SuperLink with, None where the SuperLink speaks plain HTTP."""
    make_pki(directory, nodes=len(supernodes(compose)))
    return None if "--insecure" in compose["services"][SUPERLINK]["command"] else directory / "ca.crt"


def compose_argv(files: list[Path]) -> list[str]:
    """``docker compose`` on `files`."""
    return ["docker", "compose", *(a for f in files for a in ("-f", str(f)))]


def operator(dc: list[str]) -> Flwr:
    """The operator's `flwr` as a command line: ``docker compose run`` (`dc`, e.g. :func:`compose_argv`) of the
    `operator` service (in the server's network namespace, the deployment's CA trusted, the connection
    :data:`CONNECTION`), the app folder mounted at its working directory."""
    return lambda folder: [*dc, "run", "--rm", "-T", "--no-deps",
                           *(["-v", f"{folder.resolve()}:/project:ro"] if folder else []), OPERATOR]


def demo(files: list[Path], overrides: dict[str, Any], build: bool = True, fleet: Fleet | None = None) -> Path:
    """``docker compose up`` the files (building the app image unless `build` is False: the images there are
    used): the certificates, keys and secrets made, the SuperLink alone first to register the SuperNodes' keys; run
    the job; copy its outputs to ./outputs/compose. The operator's `flwr` runs in the server's namespace
    (:func:`operator`). The deployment stays up for more runs; interrupted (Ctrl-C, SIGTERM) at any point, it is
    taken down (its volumes kept) before the interrupt goes on. With `fleet` (the files include its
    :func:`fleet_file`), its devices are switched off and on by their windows from the run's first round, and what
    they did is written to the run's ``fleet.json``. Needs a Docker engine."""
    compose = load(files)
    env = flower_env(PROJECT_DIR / ".flwr-compose")
    dc = compose_argv(files)
    flwr = operator(dc)
    up = [*dc, "up", "-d", "--wait", *(["--build"] if build else ["--no-build", "--pull", "never"])]
    run_config = demo_run_config(compose, overrides)  # a bad one fails before anything starts
    certificates(compose, CERTS)
    if os.geteuid() == 0:  # the images run as app (UID 49999): let them read their keys and secrets
        hand_to_images(compose, CERTS)
    try:
        _sh([*up, SUPERLINK], env)
        for node in supernodes(compose):
            if key := auth_key(compose["services"][node]["command"]):
                register_supernode(env, CONNECTION, Path(f"{key}.pub"), flwr)
        _sh(up, env)
        schedule = None if fleet is None or not fleet.limited else follow_fleet(fleet, dc, env, compose, run_config)
        try:
            run_id, status = flwr_run(env, CONNECTION, run_config, flwr=flwr)
        finally:
            if schedule is not None:
                schedule.halt()
    except (KeyboardInterrupt, SystemExit):
        print("interrupted: taking the deployment down (docker compose down; its volumes are kept)",
              file=sys.stderr, flush=True)
        with interrupts_held():  # a second Ctrl-C must not leave it half down
            subprocess.run([*dc, "down", "--timeout", "10"], env=env, cwd=PROJECT_DIR, check=False)
        raise
    local = PROJECT_DIR / "outputs" / "compose"
    local.mkdir(parents=True, exist_ok=True)
    _sh(dc + ["cp", f"{SERVERAPP}:{run_config['output-dir']}/{run_config['run-name']}", str(local)], env)
    if schedule is not None:
        schedule.close(local / run_config["run-name"], docker_restarts(dc, env))
    check_completed(run_id, status, local / run_config["run-name"])
    plain = "--plain-http " if COMPOSE_DIR / "plain-http.yml" in files else ""  # the operator's connection
    print(f"the deployment stays up for more runs (`python -m hybridfl.launch.compose flwr {plain}run . {CONNECTION} "
          f"--stream`: the operator's flwr); `{shlex.join([*dc, 'down'])}` stops it", flush=True)
    return local / run_config["run-name"]


def follow_fleet(fleet: Fleet, dc: list[str], env: dict[str, str], compose: dict[str, Any],
                 run_config: dict[str, Any]) -> ComposeSchedule:
    """The fleet's schedule on the deployment (`dc`), from the run's first round (its ``metrics.jsonl`` appears in
    the ServerApp's container), and Docker's OOM events of its project counted."""
    schedule = ComposeSchedule(fleet, dc, env)
    metrics = f"{run_config['output-dir']}/{run_config['run-name']}/metrics.jsonl"
    schedule.follow(lambda: subprocess.run([*dc, "exec", "-T", SERVERAPP, "test", "-e", metrics], env=env,
                                           capture_output=True, check=False).returncode == 0)
    schedule.follow_events(["docker"], compose.get("name", "hybridfl"))
    return schedule


def docker_restarts(dc: list[str], env: dict[str, str]) -> dict[str, int]:
    """Docker's restart count of each service's container (a crash or an OOM kill its restart policy restarted)."""
    ids = subprocess.run([*dc, "ps", "-a", "-q"], env=env, capture_output=True, text=True, check=False).stdout.split()
    out = subprocess.run(["docker", "inspect", "-f", '{{index .Config.Labels "com.docker.compose.service"}} '
                          "{{.RestartCount}}", *ids], env=env, capture_output=True, text=True, check=False).stdout
    return {name: int(count) for name, count in (line.split() for line in out.splitlines() if line.count(" ") == 1)}


def _sh(cmd: list[str], env: dict[str, str]) -> None:
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=PROJECT_DIR, check=True)


def file_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the compose files (:func:`compose_files`): this command's and the twin's."""
    parser.add_argument("--plain-http", action="store_true",
                        help="add docker/plain-http.yml: no TLS, no SuperNode authentication (a closed test bench)")
    parser.add_argument("--gpu", action="store_true", help="add docker/compose.gpu.yml (CUDA ServerApp)")
    parser.add_argument("--host-network", action="store_true",
                        help="add docker/host-network.yml (no Docker network: every container on the host's)")
    parser.add_argument("--flower-devices", action="store_true",
                        help="add docker/flower-devices.yml: Flower's own flower-supernode and flower-superexec on "
                             "each device instead of the warm ones")
    parser.add_argument("--fleet", metavar="FLEET",
                        help="make the SuperNodes a fleet's devices: a built-in fleet or a fleet file "
                             "(docs/tutorials/fleet.md; hybridfl/launch/compose_fleet.py)")
    parser.add_argument("--nodes", type=int, default=2, metavar="N", help="with --fleet: the fleet's size (default 2)")


class CommandLine(NamedTuple):
    args: argparse.Namespace
    files: list[Path]  # the compose files, in order
    compose: dict[str, Any]  # their merge
    overrides: dict[str, Any]  # the run config's KEY=VALUEs
    fleet: Fleet | None  # --fleet, drawn for --nodes devices with the run's seed


def read_command_line(parser: argparse.ArgumentParser, argv: list[str] | None,
                      fleet_file: Path = FLEET_FILE) -> CommandLine | None:
    """`parser` (with :func:`file_flags` added) on `argv`; with ``--fleet``, its compose file written to `fleet_file`
    and added, and the run's ``fleet`` set. None, the error printed in one line, when the files, the fleet or an
    override are bad. This command's and the twin's (tools/compose_twin.py)."""
    file_flags(parser)
    args = parser.parse_intermixed_args(argv)
    if args.plain_http:
        print(PLAIN_HTTP_WARNING, file=sys.stderr)
    files = compose_files(args.plain_http, args.gpu, args.host_network, args.flower_devices)
    try:
        overrides, fleet = parse_overrides(args.overrides), None
        if args.fleet:
            if args.nodes < 1:
                raise ConfigError("--nodes", args.nodes, "an integer >= 1")
            user_file = Path(args.fleet).resolve() if Path(args.fleet).is_file() else None
            seed = load_config({"preset": MAIN_JOB, **overrides}).seed
            fleet = load_fleet(str(user_file or args.fleet), args.nodes, seed)
            files = [*files, write_fleet_file(fleet_file, load(files), fleet, user_file)]
            overrides.setdefault("fleet", str(user_file or args.fleet))
        return CommandLine(args, files, load(files), overrides, fleet)
    except (ComposeError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def operator_command(argv: list[str]) -> int:
    """``flwr ARGS`` as the operator (:func:`operator`) on the current folder; the compose flags among `argv`
    choose the files (``--plain-http``: the operator's plain-HTTP connection). Returns flwr's exit code."""
    parser = argparse.ArgumentParser(prog="python -m hybridfl.launch.compose flwr", add_help=False)
    file_flags(parser)
    flags, args = parser.parse_known_args(argv)
    files = compose_files(flags.plain_http, flags.gpu, flags.host_network, flags.flower_devices)
    return subprocess.run([*operator(compose_argv(files))(Path.cwd()), *args], check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if mode is not None and argv[mode] == "flwr":  # flwr's own arguments are not this parser's
        return operator_command(argv[:mode] + argv[mode + 1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["demo", "check"], help="or flwr: see above")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--no-build", action="store_true", help="demo: run the images the engine has (no build)")
    if (read := read_command_line(parser, argv)) is None:
        return 2
    args, files, compose, overrides, fleet = read
    if args.mode == "check":
        print(f"{', '.join(f.name for f in files)}: {len(compose['services'])} services, start order "
              f"{' -> '.join(start_order(compose['services']))}")
        return 0
    try:
        return run_and_report(lambda: demo(files, overrides, build=not args.no_build, fleet=fleet))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, terminated)  # SIGTERM unwinds as Ctrl-C does: the demo's deployment goes down
    sys.exit(main())
