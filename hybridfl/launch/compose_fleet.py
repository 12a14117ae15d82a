"""A fleet (common/fleet.py) on docker/compose.yml: N SuperNodes, each made the device its profile draws.

    python -m hybridfl.launch.compose demo --fleet lognormal --nodes 12 [--host-network] [KEY=VALUE ...]

:func:`write_fleet_file` writes a compose file that goes after the others (``-f``): device i is three services,

* ``shaper-i``: the device's network. A user-space shaper (hybridfl/launch/shaper.py, mounted into the app image as the
  warm devices' programs are) listens on the device's own loopback, port ``SHAPER_PORT + i``, and relays to the
  edge through the profile's link (latency, up and down rates, loss, seeded per device). Its container holds the
  device's network namespace; the other two join it (``network_mode: service:shaper-i``), so the SuperNode reaches
  the SuperLink only through its link;
* ``supernode-i`` (supernode-0's definition, its key, secret and ports its own): ``--superlink`` the shaper, its
  node config the partition and the profile's pacing (client_app/work.py);
* ``superexec-clientapp-i`` (superexec-clientapp-0's): the device's memory (``mem_limit``, no swap) and cores
  (``cpus``), where the device trains. The SuperNode's container (its Fleet client, ~100 MB) is not limited:
  Compose limits a container, and the two containers of a device have no common parent Compose can name.

Docker is the devices' supervisor (restart policies). The kernel's OOM killer picks a container's largest process:
on a device too small for training, the message's process (an ``oom`` event, counted); Flower answers that message
with an error once its heartbeat expires, and the device keeps its place in the run. :class:`ComposeSchedule` stops
and starts devices by their windows (``docker compose stop`` and ``start``, both containers) from the run's first
round on and writes ``fleet.json``.
With ``--host-network`` every container of a device is on the host's network (ports still the device's own).
"""

from __future__ import annotations

import copy
import re
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from common.fleet import Fleet
from hybridfl.launch.processes import (
    SHAPER_PORT,  # device i's shaper: SHAPER_PORT + i (distinct on the host's network too)
)
from hybridfl.launch.real_fleet import COUNTS, Schedule, link_seed, pacing, profile

SHAPER_FILE = "../hybridfl/launch/shaper.py"  # relative to docker/, as every path of the compose files
NODE, EXECUTOR, SHAPER = "supernode-{}", "superexec-clientapp-{}", "shaper-{}"


class _Reset(list):
    pass


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # every service written out in full
        return True


_Dumper.add_representer(_Reset, lambda dumper, data: dumper.represent_sequence("!reset", data))


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _with_flag(command: list[str], flag: str, value: str) -> list[str]:
    out = list(command)
    out[out.index(flag) + 1] = value
    return out


def _renamed(value: Any, i: int) -> Any:
    """`value` (a service's definition) with supernode-0's name, key and secret made supernode-i's."""
    if isinstance(value, dict):
        return {_renamed(k, i): _renamed(v, i) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, i) for v in value]
    return re.sub(r"\bsupernode-0\b", NODE.format(i), value) if isinstance(value, str) else value


def fleet_services(compose: dict[str, Any], fleet: Fleet, fleet_file: Path | None = None) -> dict[str, Any]:
    """The compose file (a mapping) that makes `compose` (the files merged, :func:`hybridfl.launch.compose_file.load`) a
    fleet of ``len(fleet)`` devices (see the module docstring). `fleet_file`, a user's fleet file, is mounted for the
    ServerApp."""
    services = compose["services"]
    node0, executor0 = services[NODE.format(0)], services[EXECUTOR.format(0)]
    host = node0.get("network_mode") == "host"
    edge = _flag(node0["command"], "--superlink")
    port0 = int(_flag(node0["command"], "--port"))
    out: dict[str, Any] = {}
    n = len(fleet)
    for i, device in enumerate(fleet.devices):
        shaper_port, port = SHAPER_PORT + i, port0 + i
        node, executor = _renamed(copy.deepcopy(node0), i), _renamed(copy.deepcopy(executor0), i)
        link = (f"127.0.0.1:{shaper_port}={edge},latency_s={device.latency_s!r},up_bytes_per_s="
                f"{device.up_bytes_per_s!r},down_bytes_per_s={device.down_bytes_per_s!r},drop={device.drop!r},"
                f"seed={link_seed(fleet, i)}")
        shaper = {key: executor0[key] for key in ("image", "build") if key in executor0}
        shaper |= {"entrypoint": ["python", "/opt/hybridfl/shaper.py"], "command": ["--route", link],
                   "volumes": [f"{SHAPER_FILE}:/opt/hybridfl/shaper.py:ro"], "restart": "unless-stopped",
                   "depends_on": {"edge": {"condition": "service_started"}}}
        if host:
            shaper |= {"network_mode": "host", "extra_hosts": node0.get("extra_hosts", [])}
        else:
            shaper["networks"] = node0.get("networks", [])
            for svc in (node, executor):
                svc["network_mode"] = f"service:{SHAPER.format(i)}"
        for svc in (node, executor):  # Compose adds networks up: the base's would join a namespace given by mode
            svc["networks"] = _Reset()
        node["command"] = _with_flag(_with_flag(_with_flag(node["command"], "--superlink", f"127.0.0.1:{shaper_port}"),
                                                "--port", str(port)),
                                     "--node-config", f"partition-id={i} num-partitions={n} {pacing(device)}")
        node["healthcheck"] = {**node["healthcheck"], "test": [
            re.sub(rf":{port0}/", f":{port}/", a) for a in node["healthcheck"]["test"]]}
        for svc in (node, executor):
            svc.setdefault("depends_on", {})[SHAPER.format(i)] = {"condition": "service_started"}
        executor["command"] = _with_flag(executor["command"], "--runtime-api-address", f"127.0.0.1:{port}")
        if device.memory_mb:
            executor |= {"mem_limit": f"{device.memory_mb}m", "memswap_limit": f"{device.memory_mb}m"}
        if device.cpus:
            executor["cpus"] = device.cpus
        out |= {SHAPER.format(i): shaper, NODE.format(i): node, EXECUTOR.format(i): executor}
    operator = services.get("operator")
    if operator is not None:  # it registers every device's key
        out["operator"] = {"volumes": [f"./certs/{NODE.format(i)}.pub:/app/certs/{NODE.format(i)}.pub:ro"
                                       for i in range(n)]}
    if fleet_file is not None:  # at the same path: the run's `fleet` names it, checked here before it starts there
        folder = fleet_file.resolve().parent
        out["superexec-serverapp"] = {"volumes": [f"{folder}:{folder}:ro"]}
    return {"services": out}


def write_fleet_file(path: Path, compose: dict[str, Any], fleet: Fleet, fleet_file: Path | None = None) -> Path:
    """:func:`fleet_services` written to `path` as YAML (with Compose's ``!reset``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Generated by hybridfl.launch.compose_fleet for the fleet {fleet.name!r} ({len(fleet)} devices, seed "
              f"{fleet.seed}) from docker/'s files as they read then (variables filled in): use after them\n"
              f"# (docker compose -f ... -f {path.name}); python -m hybridfl.launch.compose demo --fleet writes it "
              "again\n")
    path.write_text(header + yaml.dump(fleet_services(compose, fleet, fleet_file), Dumper=_Dumper, sort_keys=False,
                                       width=120))
    return path


class ComposeSchedule(Schedule):
    """A fleet's windows applied to a compose deployment (`dc`: its ``docker compose`` command line): devices stopped
    and started with ``docker compose stop`` and ``start``; Docker's own ``oom`` events counted per device while it
    follows; :meth:`close` writes ``fleet.json``."""

    def __init__(self, fleet: Fleet, dc: list[str], env: dict[str, str]) -> None:
        super().__init__(fleet, self._start, self._stop)
        self.dc, self.env = dc, env
        self._events: subprocess.Popen | None = None
        self._ooms: Counter[str] = Counter()
        self._reader: threading.Thread | None = None
        for i in range(len(fleet)):  # `up` started every device
            self.started(i)

    def _compose(self, *args: str) -> None:
        subprocess.run([*self.dc, *args], env=self.env, capture_output=True, check=False, timeout=120)

    def _start(self, i: int) -> None:
        self._compose("start", NODE.format(i), EXECUTOR.format(i))
        self.started(i)

    def _stop(self, i: int) -> None:
        self._compose("stop", "--timeout", "10", EXECUTOR.format(i), NODE.format(i))

    def follow_events(self, docker: list[str], project: str) -> None:
        """Count the ``oom`` events of the project's containers (`docker`: the docker CLI, its engine's env)."""
        self._events = subprocess.Popen(
            [*docker, "events", "--filter", "event=oom", "--filter", f"label=com.docker.compose.project={project}",
             "--format", '{{index .Actor.Attributes "com.docker.compose.service"}}'],
            env=self.env, stdout=subprocess.PIPE, text=True)

        def read() -> None:
            for line in self._events.stdout:
                self._ooms[line.strip()] += 1

        self._reader = threading.Thread(target=read, name="fleet-oom-events", daemon=True)
        self._reader.start()

    def halt(self) -> None:
        """Stop the schedule and the OOM events' watcher (also where the run failed: no `docker events` is left)."""
        super().halt()
        if self._events is not None:
            self._events.terminate()
            self._events.wait(10)
            self._reader.join(10)
            self._events = None

    def close(self, run_folder: Path | None, restarts: dict[str, int] | None = None) -> dict[str, Any]:
        """Stop following; write ``fleet.json`` into `run_folder` (None: not written) with `restarts`, Docker's
        restart count per service; return it."""
        self.halt()
        restarts = restarts or {}
        devices = []
        for i, device in enumerate(self.fleet.devices):
            self.counts[i]["oom-kills"] = self._ooms[EXECUTOR.format(i)] + self._ooms[NODE.format(i)]
            devices.append({"node": i, "profile": profile(device), **self.counts[i],
                            "docker-restarts": sum(restarts.get(s.format(i), 0) for s in (NODE, EXECUTOR))})
        return self.write({"fleet": self.fleet.name, "limits": "compose (mem_limit, cpus)", "devices": devices},
                          run_folder, (*COUNTS, "docker-restarts"))
