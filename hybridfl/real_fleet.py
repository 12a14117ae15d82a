"""A fleet's device profiles (common/fleet.py) applied to real SuperNodes on this machine.

``hybridfl run --mode deployment fleet=lognormal`` (or a fleet file) runs the local deployment of
hybridfl/deploy_local.py with every node made the device its profile draws:

* **its link**: the node reaches the SuperLink through its own route of a user-space shaper (hybridfl/shaper.py:
  this kernel has no ``sch_netem``) with the profile's latency, up and down rates and loss;
* **its compute**: the node's ClientApp replies no sooner than the profile's ``overhead-s`` + examples ×
  ``compute-s-per-example`` (node config, client_app/work.py), so a fleet of slow devices runs on one fast host
  as long as the host keeps up (its own work is what the pacing cannot hide);
* **its memory**: the node's processes (SuperNode, ClientApp executor and what they start) share a memory cgroup
  limited to ``memory-mb``; a device the kernel kills for it is counted (``oom-kills``) and started again, and the
  run goes on without its update;
* **its availability**: from the run's first round (the moment its ``metrics.jsonl`` appears: device time 0 in
  the simulation too) a scheduler stops each node when its online window ends (SIGTERM: the device's app is closed,
  its message in flight is lost, its SuperNode leaves the SuperLink) and starts it again when the next begins. Every
  node joins at the start: the server maps nodes to partitions then.

What the fleet did is written to ``<run>/fleet.json`` when the deployment stops: each device's profile, starts,
stops, crashes, refused joins (module constants), OOM kills, peak memory and the bytes its link carried.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.fleet import DeviceProfile, Fleet
from hybridfl.shaper import Link, Route, Shaper

CGROUP_ROOT = Path("/sys/fs/cgroup")
TICK_S = 0.2  # how often the scheduler looks at the clock and the devices' processes
# After a crash or an OOM kill the SuperLink holds the node's key online for two heartbeats (60 s in Flower 1.42)
# and refuses it meanwhile (the SuperNode exits 1 at once, as for any error): a start that ends within JOIN_S is
# counted as a refused join and tried again REJOIN_WAIT_S later
JOIN_S = 15.0
REJOIN_WAIT_S = 5.0
COUNTS = ("starts", "stops", "crashes", "refused-joins", "oom-kills")


class MemoryCgroup:
    """A device's memory cgroup (v2 where the unified hierarchy has the memory controller, else v1's); ``None`` from
    :meth:`make` when neither can be written here (the reason in :attr:`unavailable`)."""

    unavailable = ""

    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @classmethod
    def make(cls, name: str, limit_mb: int) -> MemoryCgroup | None:
        v2 = "memory" in _read(CGROUP_ROOT / "cgroup.controllers").split()
        parent = CGROUP_ROOT if v2 else CGROUP_ROOT / "memory"
        try:
            path = parent / "hybridfl" / name
            path.mkdir(parents=True, exist_ok=True)
            (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit_mb * 2**20))
            if not v2:  # no swap either, where the kernel accounts it: the limit is the device's memory
                with open(path / "memory.memsw.limit_in_bytes", "w") as f:
                    f.write(str(limit_mb * 2**20))
        except OSError as err:
            cls.unavailable = f"no writable memory cgroup here ({err.strerror}: {err.filename})"
            return None
        return cls(path, v2)

    def add(self, pid: int) -> None:
        """Put process `pid` in the cgroup (its children, started later, are born in it)."""
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError:  # it ended already
            pass

    def oom_kills(self) -> int:
        text = _read(self.path / ("memory.events" if self.v2 else "memory.oom_control"))
        return int(dict(line.split() for line in text.splitlines() if line.count(" ") == 1).get("oom_kill", 0))

    def peak_bytes(self) -> int:
        return int(_read(self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")) or 0)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class RealFleet:
    """`fleet` on the local deployment whose SuperLink listens on `superlink_port` (see the module docstring).

    The deployment asks it for each node's SuperLink address (:meth:`address`) and node config (:meth:`node_config`),
    tells it every process it starts for node i (:meth:`started`), and hands it the functions that start and stop
    node i (:meth:`follow`); :meth:`close` stops the scheduler and the shaper and writes ``fleet.json``.
    """

    def __init__(self, fleet: Fleet, superlink_port: int, ports: Callable[[], int], seed: int = 0) -> None:
        self.fleet = fleet
        routes = [Route(superlink_port, Link(latency_s=d.latency_s, up_bytes_per_s=d.up_bytes_per_s,
                                             down_bytes_per_s=d.down_bytes_per_s, drop=d.drop, seed=seed * 1000 + i),
                        listen_port=ports()) for i, d in enumerate(fleet.devices)]
        self.shaper = Shaper(routes)
        self.ports = self.shaper.start()
        self.cgroups: dict[int, MemoryCgroup | None] = {}
        self.counts = [dict.fromkeys(COUNTS, 0) for _ in fleet.devices]
        self._not_before: dict[int, float] = {}  # device time before which node i is not started again
        self._started_at: dict[int, float] = {}
        self._procs: dict[int, list[Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def address(self, i: int) -> str:
        """Where node i reaches the SuperLink: its shaped link."""
        return f"127.0.0.1:{self.ports[i]}"

    def node_config(self, i: int) -> str:
        """Node i's pacing (client_app/work.py)."""
        d = self.fleet.devices[i]
        return f"compute-s-per-example={d.compute_s_per_example!r} overhead-s={d.overhead_s!r}"

    def started(self, i: int, procs: list[Any]) -> None:
        """Node i's processes (``Popen``s) were started: count the start, put them in its memory cgroup."""
        device = self.fleet.devices[i]
        if device.memory_mb and i not in self.cgroups:
            self.cgroups[i] = MemoryCgroup.make(f"{os.getpid()}-node-{i}", device.memory_mb)
        for p in procs:
            if self.cgroups.get(i) is not None:
                self.cgroups[i].add(p.pid)
        self._procs[i] = procs
        self._started_at[i] = time.monotonic()
        self.counts[i]["starts"] += 1

    def follow(self, run_folder: Path, start: Callable[[int], None], stop: Callable[[int], None]) -> None:
        """Apply the availability windows from the run's first round on, in a thread: `stop(i)` when node i's
        window ends, `start(i)` when the next begins; a node whose process ended (a crash, an OOM kill) is
        started again while it is online."""
        def loop() -> None:
            metrics = run_folder / "metrics.jsonl"
            while not metrics.exists() and not self._stop.wait(TICK_S):
                pass
            t0 = time.monotonic()
            while not self._stop.wait(TICK_S):
                t = time.monotonic() - t0
                for i, device in enumerate(self.fleet.devices):
                    with self._lock:
                        self._tick(i, device, t, start, stop)

        self._thread = threading.Thread(target=loop, name="fleet-schedule", daemon=True)
        self._thread.start()

    def _tick(self, i: int, device: DeviceProfile, t: float, start: Callable[[int], None],
              stop: Callable[[int], None]) -> None:
        procs = self._procs.get(i)
        running = procs is not None
        if running and any(p.poll() is not None for p in procs):  # a process of the device ended by itself
            refused = time.monotonic() - self._started_at[i] < JOIN_S
            self.counts[i]["refused-joins" if refused else "crashes"] += 1
            stop(i)
            self._procs.pop(i)
            self._not_before[i] = t + (REJOIN_WAIT_S if refused else 0.0)
            running = False
        if running and not device.online(t):
            self.counts[i]["stops"] += 1
            stop(i)
            self._procs.pop(i)
        elif not running and device.online(t) and t >= self._not_before.get(i, 0.0):
            start(i)

    def halt(self) -> None:
        """Stop the schedule (before the deployment's processes are stopped: it would start them again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self, run_folder: Path | None) -> dict[str, Any]:
        """Once the deployment's processes are stopped: stop the schedule and the shaper, remove the cgroups, write
        ``fleet.json`` into `run_folder` (None: not written); return it."""
        self.halt()
        links = list(self.shaper.stats().values())
        self.shaper.stop()
        devices = []
        for i, device in enumerate(self.fleet.devices):
            cgroup = self.cgroups.get(i)
            if cgroup is not None:
                self.counts[i]["oom-kills"] = cgroup.oom_kills()
            devices.append({"node": i, "profile": {k: v for k, v in asdict(device).items() if k != "windows"},
                            "online-windows": len(device.windows), **self.counts[i],
                            "peak-memory-mb": round(cgroup.peak_bytes() / 2**20, 1) if cgroup else None,
                            "link": links[i]})
        report = {"fleet": self.fleet.name, "memory-limits": MemoryCgroup.unavailable or "applied",
                  "devices": devices,
                  "total": {k: sum(d[k] for d in devices) for k in COUNTS}}
        for cgroup in self.cgroups.values():
            if cgroup is not None:
                cgroup.remove()
        if run_folder is not None and run_folder.is_dir():
            (run_folder / "fleet.json").write_text(json.dumps(report, indent=2) + "\n")
        return report
