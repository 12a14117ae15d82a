"""A real fleet (hybridfl/launch/real_fleet.py): a fleet's profiles applied to real SuperNodes on loopback: shaped
links, paced work, memory limits, devices stopped and started by their windows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import rows

from common.fleet import DeviceProfile, Fleet
from hybridfl.launch import real_fleet
from hybridfl.launch.processes import free_port
from hybridfl.launch.real_fleet import DeviceCgroup, RealFleet
from tools.docs import bash_blocks

REPO = Path(__file__).resolve().parents[1]


def fleet(*devices: DeviceProfile) -> Fleet:
    return Fleet("test", devices)


class Sleeper:
    """Stands in for the deployment's start and stop of node i: a process that sleeps (or exits with `code`)."""

    def __init__(self, real: RealFleet, lives: dict[int, list[float]] | None = None) -> None:
        self.real, self.lives, self.procs, self.log = real, lives or {}, {}, []

    def start(self, i: int) -> None:
        life = self.lives.get(i, []).pop(0) if self.lives.get(i) else 60
        cmd = [sys.executable, "-c", f"import time; time.sleep({life}); raise SystemExit(1)"]
        self.procs[i] = subprocess.Popen(cmd)
        self.log.append(("start", i))
        self.real.started(i, [self.procs[i]])

    def stop(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()
        self.log.append(("stop", i))


def test_the_schedule_stops_and_starts_devices_by_their_windows_and_restarts_what_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(real_fleet, "REJOIN_WAIT_S", 0.5)
    monkeypatch.setattr(real_fleet, "JOIN_S", 1.5)  # a start of Python under load: well within
    devices = fleet(DeviceProfile(windows=((0.0, 0.8), (1.6, 1e9))),  # off from 0.8 s to 1.6 s
                    DeviceProfile(),  # its first process crashes after 2.5 s, its second is refused at once
                    DeviceProfile(windows=((9.0, 1e9),)))  # offline until 9 s
    real = RealFleet(devices, free_port(), free_port)
    node = Sleeper(real, {1: [2.5, 0.0]})
    try:
        for i in range(3):
            node.start(i)  # every node joins at the start
        (tmp_path / "metrics.jsonl").write_text("")  # the run's first round: device time 0
        real.follow(tmp_path, node.start, node.stop)
        time.sleep(6.0)
    finally:
        real.halt()
        for p in node.procs.values():
            p.kill()
            p.wait()
    report = real.close(tmp_path)
    assert [(d["starts"], d["stops"], d["crashes"], d["refused-joins"]) for d in report["devices"]] == [
        (2, 1, 0, 0), (3, 0, 1, 1), (1, 1, 0, 0)]
    # node 1 came back at once after its crash, then waited REJOIN_WAIT_S after its refused join
    assert node.log.count(("start", 1)) == 3 and node.log[-1] != ("start", 2)
    assert json.loads((tmp_path / "fleet.json").read_text())["total"]["stops"] == 2
    assert {d["link"]["connections"] for d in report["devices"]} == {0}


def test_each_node_reaches_the_superlink_through_its_own_shaped_link():
    devices = fleet(DeviceProfile(latency_s=0.2, down_bytes_per_s=1e4), DeviceProfile(compute_s_per_example=0.5,
                                                                                       overhead_s=2.0))
    target = free_port()
    real = RealFleet(devices, target, free_port)
    try:
        routes = real.shaper.routes
        assert [r.target_port for r in routes] == [target, target]
        assert (routes[0].link.latency_s, routes[0].link.down_bytes_per_s) == (0.2, 1e4)
        assert len({real.address(0), real.address(1)}) == 2 and real.address(0).startswith("127.0.0.1:")
        assert real.node_config(1) == "compute-s-per-example=0.5 overhead-s=2.0"
    finally:
        real.close(None)


def test_a_device_over_its_memory_is_killed_and_counted():
    cgroup = DeviceCgroup.make(f"test-{os.getpid()}", memory_mb=64)
    if cgroup is None:
        pytest.skip(DeviceCgroup.unavailable)
    try:
        hog = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); b = bytearray(300 * 2**20); "
                                                      "b[::4096] = b'x' * len(b[::4096])"])
        cgroup.add(hog.pid)
        assert hog.wait(timeout=60) == -9  # SIGKILL, by the kernel's OOM killer
        assert cgroup.oom_kills() == 1
        assert 50 * 2**20 < cgroup.peak_bytes() <= 64 * 2**20
    finally:
        cgroup.remove()


def test_a_devices_cpu_quota_holds_its_processes_to_its_cores():
    """A busy loop in a cgroup with a quota of a quarter core gets at most a quarter of the wall clock's CPU time
    (the kernel's CFS accounting: a period's overrun is repaid in the next, so at most one period over)."""
    cgroup = DeviceCgroup.make(f"test-cpu-{os.getpid()}", cpus=0.25)
    if cgroup is None:
        pytest.skip(DeviceCgroup.unavailable)
    try:
        assert cgroup.cpu_quota() == 0.25
        spin = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nsys.stdin.readline()\n"
                                 "t = time.monotonic()\nwhile time.monotonic() - t < 2.0: pass\nu = os.times()\n"
                                 "print(u.user + u.system, time.monotonic() - t)"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        cgroup.add(spin.pid)
        cpu_s, wall_s = map(float, spin.communicate("go\n", timeout=60)[0].split())
        assert cpu_s <= 0.25 * wall_s + 2 * DeviceCgroup.PERIOD_US / 1e6, (cpu_s, wall_s)
    finally:
        cgroup.remove()


TUTORIAL = REPO / "docs" / "tutorials" / "fleet.md"


def tutorial_commands(section: str) -> list[str]:
    return bash_blocks(TUTORIAL, section)


def run_as_user(commands: list[str], cwd: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    for command in commands:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, command + "\n" + done.stdout[-3000:] + done.stderr[-3000:]


def test_the_tutorials_simulation_with_device_time_runs_as_written(tmp_path):
    run_as_user(tutorial_commands("2."), tmp_path)
    runs = sorted((tmp_path / "outputs").iterdir())
    assert len(runs) == 2
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["device-time-s"] > 0 and (run / "accuracy-device-time.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.e2e
def test_the_tutorials_real_fleet_with_shaped_links_and_a_device_restarted_by_its_schedule_completes(tmp_path):
    """The tutorial's commands as a user runs them, from a folder of their own: three SuperNodes behind shaped links,
    node 2 switched off 8 s into the run and on again at 20 s."""
    run_as_user(tutorial_commands("3."), tmp_path)
    run = next((tmp_path / "outputs").iterdir())
    report = json.loads((run / "fleet.json").read_text())
    node = report["devices"]
    assert (node[2]["stops"], node[2]["starts"]) == (1, 2) and report["total"]["crashes"] == 0
    assert all(d["link"]["bytes_down"] > 10**6 and d["link"]["bytes_up"] > 10**5 for d in node)  # every link used
    if report["limits"] == "applied":
        assert all(0 < d["peak-memory-mb"] <= 1500 for d in node)
    events = rows(run, "events.jsonl")
    lost = [e for e in events if e["outcome"] != "accepted"]
    assert len(events) == 6 * 2 and len(lost) <= 2  # a message node 2 held when it was switched off is lost
    # paced: no update came back sooner than its device's overhead and the link's latency both ways
    assert all(e["device-t"] - e["device-start"] >= 1.0 + 0.1 for e in events if e["outcome"] == "accepted")
    assert rows(run)[-1]["device-t"] > 20  # the wall clock's device time is the host's
