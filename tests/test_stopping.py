"""Stopping a launcher as a user or an operator does: Ctrl-C (SIGINT) or SIGTERM at any phase of `hybridfl run` ends
it within seconds, with exit code 130 or 143, and nothing it started is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hybridfl.launch import processes
from hybridfl.launch.simulate import local_cpus
from tools import probes

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
# (mode and flags, the output line that marks the phase, the signal): every launcher that starts Flower's processes
# at the phases that were seen to hang or leak (SuperNodes being registered, `flwr run --stream` streaming), and the
# in-process engine mid-run
CASES = {
    "deployment-registering": (["--mode", "deployment"], None, signal.SIGTERM),  # TLS and node auth: the default
    "deployment-streaming": (["--mode", "deployment"], "Successfully started run", signal.SIGTERM),
    "simulation-streaming": (["--mode", "simulation", "--client-num-cpus", str(local_cpus())],  # one Ray actor
                             "Starting Flower Simulation", signal.SIGINT),
    "in-process-running": ([], "round 2/", signal.SIGINT),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES)
def test_a_launcher_interrupted_at_any_phase_ends_at_once_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    flags, marker, sig = CASES[case]
    hybridfl = str(Path(sys.executable).parent / "hybridfl")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONFAULTHANDLER": "1"}
    launcher = subprocess.Popen([hybridfl, "run", "fedavg-digits", "num-clients=1", "clients-per-round=1",
                                 "num-rounds=200", *flags], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=_as_from_a_terminal, env=env)
    reached = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in launcher.stdout:
            lines.append(line)
            if marker is not None and marker in line:
                reached.set()

    threading.Thread(target=read, daemon=True).start()
    # no marker: the launcher is stopped once its SuperLink started, while it registers keys and starts SuperNodes
    started = tmp_path / ".flwr" / "processes" / "superlink"
    deadline = time.monotonic() + 300
    while marker is None and not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reached.wait(300) if marker else started.exists(), "".join(lines[-40:])
    with_children = psutil.Process(launcher.pid)
    seen = {p.pid for p in [with_children, *with_children.children(recursive=True)]}
    launcher.send_signal(sig)
    start = time.monotonic()
    try:
        code = launcher.wait(timeout=60)
    except subprocess.TimeoutExpired:  # hung: its threads' stacks (faulthandler, on SIGABRT) say where
        launcher.send_signal(signal.SIGABRT)
        launcher.wait(timeout=30)
        time.sleep(1)
        raise AssertionError("the launcher did not end within 60 s:\n" + "".join(lines[-150:])) from None
    assert code == EXIT[sig], "".join(lines[-40:])  # 143 as a shell reports it: an exit, not a kill
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 15
    while (left := _left(seen, tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], [(pid, _cmdline(pid)) for pid in left]


def _left(seen: set[int], folder: Path) -> list[int]:
    """What still runs of the processes seen, or of any running in `folder` (each Flower process runs in its own
    FLWR_HOME there, also one started after the snapshot)."""
    return sorted(probes.alive(seen) | {p.pid for p in processes.in_folders({folder})})


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _as_from_a_terminal() -> None:
    """Ctrl-C's default action, as in a user's terminal: a process started in the background of a script (a CI
    runner's, this suite's under `.ci/run`) inherits SIGINT ignored, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupt_while_a_process_starts_acts_once_it_is_recorded(tmp_path: Path) -> None:
    """A SIGTERM that lands inside ProcessGroup.start (between its fork and its record: the registering case above,
    seen leaving a SuperLink running) unwinds only after the process is in the group, which then stops it."""
    script = """
import os, signal, subprocess, sys
from pathlib import Path
from hybridfl.launch import processes
from hybridfl.launch.simulate import local_cpus
signal.signal(signal.SIGTERM, processes.terminated)
real_popen = subprocess.Popen
def popen_then_terminated(*args, **kwargs):
    proc = real_popen(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # as if it arrived before Popen returned
    for _ in range(1000):
        pass  # bytecodes run: a handler that raised would raise here
    return proc
subprocess.Popen = popen_then_terminated
group = processes.ProcessGroup(Path(sys.argv[1]), dict(os.environ))
try:
    with group:
        group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        print("not reached", flush=True)
finally:
    print("recorded", [name for name, _ in group.procs], "pids", sorted(group.pids), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 143, out.stderr
    assert "not reached" not in out.stdout
    assert "recorded ['sleeper']" in out.stdout, out.stdout + out.stderr
    pids = {int(p) for p in out.stdout.split("pids [")[1].split("]")[0].split(",")}
    assert pids and not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                            for p in pids)


def test_a_descendant_orphaned_before_the_stop_is_stopped_by_the_folder_it_runs_in(tmp_path: Path) -> None:
    """A process that a group's process started and left (its parent gone, in a session of its own: out of the tree
    and of every group signal, as a raylet's agents spawned while it was being stopped) still runs in the home of
    the process it came from: stop() ends it too. A process elsewhere is left alone."""
    orphan = tmp_path / "orphan.pid"
    spawn = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open({str(orphan)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
time.sleep(600)
"""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], cwd=tmp_path)
    try:
        group = processes.ProcessGroup(tmp_path / "logs", {**os.environ, "FLWR_HOME": str(tmp_path / "home")})
        with group:
            group.start("parent", [sys.executable, "-c", spawn])
            deadline = time.monotonic() + 60
            while not (orphan.exists() and orphan.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            pid = int(orphan.read_text())
            assert psutil.Process(pid).ppid() != group.procs[0][1].pid  # not the parent's child: out of its tree
        assert pid in group.pids and not probes.alive({pid})
        assert bystander.poll() is None  # in the folder above the homes: not the group's
    finally:
        bystander.kill()
        bystander.wait()


def test_a_kept_process_is_started_again_each_time_it_exits_and_not_once_the_group_stops(tmp_path: Path) -> None:
    """ProcessGroup.keep, the restart policy of the ServerApp's SuperExec (Flower 1.42's exits on one 500 from its
    task poll): a process that exits is started again under a log of its own, each restart recorded with the exit
    code it followed, and one that keeps dying at once is started again later each time (waits of 1, 2, 4 s: a lower
    bound, which a slow machine only lengthens); a running one is left alone; once the group stops, nothing is
    started again and nothing is left running."""
    marks = tmp_path / "starts"
    exits = [sys.executable, "-c", f"open({str(marks)!r}, 'a').write('x'); raise SystemExit(3)"]
    with processes.ProcessGroup(tmp_path / "logs", {}) as procs:
        kept = procs.keep("superexec-serverapp", exits)
        running = procs.keep("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        first = running.proc.pid
        deadline = time.monotonic() + 30
        while len(kept.restarts) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [r["exit-code"] for r in kept.restarts[:2]] == [3, 3]
        assert kept.restarts[2]["at-s"] - kept.restarts[1]["at-s"] >= 3.5  # every second, it would be ~1 (2 if slow)
        assert (tmp_path / "logs" / "superexec-serverapp-2.log").exists()
        assert running.restarts == [] and running.proc.pid == first
    assert not kept.is_alive() and not running.is_alive()
    starts = [n for n, _ in procs.procs if n.startswith("superexec")]
    assert len(starts) == len(kept.restarts) + 1 and len(marks.read_text()) >= 3
    time.sleep(1.5)  # a keeper still watching would have started another by now
    assert len(procs.procs) == len(starts) + 1
    assert not [p for p in procs.pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
