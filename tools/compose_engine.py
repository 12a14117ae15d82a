"""``make compose-test``: docker/'s compose files on a real Docker engine, the way an operator runs them.

    python -m tools.compose_engine [--require] [--workdir DIR] [--keep-engine]

1. Tools, from the package registries: Debian's ``docker.io`` (engine, containerd, runc, the CLI with BuildKit)
   and ``debootstrap``; the Compose v2 plugin from Debian trixie's ``docker-compose`` package (bookworm only has
   Compose v1, which rejects the files; trixie's is Debian's own build, signed by the archive key this machine
   already trusts, and needs nothing newer than bookworm's libc), fetched with a private apt list so nothing
   else on the machine moves to trixie.
2. A private engine: ``dockerd --bridge=none --iptables=false ...`` with its own socket and exec root in a
   temporary folder (removed at the end) and its data root (images, build cache) in the cache, stopped by PID at the
   end (with its containerd). No Docker network is ever created: every container uses the host's network
   (docker/host-network.yml), on loopback.
3. Images, with no image registry and no network inside the builds (``docker build --network none``): Flower's
   official ``flwr/*`` and ``nginx`` images when Docker Hub answers, otherwise stand-ins (docker/Dockerfile.flower)
   on a Debian base made by debootstrap with python3 and nginx baked in; the app image from docker/Dockerfile. Python
   wheels come from a wheelhouse made on the host (docker/wheels/, from pip's own sources). An image whose inputs
   (Dockerfile, arguments, wheels, base) are those it was built from, by its label, is kept. The log says which images
   it used.
4. Through ``docker compose`` itself, on the files' secure default (TLS, SuperNode authentication, a SuperExec secret
   per Runtime API): (a) the main job end to end, its summary.json copied out, (b) with the SuperLink container
   killed once the run has trained and started again: the run completes with every step (its state is in SQLite on its
   volume); (c) the registered SuperNodes train, an unregistered key is refused by the SuperLink, a plain-HTTP
   SuperNode is refused, and a process without the secrets is refused a task by the SuperLink's and a SuperNode's
   Runtime API (Flower's 401); (d) while the job runs, a process on the devices' port holding only ca.crt
   (tools/intruder.py) is refused by the edge proxy when it registers a key, starts a run of its own app, lists or
   stops runs, or asks the Runtime API for a task, and its app leaves no file in any container; the operator's `flwr`
   (the `operator` service, in the server's network namespace) starts that app, which then runs everywhere; (e) no
   port of the SuperLink is open on the host, its loopback included, and the socket the edge reaches it by is closed
   to any other user of the host; a stranger's upload over the edge's body limit is refused (413). compose.gpu.yml and
   plain-http.yml are validated by ``docker compose config`` (tests/test_compose.py compares them with the twin's
   reading, which runs plain-http.yml natively).
   (f) A fleet (docs/tutorials/fleet.md, section 4, run as written): three devices as containers, each with its
   shaper, memory and cores, one switched off and on by its windows, one whose training the kernel kills for its
   memory, the run completed with the others' updates (hybridfl/launch/compose_fleet.py).
5. The demo as a user runs it (``make compose-demo HOST=1 ARGS=--no-build``), sent SIGTERM while its job streams:
   exit 143 within 60 s, none of its processes left, its deployment down and its volumes kept.

Where no engine can start here (not root, no apt-get, no overlay filesystem), it says why and skips (exit 0), or
fails with --require (CI); a dockerd that exits or does not answer where it could run is a failure (exit 1).
Outputs: <workdir>/ (default outputs/compose-test/): the runs, each service's log, timings.json, and on success
passed.json: the digest of the tracked tree it built and ran (tests/test_compose.py's native twin
runs stand in for this test, and skip where it passed on this very tree).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from common.fleet import load_fleet
from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.compose import CONNECTION, FLEET_FILE, IMAGE_UID, demo_run_config, hand_to_images, operator
from hybridfl.launch.compose_file import (
    COMPOSE_DIR,
    SERVERAPP,
    SUPERLINK,
    auth_key,
    compose_files,
    load,
    superlink_port,
    supernodes,
)
from hybridfl.launch.compose_fleet import SHAPER_PORT
from hybridfl.launch.flwr_cli import check_completed, flwr_run, register_supernode, write_connection
from hybridfl.launch.pki import make_pki, node_key
from hybridfl.launch.processes import flower_env, process_tree
from tools import hostile_client, intruder
from tools.docs import bash_blocks
from tools.probes import acquire_task_anonymously, alive, device_timings

CACHE = Path(os.environ.get("HYBRIDFL_COMPOSE_CACHE", "/var/cache/hybridfl-compose"))  # kept between runs
WHEELS = COMPOSE_DIR / "wheels"  # in the build context; git-ignored but for its README
BASE_IMAGE = "local/debian:bookworm-python"
DOCKER = "/usr/bin/docker"  # the CLI of Debian's docker.io: the engine's version, BuildKit built in
DOCKERD_FLAGS = ["--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
                 "--storage-driver=overlay2", "--exec-opt", "native.cgroupdriver=cgroupfs"]
# the edge's and the SuperNodes' ports, on the host's network (and (f)'s third SuperNode's and its devices' shapers')
HOST_PORTS = (8000, 9094, 9095, 9096, *range(SHAPER_PORT, SHAPER_PORT + 3))
MARKS = "/tmp/hybridfl-intruder"  # where the intruder's app would leave its marks, in each container
WORKDIR = PROJECT_DIR / "outputs" / "compose-test"
PASSED = "passed.json"
TRIXIE = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main"


class Skip(Exception):
    """No Docker engine can run on this machine; the message says why."""


def log(msg: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 900, check: bool = True,
       quiet: bool = False, cwd: Path = PROJECT_DIR) -> subprocess.CompletedProcess:
    """Run `cmd` (logged unless `quiet`); raise with its output's tail when it fails and `check`."""
    if not quiet:
        log("$ " + " ".join(cmd))
    out = subprocess.run(list(cmd), env=env, timeout=timeout, text=True, capture_output=True, cwd=cwd, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out


# -- 1. tools ---------------------------------------------------------------------------------------------------

def ensure_tools() -> None:
    """docker.io, debootstrap and the Compose v2 plugin, installed from Debian's packages where missing."""
    if os.geteuid() != 0:
        raise Skip("not root: dockerd, debootstrap and apt-get need root")
    if not shutil.which("apt-get") and not (Path(DOCKER).exists() and shutil.which("dockerd")):
        raise Skip("no apt-get to install Debian's docker.io and debootstrap")
    if "overlay" not in Path("/proc/filesystems").read_text().split():  # --storage-driver=overlay2's kernel part
        raise Skip("this kernel has no overlay filesystem, which the engine's storage driver needs")
    tools = (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
    missing = [pkg for pkg, tool in tools if not shutil.which(tool)]
    if missing or not Path(DOCKER).exists():
        apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *(missing or ["docker.io"])]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if sh(apt, env=env, check=False).returncode != 0:
            sh(["apt-get", "update", "-q"], env=env)
            sh(apt, env=env)
    if sh([DOCKER, "compose", "version"], check=False, quiet=True).returncode == 0:
        return
    apt_dir = CACHE / "apt-trixie"
    (apt_dir / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (apt_dir / "sources.list").write_text(TRIXIE + "\n")
    opts = ["-o", f"Dir::Etc::SourceList={apt_dir / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={apt_dir / 'lists'}", "-o", f"Dir::Cache::Archives={apt_dir}"]
    sh(["apt-get", *opts, "update", "-q"])
    for old in apt_dir.glob("docker-compose_*.deb"):
        old.unlink()
    sh(["apt-get", *opts, "download", "docker-compose"], cwd=apt_dir)
    sh(["dpkg", "-i", str(next(apt_dir.glob("docker-compose_*.deb")))])
    sh([DOCKER, "compose", "version"])


# -- 2. the engine ----------------------------------------------------------------------------------------------

class Engine:
    """A dockerd of this script's own: socket and exec root in `root`, its images in `data` (kept between runs, in
    the cache: removing 3 GB of layers took 4 minutes, and a second run builds from its layer cache), no bridge, no
    iptables. ``stop()`` ends it by PID (dockerd stops its containers; its containerd child is ended with it),
    unmounts what is left and removes `root`."""

    def __init__(self, root: Path, data: Path) -> None:
        self.root, self.data, self.proc = root, data, None
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{root / 'docker.sock'}", "DOCKER_BUILDKIT": "1",
                    "DOCKER_CONFIG": str(root / "client")}

    def start(self, timeout: float = 60.0) -> None:
        log_file = open(self.root / "dockerd.log", "w")  # noqa: SIM115 - closed with the process
        self.data.mkdir(parents=True, exist_ok=True)
        cmd = ["dockerd", *DOCKERD_FLAGS, "--data-root", str(self.data), "--exec-root",
               str(self.root / "exec"), "--pidfile", str(self.root / "dockerd.pid"), "-H", self.env["DOCKER_HOST"]]
        log("$ " + " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # where it can run (root, overlay: ensure_tools), an exit is a failure
                tail = (self.root / "dockerd.log").read_text()[-2000:]
                raise RuntimeError(f"dockerd exited with code {self.proc.returncode}:\n{tail}")
            if self.docker("version", check=False, quiet=True).returncode == 0:
                log(f"dockerd ready (PID {self.proc.pid}) in {timeout - (deadline - time.monotonic()):.1f} s")
                # anything an earlier run left in the data root: containers running too (dockerd restarts those
                # with a restart policy, whose bind mounts of a removed checkout then appear there as folders)
                if left := self.docker("ps", "-a", "-q", quiet=True).stdout.split():
                    self.docker("rm", "--force", "--volumes", *left, quiet=True)
                self.docker("volume", "prune", "--force", quiet=True)
                return
            time.sleep(0.5)
        raise RuntimeError(f"dockerd did not answer within {timeout:.0f} s")

    def docker(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        return sh([DOCKER, *args], env=self.env, **kw)

    def stop(self) -> None:
        if self.proc is not None:
            tree = process_tree([self.proc.pid])  # containerd and its shims are dockerd's children
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()  # only if still the process seen above (psutil checks the PID's start time)
            self.proc.wait()
            log(f"dockerd (PID {self.proc.pid}) and its {len(tree) - 1} child processes stopped")
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith((str(self.root), str(self.data)))]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


# -- 3. images --------------------------------------------------------------------------------------------------

def wheelhouse() -> None:
    """docker/wheels/: the wheels of Flower and of the project's dependencies (and hatchling, its build
    backend), through this machine's pip configuration; hard links to a copy kept in the cache."""
    import tomllib

    wanted = [*tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]["dependencies"], "hatchling"]
    cached = CACHE / "wheels"
    cached.mkdir(parents=True, exist_ok=True)
    stamp = cached / "requirements.txt"  # what the wheels were downloaded for: the same list needs no pip run
    if not stamp.exists() or stamp.read_text().splitlines() != wanted:
        stamp.unlink(missing_ok=True)
        sh([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(cached),
            *wanted], timeout=1800)
        stamp.write_text("\n".join(wanted) + "\n")
    WHEELS.mkdir(exist_ok=True)
    for wheel in cached.glob("*.whl"):
        if not (WHEELS / wheel.name).exists():
            try:
                os.link(wheel, WHEELS / wheel.name)
            except OSError:
                shutil.copy2(wheel, WHEELS / wheel.name)


def check_wheelhouse(version: str) -> None:
    """The wheelhouse holds this venv's Flower (the `flwr` CLI that talks to the images must match them)."""
    names = sorted(w.name for w in WHEELS.glob("flwr-*.whl"))
    if names != [f"flwr-{version}-py3-none-any.whl"]:
        raise RuntimeError(f"the wheelhouse {WHEELS} has {names}, but this venv's flwr is {version}")


# The label an image built or imported here carries: a digest of what it was made from. An image whose label matches
# is not built again: BuildKit would find every layer in its cache, but only after hashing the build context (3.2 GB
# of wheels, for each image: 40 CPU s of the engine test's 480).
INPUTS_LABEL = "org.hybridfl.inputs"


def inputs_key(*inputs: Any) -> str:
    return hashlib.sha256(json.dumps(inputs, default=str).encode()).hexdigest()[:16]


def built_from(engine: Engine, image: str) -> str | None:
    """The inputs label of `image`, None where it has none or does not exist."""
    done = engine.docker("image", "inspect", "-f", f'{{{{index .Config.Labels "{INPUTS_LABEL}"}}}}', image,
                         check=False, quiet=True)
    label = done.stdout.strip() if done.returncode == 0 else ""
    return label if label and label != "<no value>" else None


def build(engine: Engine, tag: str, dockerfile: str, args: Sequence[str], inputs: Sequence[Any],
          timeout: float) -> tuple[str, bool]:
    """`docker build --network none -f dockerfile args -t tag .`, unless `tag` was built from the same Dockerfile,
    arguments and `inputs` (the files its build reads besides the Dockerfile, the keys of the images it starts
    from); returns its key and whether it was built."""
    key = inputs_key(dockerfile, (PROJECT_DIR / dockerfile).read_text(), list(args), list(inputs))
    if built_from(engine, tag) == key:
        log(f"image {tag}: built from the same inputs before, kept")
        return key, False
    engine.docker("build", "--network", "none", "-f", dockerfile, *args, "--label", f"{INPUTS_LABEL}={key}",
                  "-t", tag, ".", timeout=timeout)
    return key, True


def debian_base(engine: Engine) -> str:
    """local/debian:bookworm-python: debootstrap's minbase with python3, venv, nginx and its stream module (the edge's
    and the link's stand-in), imported (tarball cached) unless it was from the same tarball; returns its key."""
    tarball = CACHE / "debian-bookworm-python-nginx-stream.tar"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=CACHE) as rootfs:
            sh(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,nginx,libnginx-mod-stream",
                "bookworm", rootfs,
                "http://deb.debian.org/debian"], timeout=1200)
            sh(["tar", "-C", rootfs, "-cf", f"{tarball}.part", "."])
        Path(f"{tarball}.part").rename(tarball)
    key = inputs_key(tarball.name, tarball.stat().st_size, tarball.stat().st_mtime_ns)
    if built_from(engine, BASE_IMAGE) == key:
        log(f"image {BASE_IMAGE}: imported from the same tarball before, kept")
        return key
    engine.docker("import", "--change", f"LABEL {INPUTS_LABEL}={key}", str(tarball), BASE_IMAGE)
    return key


def build_images(engine: Engine, version: str, edge: str, wheels_ready: Callable[[], Any]) -> dict[str, str]:
    """Every image the compose files name (`edge`: the edge proxy's, ``nginx:<tag>``), built offline, once
    `wheels_ready()` returns (the wheelhouse is made meanwhile); returns image -> where it came from."""
    roles = ("superlink", "supernode", "superexec")
    pulled = engine.docker("pull", f"flwr/superlink:{version}", check=False, timeout=120).returncode == 0
    if pulled:
        for image in (*(f"flwr/{role}:{version}" for role in roles[1:]), edge):
            engine.docker("pull", image, timeout=900)
        used = {f"flwr/{role}:{version}": "Docker Hub (official)" for role in roles} | {edge: "Docker Hub (official)"}
        base = engine.docker("image", "inspect", "-f", "{{.Id}}", f"flwr/superexec:{version}", quiet=True).stdout
    else:
        log("Docker Hub cannot be reached: building stand-ins for Flower's images (docker/Dockerfile.flower)")
        base = debian_base(engine)
        used = {}
    wheels_ready()
    check_wheelhouse(version)
    wheels = sorted((w.name, w.stat().st_size) for w in WHEELS.glob("*.whl"))  # a wheel's name fixes its content
    built = []
    if not pulled:
        keys = {}
        for role in roles:
            keys[role], fresh = build(engine, f"flwr/{role}:{version}", "docker/Dockerfile.flower",
                                      ["--target", role, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
                                       "--build-arg", f"FLWR_VERSION={version}"], [base, wheels], timeout=1200)
            used[f"flwr/{role}:{version}"] = f"stand-in: Debian bookworm (debootstrap) + flwr {version} wheel"
            built.append(fresh)
        built.append(build(engine, edge, "docker/Dockerfile.flower",
                           ["--target", "edge", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"], [base], timeout=600)[1])
        used[edge] = "stand-in: Debian bookworm's nginx (debootstrap)"
        base = keys["superexec"]  # the app image's base
    # the app image reads only pyproject's dependency list (docker/Dockerfile): a run key's change elsewhere in the
    # file sent BuildKit the 3.4 GB context again for layers all cached (47 s of CI's engine test)
    dependencies = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    built.append(build(engine, f"hybridfl/app:{version}", "docker/Dockerfile",
                       ["--build-arg", f"FLWR_VERSION={version}",
                        "--build-arg", "PIP_OPTIONS=--no-index --find-links /wheels"],
                       [base, wheels, dependencies], timeout=1800)[1])
    used[f"hybridfl/app:{version}"] = "docker/Dockerfile, offline from docker/wheels"
    if any(built):
        engine.docker("image", "prune", "--force", quiet=True)  # the earlier builds these tags replaced
        # BuildKit keeps a snapshot of every build's context (3.4 GB with docker/wheels) as build cache: 40 GB after
        # a dozen runs filled the disk the suite then ran on. The layers stay cached; only the context snapshots go.
        engine.docker("builder", "prune", "--force", "--filter", "type=source.local", quiet=True)
    return used


# -- 4. the deployments -----------------------------------------------------------------------------------------

class Deployment:
    """docker/'s compose files (+ host-network.yml) copied into <workdir>/docker with the files they mount (the link's
    configuration, the operator's connection; the warm devices' programs and flower_internals/ beside it), so that their
    relative paths (certificates, keys, secrets, ../data, ../client_app) land in `workdir`, brought up with
    ``docker compose``."""

    def __init__(self, engine: Engine, workdir: Path, version: str) -> None:
        self.dir = workdir / "docker"
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("compose.yml", "plain-http.yml", "host-network.yml", "compose.gpu.yml"):
            shutil.copy2(COMPOSE_DIR / name, self.dir / name)
        names = ["compose.yml", "host-network.yml"]
        self.compose_argv = [DOCKER, "compose", *(a for n in names for a in ("-f", str(self.dir / n)))]
        self.env = {**engine.env, "FLWR_VERSION": version}
        self.spec = load([COMPOSE_DIR / n for n in names])
        for service in self.spec["services"].values():  # the files they mount: docker/'s own, the project's
            for source in (str(v).split(":", 1)[0] for v in service.get("volumes") or []):
                # (never the checkout's certificates, which a demo there made: this deployment makes its own)
                if source.startswith(".") and not source.startswith("./certs/") and (COMPOSE_DIR / source).is_file():
                    (self.dir / source).resolve().parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(COMPOSE_DIR / source, self.dir / source)
                elif (COMPOSE_DIR / source / "__init__.py").is_file():  # a package (flower_internals), not ../data
                    shutil.copytree(COMPOSE_DIR / source, self.dir / source, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
        self.flwr_home = workdir / "flwr-home"  # the host's `flwr`, which (e) shows cannot reach the SuperLink
        self.cli_env = {**flower_env(self.flwr_home),  # and the engine, for the operator's container
                        **{k: v for k, v in self.env.items() if k.startswith("DOCKER_") or k == "FLWR_VERSION"}}
        self.ca = make_pki(self.certs, nodes=len(supernodes(self.spec))) / "ca.crt"
        self.flwr = operator(self.compose_argv)  # the operator's, in the server's namespace

    @property
    def certs(self) -> Path:
        return self.dir / "certs"

    def compose(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        return sh([*self.compose_argv, *args], env=self.env, **kw)

    def up(self) -> float:
        """Every service up and healthy: the SuperLink first, then the SuperNodes' keys registered, then the rest;
        returns the seconds it took."""
        start = time.monotonic()
        hand_to_images(self.spec, self.certs)
        self.compose("up", "-d", "--no-build", "--pull", "never", "--wait", SUPERLINK, timeout=300)
        for node in supernodes(self.spec):
            key = auth_key(self.spec["services"][node]["command"])
            register_supernode(self.cli_env, CONNECTION, Path(f"{key}.pub"), self.flwr)
        self.compose("up", "-d", "--no-build", "--pull", "never", "--wait", timeout=300)
        return time.monotonic() - start

    def run(self, overrides: dict[str, Any], out: Path) -> tuple[Path, float]:
        """One job through the deployment (hybridfl.launch.compose's job: the main job unless `overrides` say else),
        its outputs copied from the ServerApp's outputs volume to `out`; returns the run folder and seconds."""
        run_config = demo_run_config(self.spec, overrides)
        start = time.monotonic()
        run_id, status = flwr_run(self.cli_env, CONNECTION, run_config, timeout=900, flwr=self.flwr)
        seconds = time.monotonic() - start
        out.mkdir(parents=True, exist_ok=True)
        self.compose("cp", f"{SERVERAPP}:{run_config['output-dir']}/{run_config['run-name']}", str(out))
        check_completed(run_id, status, out / run_config["run-name"])
        return out / run_config["run-name"], seconds

    def volume(self, name: str) -> Path:
        project = self.spec.get("name", "hybridfl")
        mount = sh([DOCKER, "volume", "inspect", "-f", "{{.Mountpoint}}", f"{project}_{name}"], env=self.env,
                   quiet=True).stdout.strip()
        return Path(mount)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", "-a", service, quiet=True).stdout.strip()

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, quiet=True).stdout

    def down(self, logs_to: Path) -> None:
        """Every service's log saved to `logs_to`, then containers and volumes removed."""
        logs_to.mkdir(parents=True, exist_ok=True)
        for service in self.spec["services"]:
            (logs_to / f"{service}.log").write_text(self.logs(service))
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)


def _superlink_rows(db: Path, query: str) -> list[tuple]:
    """`query`'s rows from the SuperLink's SQLite database, read-only while the SuperLink writes it."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
        return con.execute(query).fetchall()


def heartbeat_left_s(db: Path) -> float | None:
    """Seconds left before the SuperLink fails the running ServerApp for want of a heartbeat, read from the
    SuperLink's database (Flower 1.42 moves a task's ``active_until`` to 2 x 30 s after each heartbeat it receives,
    and fails the task, and its run, once that has passed); None while no task runs or the file cannot be read (the
    watcher asks again)."""
    try:
        until = [datetime.fromisoformat(row[0]).timestamp() for row in _superlink_rows(
            db, "SELECT active_until FROM task WHERE finished_at IS NULL AND active_until IS NOT NULL")]
    except sqlite3.Error:
        return None
    return min(until) - time.time() if until else None


def failed_tasks(db: Path) -> list[str]:
    """The SuperLink's own word on every task that failed (Flower's ``details``), for a failed run's message."""
    try:
        return [f"{status}: {details}" for status, details in _superlink_rows(
            db, "SELECT sub_status, details FROM task WHERE sub_status = 'failed'")]
    except sqlite3.Error as err:
        return [f"the SuperLink's database could not be read ({err})"]


KILL_AFTER_STEPS = 5  # the main job's steps before the SuperLink may be killed
MAIN_JOB_S = 70  # the main job's seconds of training: the kill, ~40 s in at most, and the restart (7-15 s) fit
REPLY_TIMEOUT_S = 30.0  # the main job's wait for a reply: a train message takes 2-7 s here, under the arm64 device


def restart_superlink_when(dep: Deployment, ready: Callable[[], bool], record: dict[str, float],
                           steps: Callable[[], int]) -> threading.Thread:
    """A watcher that, once `ready()` and just after the SuperLink acknowledged the ServerApp's heartbeat, kills
    the SuperLink's container (SIGKILL, as a crash) and starts it again with ``docker compose start``, recording
    the heartbeat window it had (``window-s``), the run's `steps()` then (``killed-at-step``) and how long until
    it was healthy again (``superlink-down-s``).

    Flower fails a run whose ServerApp sent no heartbeat for 60 s, so a SuperLink must be back within that window,
    less the ServerApp's backoff between tries (up to 20 s); killed just after a heartbeat it has the most of it,
    on a loaded machine too."""
    db = dep.volume("superlink-state") / "superlink.db"

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not ready():
            time.sleep(0.5)
        while time.monotonic() < deadline and (heartbeat_left_s(db) or 0.0) < 55.0:
            time.sleep(0.2)
        if time.monotonic() >= deadline:
            return
        record["window-s"], record["killed-at-step"] = heartbeat_left_s(db) or 0.0, steps()
        container = dep.container(SUPERLINK)
        start = time.monotonic()
        sh([DOCKER, "kill", container], env=dep.env)
        sh([DOCKER, "wait", container], env=dep.env, quiet=True)
        dep.compose("start", SUPERLINK)
        while time.monotonic() < start + 120:  # not healthy by then: no record, and the test says so
            if "healthy" in sh([DOCKER, "inspect", "-f", "{{.State.Health.Status}}", container], env=dep.env,
                               quiet=True).stdout:
                record["superlink-down-s"] = time.monotonic() - start
                return
            time.sleep(0.5)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def intrude_while_running(dep: Deployment, workdir: Path, record: dict[str, Any]) -> threading.Thread:
    """A watcher that, once the operator's run is running, makes tools/intruder.py's attempts through the devices'
    port (the edge's 8000) holding only ca.crt, and records what each got (``record["attempts"]``)."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            listed = sh([*dep.flwr(None), "ls", CONNECTION, "--format", "json"], env=dep.cli_env, check=False,
                        quiet=True)
            try:
                running = [int(r["run-id"]) for r in json.loads(listed.stdout)["runs"]
                           if r["status"].startswith("running")]
            except (ValueError, KeyError):
                running = []
            if running:
                record["attempts"] = intruder.attempts(HOST_PORTS[0], dep.ca, workdir / "intruder", running[0],
                                                       Path(MARKS))
                return
            time.sleep(1.0)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def marks(dep: Deployment) -> dict[str, list[str]]:
    """The intruder app's marks in the ServerApp's and every ClientApp's container, by service."""
    services = [SERVERAPP, *(s for s in dep.spec["services"] if s.startswith("superexec-clientapp-"))]
    return {svc: dep.compose("exec", "-T", svc, "sh", "-c", f"ls {MARKS} 2>/dev/null || true", quiet=True
                             ).stdout.split() for svc in services}


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)
    log(f"ok: {what}")


def secure_deployment(engine: Engine, workdir: Path, version: str, timings: dict[str, Any]) -> None:
    """The files' secure default: (a) the main job end to end, (b) through a SuperLink crash: its container is
    killed once the run has trained and started again; (c) the registered SuperNodes are admitted, an unregistered
    key and a plain-HTTP SuperNode are refused, and a process without the secrets is refused a task by the
    SuperLink's and a SuperNode's Runtime API; the ClientApps' ``device timing`` lines
    (benchmarks/deploy_overhead.py) into `timings`."""
    dep = Deployment(engine, workdir / "secure", version)
    try:
        timings["time-to-healthy-s"] = dep.up()
        owner = sh(["stat", "-c", "%u", str(dep.volume("superlink-state")), str(dep.volume("outputs"))],
                   quiet=True).stdout.split()
        check(owner == [str(IMAGE_UID)] * 2, f"both volumes belong to the images' user {IMAGE_UID}: {owner}")
        # the demo's main job for MAIN_JOB_S seconds of training instead of its 20 steps, the SuperLink killed at the
        # ServerApp's first heartbeat (Flower's: every 21-27 s) after its KILL_AFTER_STEPS-th step: at most ~40 s
        # into the run, which must still be training then (a ServerApp that ends while its SuperLink is down fails
        # its run). A time rather than a count of steps: 40 steps took 17 s on one machine, 150 took 225 s on a
        # slower one under load. A reply the restart lost (its objects never reached the SuperLink: seen once, the
        # run stalled 190 s on it, 15 steps in all, accuracy 0.76) is counted after REPLY_TIMEOUT_S and the run goes on
        job = {"run-name": "compose-main", "num-rounds": 10_000, "time-budget-s": MAIN_JOB_S,
               "reply-timeout-s": REPLY_TIMEOUT_S}
        demo_run_config(dep.spec, job)
        metrics = dep.volume("outputs") / "compose-main" / "metrics.jsonl"
        record: dict[str, float] = {}
        watcher = restart_superlink_when(
            dep, lambda: metrics.exists() and len(metrics.read_text().splitlines()) > KILL_AFTER_STEPS, record,
            steps=lambda: len(metrics.read_text().splitlines()) - 1)
        intrusion: dict[str, Any] = {}
        intruding = intrude_while_running(dep, workdir, intrusion)
        try:
            run, timings["main-job-s"] = dep.run(job, workdir / "runs")
        except RuntimeError as failed:
            raise RuntimeError(f"{failed}; the SuperLink was killed with {record.get('window-s', float('nan')):.1f} s "
                               f"of the ServerApp's heartbeat window left, and was healthy again after "
                               f"{record.get('superlink-down-s', float('nan')):.1f} s; failed tasks: "
                               f"{failed_tasks(dep.volume('superlink-state') / 'superlink.db')}") from failed
        watcher.join(60)
        intruding.join(120)
        main = summary(run)
        timings["main-job-accuracy"] = main["final-test-accuracy"]
        check("superlink-down-s" in record, "(b) the SuperLink container was killed once the run had trained "
              f"and started again, healthy after {record.get('superlink-down-s', float('nan')):.1f} s")
        timings["superlink-down-s"] = record["superlink-down-s"]
        rounds = [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = rounds[-1]
        check(main["strategy"]["strategy"] == "feddle" and main["final-version"] >= 1
              and rounds == list(range(steps + 1)) and steps > record["killed-at-step"],
              f"(a, b) the main job completed through the restart: Feddle-ID, {steps} steps in its "
              f"{MAIN_JOB_S} s, the SuperLink killed after step {record['killed-at-step']}, "
              f"{main['final-version']} versions from {main['total-accepted']} updates, test accuracy "
              f"{main['final-test-accuracy']:.4f}, summary.json copied to {run}")
        check(main["final-test-accuracy"] > 0.8, "(a) the main job learned (test accuracy > 0.8)")
        edge_refuses(dep, intrusion.get("attempts"))
        intruders(dep)
        server_unreachable(dep)
    finally:
        dep.down(workdir / "secure" / "logs")
    trains = [d for d in device_timings(sorted((workdir / "secure" / "logs").glob("superexec-clientapp-*.log")))
              if d["message"] == "train"]
    timings["device-per-train-message-s"] = {  # Feddle-ID's steps overlap: no round to split Flower's rest from
        part: round(sum(d.get(part, 0.0) for d in trains) / max(len(trains), 1), 3)
        for part in ("flower-s", "import-s", "data-s", "model-s", "work-s", "handler-s")} | {"messages": len(trains)}


TUTORIAL = PROJECT_DIR / "docs" / "tutorials" / "fleet.md"


def fleet_demo(engine: Engine, version: str, workdir: Path, timings: dict[str, Any]) -> None:
    """(f) A fleet on the real engine, the tutorial's section "4. The fleet on Docker" run as written from a folder
    of its own (the demo with ``--no-build``: the images were built above, from the wheelhouse): each device's link
    through its shaper container, its ClientApp container limited to its memory and cores, device 2 switched off and
    on by its windows, device 1's training processes killed by the kernel for its 520 MB (Docker's OOM events
    counted, the messages failed), and the run going on to finished:completed. Then the deployment is taken down."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**engine.env, "FLWR_VERSION": version, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    log(f"the tutorial's section 4 ({TUTORIAL.name}), from {workdir}")
    t = time.monotonic()
    output = ""
    dc = [DOCKER, "compose", *(a for f in compose_files(host=True) for a in ("-f", str(f))), "-f", str(FLEET_FILE)]
    try:  # the demo leaves its deployment up, a failed run's too: taken down below whatever happens
        for command in bash_blocks(TUTORIAL, "4."):
            command = command.replace("python -m hybridfl.launch.compose demo",
                                      "python -m hybridfl.launch.compose demo --no-build")
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=workdir, env=env,
                                  capture_output=True, text=True, timeout=900)
            output += done.stdout + done.stderr
            (workdir / "tutorial.log").write_text(output)
            check(done.returncode == 0, f"(f) the tutorial's fleet on Docker ran (exit {done.returncode}): "
                                        f"{output[-1500:]}")
        timings["fleet-demo-s"] = time.monotonic() - t
        drawn = load_fleet(str(workdir / "fleet.yaml"), 3, 0)
        check([d.name for d in drawn.devices] == ["steady", "small", "steady"],
              f"(f) the fleet's draw by seed 0, as the tutorial says: {[d.name for d in drawn.devices]}")
        local = PROJECT_DIR / "outputs" / "compose" / Path(re.findall(r"outputs in (\S+)", output)[-1]).name
        report = json.loads((local / "fleet.json").read_text())
        nodes = report["devices"]
        check((nodes[2]["stops"], nodes[2]["starts"]) == (1, 2) and nodes[0]["stops"] == nodes[1]["stops"] == 0,
              f"(f) device 2 was switched off and on by its windows, the others never: {nodes}")
        check(nodes[1]["oom-kills"] >= 1 and nodes[0]["oom-kills"] == nodes[2]["oom-kills"] == 0,
              f"(f) the small device's training was killed for its memory, and counted: "
              f"{[n['oom-kills'] for n in nodes]}")
        ids = [sh([*dc, "ps", "-a", "-q", f"superexec-clientapp-{i}"], env=env, quiet=True).stdout.split()[0]
               for i in range(len(drawn))]
        limits = sh([DOCKER, "inspect", "-f", "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}}", *ids], env=env,
                    quiet=True).stdout.splitlines()
        check(limits == [f"{d.memory_mb * 2**20} {int(d.cpus * 1e9)}" for d in drawn.devices],
              f"(f) each ClientApp container holds its device's memory and cores: {limits}")
        for i, device in enumerate(drawn.devices):
            shaper = sh([*dc, "logs", "--no-color", f"shaper-{i}"], env=env, quiet=True).stdout
            check(f"latency {device.latency_s:g} s" in shaper, f"(f) device {i}'s link is shaped: {shaper[-300:]}")
        result = summary(local)
        events = [json.loads(line) for line in (local / "events.jsonl").read_text().splitlines()]
        failed = [e for e in events if e["client"] == 1 and "ClientApp stopped responding" in e.get("reason", "")]
        check(len(failed) >= 1 and result["final-test-accuracy"] > 0.5,
              f"(f) the small device's killed messages failed ({len(failed)}: Flower's error once their heartbeat "
              f"expired) and the run went on, test accuracy {result['final-test-accuracy']:.3f}")
        timings["fleet"] = report["total"]
    finally:
        sh([*dc, "down", "--volumes", "--remove-orphans", "--timeout", "20"], env=env, timeout=300, check=False)


def demo_interrupted(engine: Engine, version: str, workdir: Path) -> None:
    """`make compose-demo HOST=1 ARGS=--no-build` as a user runs it (the images built above), sent SIGTERM while its
    job streams: it exits 143 within 60 s, leaves no process of its own and no container running, and keeps its
    volumes (the SuperLink's state, the outputs)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hybridfl.launch.compose", "demo", "--host-network", "--no-build"]
    log("$ " + " ".join(cmd))
    demo = subprocess.Popen(cmd, cwd=workdir, env={**engine.env, "FLWR_VERSION": version}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    streaming = threading.Event()

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if "Successfully started run" in line:
                streaming.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        check(streaming.wait(600), "the demo's job started: " + "".join(lines[-3:]).strip())
        seen = process_tree([demo.pid])
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        (workdir / "demo.log").write_text("".join(lines))
    check(code == 143, f"the demo, sent SIGTERM while its job streamed, exited {code} (143 expected)")
    left = sorted(alive({p.pid for p in seen}))
    check(left == [], f"none of the demo's {len(seen)} processes is left running ({left})")
    running = engine.docker("ps", "-q", quiet=True).stdout.split()
    check(running == [], f"the demo took its deployment down: no container running ({running})")
    volumes = engine.docker("volume", "ls", "-q", quiet=True).stdout.split()
    check({"hybridfl_superlink-state", "hybridfl_outputs"} <= set(volumes), f"and kept its volumes ({volumes})")
    for volume in volumes:
        engine.docker("volume", "rm", volume, quiet=True)


def edge_refuses(dep: Deployment, attempts: dict[str, str] | None) -> None:
    """(d) What a process on the devices' network holding only ca.crt got through the edge while the main job ran
    (tools/intruder.py): every attempt refused with the edge's 404 and no mark of its app in any container; then the
    operator's `flwr` (in the server's namespace) starts the same app, and its marks appear on the server and every
    device."""
    check(attempts is not None, "(d) the intruder's attempts ran while the operator's run was running")
    got = "; ".join(f"{what}: {outcome[:60]}" for what, outcome in attempts.items())
    check(all(outcome.startswith("refused") and "404" in outcome for outcome in attempts.values()),
          f"(d) on the devices' port, a process holding only ca.crt is refused everything with the edge's 404: {got}")
    check(not any(marks(dep).values()), "(d) no file of the intruder's app on the server or any device")
    status = intruder.operator_runs_it(dep.cli_env, CONNECTION, Path(MARKS), dep.flwr)
    found = marks(dep)
    check(status == "finished:completed" and all(found.values()),
          f"(d) the operator's `flwr` (the `operator` service, in the server's namespace) starts the same app "
          f"({status}), and it ran everywhere: {found}")


def intruders(dep: Deployment) -> None:
    """(c) Who is kept out of a running deployment: an unregistered SuperNode key, a plain-HTTP SuperNode, and a
    process that asks the Runtime APIs for a task without their secrets."""
    activated = set(re.findall(r"Activated node_id=(\d+)", dep.logs(SUPERLINK)))
    check(len(activated) == 2, f"(c) the two registered SuperNodes were admitted ({sorted(activated)})")
    template = dep.spec["services"]["supernode-1"]["command"]
    node_cmd = list(template)
    node_cmd[node_cmd.index("--port") + 1] = "9096"
    key = node_key(dep.certs, "supernode-unregistered")
    os.chown(key, IMAGE_UID, IMAGE_UID)
    node_cmd[node_cmd.index("--auth-supernode-private-key") + 1] = "/app/certs/supernode-unregistered"
    rogue = dep.compose("run", "--rm", "--no-deps", "-v", f"{key}:/app/certs/supernode-unregistered:ro",
                        "supernode-1", "--max-retries", "1", "--max-wait-time", "20", *node_cmd, check=False,
                        timeout=120)
    check(rogue.returncode != 0 and "No SuperNode found with the given public key" in dep.logs(SUPERLINK),
          "(c) an unregistered key is refused: the SuperLink says 'No SuperNode found with the given public key'")

    plain_cmd = ["--insecure", "--superlink", "edge:8000", "--max-retries", "1", "--max-wait-time", "20",
                 "--isolation", "process", "--host", "127.0.0.1", "--port", "9097",
                 "--node-config", "partition-id=1 num-partitions=2"]
    plain = dep.compose("run", "--rm", "--no-deps", "supernode-1", *plain_cmd, check=False, timeout=120)
    output = plain.stdout + plain.stderr
    after = set(re.findall(r"Activated node_id=(\d+)", dep.logs(SUPERLINK)))
    check(plain.returncode != 0 and "Exit Code: 305" in output and after == activated,
          "(c) a plain-HTTP SuperNode is refused (exit code 305, "
          f"{'disconnected' if 'disconnected' in output else 'no connection'}); no node was admitted")

    for what, refused in (("the SuperLink's (asked from the server's namespace)", acquire_inside(dep)),
                          ("supernode-0's", acquire_task_anonymously("127.0.0.1:9094"))):
        code, text = (None, None) if refused is None else (refused.status_code, refused.text)
        check(code == 401 and "Authentication failed" in str(text),
              f"(c) {what} Runtime API refuses a task to a process without its secret ({code}: {text})")


def acquire_inside(dep: Deployment) -> httpx.Response | None:
    """:func:`acquire_task_anonymously` run in the ServerApp's container (the server's network namespace, where the
    SuperLink's port is): the refusal as a response, or None if a task was handed out."""
    script = "\n".join(["from __future__ import annotations", "import json, httpx",
                        inspect.getsource(acquire_task_anonymously),
                        f"r = acquire_task_anonymously('localhost:{superlink_port(dep.spec)}', '/app/certs/ca.crt')",
                        "print(json.dumps(None if r is None else [r.status_code, r.text]))"])
    said = json.loads(dep.compose("exec", "-T", SERVERAPP, "python", "-c", script, quiet=True).stdout)
    return None if said is None else httpx.Response(said[0], text=said[1])


def server_unreachable(dep: Deployment) -> None:
    """(e) The SuperLink's port exists only in the server's namespace: nothing listens on it on the host (whose
    network the edge and the devices share here), and the edge's socket to it is closed to any other user of the
    host; a stranger's upload over the edge's body limit is refused before the SuperLink reads it."""
    port = superlink_port(dep.spec)
    with socket.socket() as s:
        refused = s.connect_ex(("127.0.0.1", port))
    check(refused != 0, f"(e) nothing listens on the SuperLink's port {port} on the host's loopback "
                        f"(connect: {os.strerror(refused)})")
    write_connection(dep.flwr_home, "host", port, dep.ca)
    listed = sh(["flwr", "ls", "host", "--format", "json"], env=dep.cli_env, check=False, quiet=True)
    check("unavailable" in listed.stdout, "(e) `flwr ls` on the host, at the SuperLink's port, gets no answer: "
          + listed.stdout.strip().replace("\n", " ")[:160])
    sock = dep.volume("socket") / "link.sock"
    stranger = sh(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                   f"import socket; socket.socket(socket.AF_UNIX).connect({str(sock)!r})"], check=False, quiet=True)
    said_to_stranger = (stranger.stderr.strip().splitlines() or [f"exit {stranger.returncode}"])[-1][:120]
    check(stranger.returncode != 0 and "PermissionError" in stranger.stderr,
          f"(e) another user of the host (nobody) cannot connect to the edge's socket to the SuperLink ({sock}): "
          + said_to_stranger)
    said = hostile_client.upload(HOST_PORTS[0], dep.ca, "/v1/fleet/push-object", 16, chunked=False,
                                 source="127.0.0.1")
    check(said == "413", f"(e) a stranger's 16 MiB upload to the devices' port is refused by the edge ({said})")


def gpu_config(engine: Engine, version: str) -> None:
    """compose.gpu.yml: validated by compose; it builds the same Dockerfile with PyPI's (CUDA) torch."""
    argv = [DOCKER, "compose", *(a for n in ("compose.yml", "compose.gpu.yml")
                                  for a in ("-f", str(COMPOSE_DIR / n))), "config", "--format", "json"]
    config = json.loads(sh(argv, env={**engine.env, "FLWR_VERSION": version}).stdout)
    server = config["services"][SERVERAPP]
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    check(server["build"]["args"]["TORCH_INDEX"] == "https://pypi.org/simple" and devices[0]["driver"] == "nvidia",
          "compose.gpu.yml validates: the ServerApp's image with PyPI's CUDA torch and one NVIDIA GPU reserved")
    cuda = engine.docker("run", "--rm", "--network", "host", "--entrypoint", "python", f"hybridfl/app:{version}",
                         "-c", "import torch; print(torch.__version__, torch.version.cuda)").stdout.split()
    check(cuda[1] != "None", f"the app image's torch {cuda[0]} is a CUDA build (CUDA {cuda[1]}): the GPU image's "
          "content; it was not run on a GPU (none here)")


# -- main -------------------------------------------------------------------------------------------------------

def ports_free() -> None:
    import socket

    for port in HOST_PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} on 127.0.0.1 is in use; the compose files need it under host "
                                   f"networking (ports {HOST_PORTS})")


def tree_digest() -> str | None:
    """A digest of every tracked file (path and bytes): what the images are built from and the services run;
    None outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_DIR, capture_output=True, check=False)
    except OSError:  # no git
        return None
    if listed.returncode != 0:
        return None
    digest = hashlib.sha256()
    for name in sorted(filter(None, listed.stdout.decode().split("\0"))):
        path = PROJECT_DIR / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return digest.hexdigest()


def passed_here(workdir: Path = WORKDIR) -> bool:
    """Whether this test passed on a real engine for the tracked tree as it is now."""
    try:
        tree = json.loads((workdir / PASSED).read_text())["tree"]
    except (OSError, ValueError, KeyError):
        return False
    return tree is not None and tree == tree_digest()


def compose_test(workdir: Path, keep_engine: bool = False) -> dict[str, Any]:
    """Everything above, in order; returns the timings (also written to <workdir>/timings.json) and, when every
    check passed, writes <workdir>/passed.json with the digest of the tree it started from."""
    start, tree = time.monotonic(), tree_digest()
    ensure_tools()
    ports_free()
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    engine = Engine(Path(tempfile.mkdtemp(prefix="hybridfl-engine-")), CACHE / "engine")
    timings: dict[str, Any] = {}
    try:
        engine.start()
        t = time.monotonic()
        version = importlib.metadata.version("flwr")
        edge = load([COMPOSE_DIR / "compose.yml"])["services"]["edge"]["image"]
        with ThreadPoolExecutor(1) as pool:  # pip's downloads run while debootstrap's do
            timings["images"] = build_images(engine, version, edge, pool.submit(wheelhouse).result)
        timings["build-s"] = time.monotonic() - t
        for image, source in timings["images"].items():
            log(f"image {image}: {source}")
        gpu_config(engine, version)
        secure_deployment(engine, workdir, version, timings)
        fleet_demo(engine, version, workdir / "fleet", timings)
        t = time.monotonic()
        demo_interrupted(engine, version, workdir / "demo")
        timings["demo-interrupted-s"] = time.monotonic() - t
        (workdir / PASSED).write_text(json.dumps({"tree": tree}) + "\n")
    finally:
        if not keep_engine:
            engine.stop()
        timings["total-s"] = time.monotonic() - start
        (workdir / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--require", action="store_true", help="fail (exit 1) instead of skipping without an engine")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--keep-engine", action="store_true", help="leave dockerd running (debugging)")
    parser.add_argument("--tools-only", action="store_true",
                        help="install docker.io, debootstrap and the Compose v2 plugin, then stop (CI: before the "
                             "suite, whose test compares the twin with `docker compose config`)")
    args = parser.parse_args(argv)
    try:
        if args.tools_only:
            ensure_tools()
            return 0
        timings = compose_test(args.workdir.resolve(), args.keep_engine)
    except Skip as why:
        log(f"SKIPPED: no Docker engine can run here: {why}")
        return 1 if args.require else 0
    except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as err:
        log(f"FAILED: {err}")
        return 1
    log(f"passed in {timings['total-s']:.0f} s: " + json.dumps({k: v for k, v in timings.items() if k != "images"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
