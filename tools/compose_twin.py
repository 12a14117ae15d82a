"""docker/compose.yml's twin: every service's exact command started natively on loopback, no Docker engine.

    python -m tools.compose_twin [--plain-http] [--flower-devices] [--workdir DIR] [KEY=VALUE ...]   # make compose-twin

The twin reads the compose files (hybridfl/launch/compose.py: merged, interpolated, checked), and starts every service's
command as a local process, in ``depends_on`` order, waiting for each dependency's own healthcheck command: a
service name in an address becomes 127.0.0.1, each (service, container port) gets a free port (a service in
another's network namespace, ``network_mode: service:X``, shares X's), ``--host 0.0.0.0`` becomes 127.0.0.1, each
volume becomes a folder under the workdir (bind mounts: their source; a mounted ``.conf`` file rendered with the
twin's addresses; a named volume under /run/, a socket's, a short folder of its own), and every service gets its own
FLWR_HOME as every container has its own HOME. SuperNodes started with ``--auth-supernode-private-key K`` are
registered (``K.pub``) before they start, as the demo does. Then it runs the demo's job with ``flwr run`` and checks
that it finished:completed. What the twin cannot show: image contents, the Docker network and network namespaces
(its SuperLink's port is on this machine's loopback, where its operator's `flwr` runs), GPU reservation, volume
ownership: ``make compose-test`` (tools/compose_engine.py) runs the files on a real engine. The project's test rig,
not part of the installed package.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.compose import CERTS, CONNECTION, certificates, demo_run_config, read_command_line
from hybridfl.launch.compose_file import (
    COMPOSE_DIR,
    ENTRYPOINTS,
    SERVERAPP,
    SUPERLINK,
    ComposeError,
    auth_key,
    image_of,
    is_setup,
    load,
    missing_modules,
    on_demand,
    start_order,
    superlink_port,
    volume_spec,
)
from hybridfl.launch.flwr_cli import check_completed, flwr_run, register_supernode, run_and_report, write_connection
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, wait_until

UNIX_PATH_MAX = 107  # Linux's sun_path, less its terminating NUL


@dataclass
class Twin:
    """Where each service's container ports and paths land on this machine: named volumes in
    <workdir>/volumes, the certificates' bind mount in <workdir>/certs (a fresh CA per twin, as a fresh
    deployment), other bind mounts at their source."""

    compose: dict[str, Any]
    workdir: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    _runtime: Path | None = None

    @property
    def runtime(self) -> Path:
        """Where named volumes mounted under /run/ (sockets: the link's) land: a short folder of the twin's own
        that others may traverse, not list (0711): a unix socket's path has at most 107 bytes, and nginx's workers
        (`nobody` under a root master) must reach the socket. Removed by :meth:`close`."""
        if self._runtime is None:
            self._runtime = Path(tempfile.mkdtemp(prefix="hybridfl-twin-"))
            self._runtime.chmod(0o711)
        return self._runtime

    def close(self) -> None:
        if self._runtime is not None:
            shutil.rmtree(self._runtime, ignore_errors=True)
            self._runtime = None

    @property
    def certs(self) -> Path:
        return self.workdir / "certs"

    def owner(self, service: str) -> str:
        """The service whose network namespace `service` is in (``network_mode: service:X``), else itself."""
        mode = str(self.compose["services"][service].get("network_mode", ""))
        return mode.removeprefix("service:") if mode.startswith("service:") else service

    def port(self, service: str, container_port: int) -> int:
        """The port on this machine of `service`'s `container_port` (its namespace's: a namespace is one host)."""
        service = self.owner(service)
        if (service, container_port) not in self.ports:
            taken = set(self.ports.values())
            while (p := free_port()) in taken:
                pass
            self.ports[(service, container_port)] = p
        return self.ports[(service, container_port)]

    def paths(self, service: str) -> list[tuple[str, Path]]:
        """(container path, host path) of `service`'s volumes, longest container path first. A mounted ``.conf``
        file (the edge's nginx configuration) is read by the service as its command is: it lands in
        <workdir>/files/<service>/ at its container path, rendered by :meth:`render`."""
        out = []
        for spec in self.compose["services"][service].get("volumes") or []:
            source, target, _ = volume_spec(spec)
            resolved = (COMPOSE_DIR / source).resolve()
            if resolved.is_relative_to(CERTS):
                host = self.certs / resolved.relative_to(CERTS)
            elif source.startswith((".", "/")):
                host = self._rendered(service, target) if resolved.suffix == ".conf" else resolved
            else:
                host = (self.runtime if target.startswith("/run/") else self.workdir / "volumes") / source
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, host))
        return sorted(out, key=lambda tp: -len(tp[0]))

    def _rendered(self, service: str, target: str) -> Path:
        return self.workdir / "files" / service / target.lstrip("/")

    def render(self, service: str) -> None:
        """Write `service`'s mounted ``.conf`` files with their addresses, ports and paths mapped (:meth:`text`)."""
        for spec in self.compose["services"][service].get("volumes") or []:
            source, target, _ = volume_spec(spec)
            if source.startswith(".") and source.endswith(".conf"):
                host = self._rendered(service, target)
                host.parent.mkdir(parents=True, exist_ok=True)
                text = self.text(service, (COMPOSE_DIR / source).read_text())
                for path in re.findall(r"unix:([^\s;]+)", text):
                    if len(path.encode()) > UNIX_PATH_MAX:
                        raise ComposeError(f"service {service}: the socket {path} is longer than a unix socket's "
                                           f"{UNIX_PATH_MAX} bytes: use a shorter --workdir")
                host.write_text(text)

    def text(self, service: str, value: str) -> str:
        """`value` as seen on this machine: service addresses, loopback ports (those of the service whose network
        namespace it shares) and container paths mapped."""
        services = self.compose["services"]
        own = self.owner(service)
        value = re.sub(r"\b([A-Za-z0-9_.-]+):(\d+)\b", lambda m: (
            f"127.0.0.1:{self.port(m[1], int(m[2]))}" if m[1] in services else
            f"127.0.0.1:{self.port(own, int(m[2]))}" if m[1] in ("127.0.0.1", "localhost", "0.0.0.0") else m[0]),
            value)
        for target, host in self.paths(service):
            value = re.sub(rf"{re.escape(target)}(?=/|\b|$)", str(host), value)
        return value

    def command(self, service: str) -> list[str]:
        """The service's entrypoint (its own, else its image's) and command, as run on this machine (its mounted
        configuration files rendered); a program this machine lacks (nginx) is an error naming it."""
        svc = self.compose["services"][service]
        args = svc["command"]
        out = ([sys.executable if a == "python" else self.text(service, a) for a in svc["entrypoint"]]
               if "entrypoint" in svc else [ENTRYPOINTS[image_of(service, svc)]])
        program = shutil.which(out[0], path=os.pathsep.join((self.env(service)["PATH"], "/usr/sbin", "/sbin")))
        if program is None:
            raise ComposeError(f"service {service}: the twin runs {out[0]!r} natively, and this machine has none "
                               f"(Debian: apt-get install {out[0]})")
        out[0] = program
        self.render(service)
        for spec in svc.get("volumes") or []:
            source, target, _ = volume_spec(spec)
            if source.endswith(".conf") and (missing := missing_modules(self._rendered(service, target).read_text())):
                raise ComposeError(f"service {service}: its {source} loads {', '.join(missing)}, which this machine "
                                   "lacks (Debian: apt-get install libnginx-mod-stream)")
        for i, arg in enumerate(args):
            before = args[i - 1] if i else ""
            out.append("127.0.0.1" if before == "--host" else str(self.port(service, int(arg))) if before == "--port"
                       else self.text(service, arg))
        return out

    def env(self, service: str) -> dict[str, str]:
        """`service`'s environment: its own FLWR_HOME (each container has its own HOME), its ``environment``."""
        own = self.compose["services"][service].get("environment") or {}
        return {**flower_env(self.workdir / "home" / service),
                **{k: self.text(service, str(v)) for k, v in own.items()}}

    def healthy(self, service: str) -> bool:
        test = self.compose["services"][service]["healthcheck"]["test"]
        argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
        argv = [sys.executable if a == "python" else self.text(service, a) for a in argv]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0


def twin(files: list[Path], jobs: list[dict[str, Any]], workdir: Path,
         on_started: Callable[[ProcessGroup, Twin], None] | None = None,
         on_done: Callable[[Twin], None] | None = None) -> tuple[list[Path], set[int]]:
    """Run the compose files' services natively and the jobs (overrides of :func:`demo_run_config`) through them one
    after the other; return their run folders (in the outputs volume) and every PID started (all stopped by
    now). `on_started(processes, twin)` runs once every service is up (tests stop or restart services there),
    `on_done(twin)` after the jobs, the services still up."""
    compose = load(files)
    t = Twin(compose, workdir)
    env = flower_env(workdir / "home" / "cli")
    run_configs = []
    for i, overrides in enumerate(jobs):
        run_config = demo_run_config(compose, overrides)
        run_configs.append({**run_config, "output-dir": t.text(SERVERAPP, run_config["output-dir"]),
                            "run-name": f"{run_config['run-name']}-{i}"})
    ca = certificates(compose, t.certs)  # once every job is known to be valid
    with contextlib.closing(t), ProcessGroup(workdir / "logs", env) as procs:
        for name in start_order(compose["services"]):
            svc = compose["services"][name]
            if is_setup(svc) or on_demand(svc):
                continue
            for dep, cond in (svc.get("depends_on") or {}).items():
                if (cond or {}).get("condition") == "service_healthy":
                    wait_until(dep, lambda d=dep: t.healthy(d), dict(procs.procs)[dep], 90.0, 0.5)
            cmd = t.command(name)
            if key := auth_key(cmd):
                register_supernode(env, CONNECTION, Path(f"{key}.pub"))
            procs.start(name, cmd, t.env(name))
            if name == SUPERLINK:
                wait_until(name, lambda: t.healthy(SUPERLINK), dict(procs.procs)[name], 90.0, 0.5)
                write_connection(workdir / "home" / "cli", CONNECTION, t.port(SUPERLINK, superlink_port(compose)), ca)
        if on_started:
            on_started(procs, t)
        outcomes = [flwr_run(env, CONNECTION, c) for c in run_configs]
        if on_done:
            on_done(t)
    paths = [Path(c["output-dir"]) / c["run-name"] for c in run_configs]
    for (run_id, status), path in zip(outcomes, paths):
        check_completed(run_id, status, path)
    return paths, procs.pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--workdir", type=Path, default=PROJECT_DIR / "outputs" / "compose-twin",
                        help="folder for volumes, FLWR_HOMEs and logs")
    if (read := read_command_line(parser, argv)) is None:
        return 2
    args, files, _, overrides, _ = read
    return run_and_report(lambda: twin(files, [overrides], args.workdir.resolve())[0][0])


if __name__ == "__main__":
    sys.exit(main())
