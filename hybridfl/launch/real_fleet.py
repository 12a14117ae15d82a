"""A fleet's device profiles (common/fleet.py) applied to real SuperNodes on this machine.

``hybridfl run --mode deployment fleet=lognormal`` (or a fleet file) runs the local deployment of
hybridfl/launch/deploy_local.py with every node made the device its profile draws:

* **its link**: the node reaches the SuperLink through its own route of a user-space shaper (hybridfl/launch/shaper.py:
  this kernel has no ``sch_netem``) with the profile's latency, up and down rates and loss;
* **its compute**: the node's ClientApp replies no sooner than the profile's ``overhead-s`` + examples ×
  ``compute-s-per-example`` (node config, client_app/work.py), so a fleet of slow devices runs on one fast host
  as long as the host keeps up (its own work is what the pacing cannot hide);
* **its memory and cores**: the node's processes (SuperNode, ClientApp executor and what they start) share a memory
  cgroup limited to ``memory-mb`` and a CPU cgroup with a quota of ``cpus`` cores; a device the kernel kills for
  its memory is counted (``oom-kills``) and started again, and the run goes on without its update;
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
from hybridfl.launch.shaper import Link, Route, Shaper

CGROUP_ROOT = Path("/sys/fs/cgroup")
TICK_S = 0.2  # how often the scheduler looks at the clock and the devices' processes
# After a crash or an OOM kill the SuperLink holds the node's key online for two heartbeats (60 s in Flower 1.42)
# and refuses it meanwhile (the SuperNode exits 1 at once, as for any error): a start that ends within JOIN_S is
# counted as a refused join and tried again REJOIN_WAIT_S later
JOIN_S = 15.0
REJOIN_WAIT_S = 5.0
COUNTS = ("starts", "stops", "crashes", "refused-joins", "oom-kills")


class DeviceCgroup:
    """A device's cgroups: memory limited to ``memory-mb`` and CPU time to ``cpus`` cores (a CFS quota per 100 ms
    period), in the unified hierarchy (v2) where it has the controller, else in v1's own hierarchy for it; ``None``
    from :meth:`make` when they cannot be written here (the reason in :attr:`unavailable`)."""

    unavailable = ""
    PERIOD_US = 100_000  # the kernel's default CFS period

    def __init__(self, memory: Path | None, cpu: Path | None, v2: bool) -> None:
        self.memory, self.cpu, self.v2 = memory, cpu, v2

    @classmethod
    def make(cls, name: str, memory_mb: int = 0, cpus: float = 0.0) -> DeviceCgroup | None:
        controllers = _read(CGROUP_ROOT / "cgroup.controllers").split()
        v2 = {"memory", "cpu"} <= set(controllers)
        memory = cpu = None
        try:
            if memory_mb:
                memory = cls._mkdir(CGROUP_ROOT if v2 else CGROUP_ROOT / "memory", name)
                limit = str(memory_mb * 2**20)
                (memory / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(limit)
                if not v2:  # no swap either, where the kernel accounts it: the limit is the device's memory
                    with open(memory / "memory.memsw.limit_in_bytes", "w") as f:
                        f.write(limit)
            if cpus:
                cpu = cls._mkdir(CGROUP_ROOT if v2 else CGROUP_ROOT / "cpu", name)
                quota = str(max(1000, round(cpus * cls.PERIOD_US)))
                if v2:
                    (cpu / "cpu.max").write_text(f"{quota} {cls.PERIOD_US}")
                else:
                    (cpu / "cpu.cfs_period_us").write_text(str(cls.PERIOD_US))
                    (cpu / "cpu.cfs_quota_us").write_text(quota)
        except OSError as err:
            cls.unavailable = f"no writable cgroup here ({err.strerror}: {err.filename})"
            cls(memory, cpu, v2).remove()
            return None
        return cls(memory, cpu, v2)

    @staticmethod
    def _mkdir(parent: Path, name: str) -> Path:
        path = parent / "hybridfl" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add(self, pid: int) -> None:
        """Put process `pid` in the cgroups (its children, started later, are born in them)."""
        for path in {self.memory, self.cpu} - {None}:
            try:
                (path / "cgroup.procs").write_text(str(pid))
            except OSError:  # it ended already
                pass

    def oom_kills(self) -> int:
        if self.memory is None:
            return 0
        text = _read(self.memory / ("memory.events" if self.v2 else "memory.oom_control"))
        return int(dict(line.split() for line in text.splitlines() if line.count(" ") == 1).get("oom_kill", 0))

    def peak_bytes(self) -> int:
        if self.memory is None:
            return 0
        return int(_read(self.memory / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")) or 0)

    def cpu_quota(self) -> float:
        """The cores the quota allows, as the kernel holds it (0: none)."""
        if self.cpu is None:
            return 0.0
        if self.v2:
            quota, period = _read(self.cpu / "cpu.max").split()
        else:
            quota, period = _read(self.cpu / "cpu.cfs_quota_us"), _read(self.cpu / "cpu.cfs_period_us")
        return 0.0 if quota.strip() in ("max", "-1") else int(quota) / int(period)

    def remove(self) -> None:
        for path in {self.memory, self.cpu} - {None}:
            try:
                path.rmdir()
            except OSError:
                pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def pacing(device: DeviceProfile) -> str:
    """A device's pacing as its SuperNode's node config (client_app/work.py)."""
    return f"compute-s-per-example={device.compute_s_per_example!r} overhead-s={device.overhead_s!r}"


def link_seed(fleet: Fleet, i: int) -> int:
    """Device i's link's loss draws' seed (hybridfl/launch/shaper.py), from the run's."""
    return fleet.seed * 1000 + i


def profile(device: DeviceProfile) -> dict[str, Any]:
    """A device's profile as ``fleet.json`` reports it (its windows counted, not listed)."""
    return {**{k: v for k, v in asdict(device).items() if k != "windows"}, "online-windows": len(device.windows)}


class Schedule:
    """A fleet's availability windows applied to real devices, from the run's first round on (device time 0 in the
    simulation too): ``stop(i)`` when device i's window ends, ``start(i)`` when its next begins. Where the devices'
    supervisor is this process (:meth:`ended`), a device whose processes ended by themselves (a crash, an OOM kill)
    is started again while it is online; one that ends within :data:`JOIN_S` of its start was refused by the
    SuperLink, and waits :data:`REJOIN_WAIT_S`. ``counts[i]`` says what happened to device i."""

    def __init__(self, fleet: Fleet, start: Callable[[int], None] | None = None,
                 stop: Callable[[int], None] | None = None) -> None:
        self.fleet, self.start, self.stop = fleet, start, stop
        self.counts = [dict.fromkeys(COUNTS, 0) for _ in fleet.devices]
        self._not_before: dict[int, float] = {}  # device time before which device i is not started again
        self._started_at: dict[int, float] = {}
        self._running: set[int] = set()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def started(self, i: int) -> None:
        """Device i was started (by the deployment, or by :meth:`start`): count it."""
        self._running.add(i)
        self._started_at[i] = time.monotonic()
        self.counts[i]["starts"] += 1

    def ended(self, i: int) -> bool:
        """Whether device i's processes ended by themselves; False where another supervisor restarts them."""
        return False

    def follow(self, begun: Callable[[], bool]) -> None:
        """Apply the windows in a thread, from the moment `begun()` (polled) is first true."""
        def loop() -> None:
            while not begun() and not self._halt.wait(TICK_S):
                pass
            t0 = time.monotonic()
            while not self._halt.wait(TICK_S):
                for i, device in enumerate(self.fleet.devices):
                    with self._lock:
                        self._tick(i, device, time.monotonic() - t0)

        self._thread = threading.Thread(target=loop, name="fleet-schedule", daemon=True)
        self._thread.start()

    def _tick(self, i: int, device: DeviceProfile, t: float) -> None:
        running = i in self._running
        if running and self.ended(i):
            refused = time.monotonic() - self._started_at[i] < JOIN_S
            self.counts[i]["refused-joins" if refused else "crashes"] += 1
            self._stopped(i)
            self._not_before[i] = t + (REJOIN_WAIT_S if refused else 0.0)
            running = False
        if running and not device.online(t):
            self.counts[i]["stops"] += 1
            self._stopped(i)
        elif not running and device.online(t) and t >= self._not_before.get(i, 0.0):
            self.start(i)  # which reports it: started(i)

    def _stopped(self, i: int) -> None:
        self.stop(i)
        self._running.discard(i)

    def write(self, report: dict[str, Any], run_folder: Path | None, counted: tuple[str, ...] = COUNTS
              ) -> dict[str, Any]:
        """`report` with the totals of its devices' `counted` keys, written to `run_folder`'s ``fleet.json`` (None:
        not written)."""
        report["total"] = {k: sum(d[k] for d in report["devices"]) for k in counted}
        if run_folder is not None and run_folder.is_dir():
            (run_folder / "fleet.json").write_text(json.dumps(report, indent=2) + "\n")
        return report

    def halt(self) -> None:
        """Stop the schedule (before the deployment's processes are stopped: it would start them again)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class RealFleet(Schedule):
    """`fleet` on the local deployment whose SuperLink listens on `superlink_port` (see the module docstring).

    The deployment asks it for each node's SuperLink address (:meth:`address`) and node config (:meth:`node_config`),
    tells it every process it starts for node i (:meth:`started`), and hands it the functions that start and stop
    node i (:meth:`follow`); :meth:`close` stops the scheduler and the shaper and writes ``fleet.json``.
    """

    def __init__(self, fleet: Fleet, superlink_port: int, ports: Callable[[], int]) -> None:
        super().__init__(fleet)
        routes = [Route(superlink_port, Link(latency_s=d.latency_s, up_bytes_per_s=d.up_bytes_per_s,
                                             down_bytes_per_s=d.down_bytes_per_s, drop=d.drop,
                                             seed=link_seed(fleet, i)),
                        listen_port=ports()) for i, d in enumerate(fleet.devices)]
        self.shaper = Shaper(routes)
        self.ports = self.shaper.start()
        self.cgroups: dict[int, DeviceCgroup | None] = {}
        self._procs: dict[int, list[Any]] = {}

    def address(self, i: int) -> str:
        """Where node i reaches the SuperLink: its shaped link."""
        return f"127.0.0.1:{self.ports[i]}"

    def node_config(self, i: int) -> str:
        """Node i's pacing (client_app/work.py)."""
        return pacing(self.fleet.devices[i])

    def started(self, i: int, procs: list[Any] | None = None) -> None:
        """Node i's processes (``Popen``s) were started: count the start, put them in its cgroups."""
        device = self.fleet.devices[i]
        if (device.memory_mb or device.cpus) and i not in self.cgroups:
            self.cgroups[i] = DeviceCgroup.make(f"{os.getpid()}-node-{i}", device.memory_mb, device.cpus)
        for p in procs or []:
            if self.cgroups.get(i) is not None:
                self.cgroups[i].add(p.pid)
        self._procs[i] = procs or []
        super().started(i)

    def ended(self, i: int) -> bool:
        return any(p.poll() is not None for p in self._procs.get(i, []))

    def follow(self, run_folder: Path, start: Callable[[int], None],  # type: ignore[override]
               stop: Callable[[int], None]) -> None:
        """Apply the availability windows from the run's first round on (its ``metrics.jsonl`` appears), in a
        thread, starting and stopping node i with `start(i)` and `stop(i)`."""
        self.start, self.stop = start, stop
        metrics = run_folder / "metrics.jsonl"
        super().follow(metrics.exists)

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
            devices.append({"node": i, "profile": profile(device), **self.counts[i],
                            "peak-memory-mb": round(cgroup.peak_bytes() / 2**20, 1) if cgroup else None,
                            "cpu-quota": cgroup.cpu_quota() if cgroup else None,
                            "link": links[i]})
        for cgroup in self.cgroups.values():
            if cgroup is not None:
                cgroup.remove()
        return self.write({"fleet": self.fleet.name, "limits": DeviceCgroup.unavailable or "applied",
                           "devices": devices}, run_folder)
