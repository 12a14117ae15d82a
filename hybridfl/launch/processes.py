"""Starting and stopping Flower processes safely: an isolated FLWR_HOME, free loopback ports, environment for
offline machines, process groups stopped by PID, waits for a process to be ready (the ``flwr`` command itself:
hybridfl/launch/flwr_cli.py)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import psutil

from common.user_code import USER_DIR

_HANDED_OUT: set[int] = set()


def _ephemeral_ports() -> range:
    """The kernel's range for the source ports of outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


# Device i's link shaper in the compose fleet listens on the host's port SHAPER_PORT + i
# (hybridfl/launch/compose_fleet.py); the other ports the compose files publish on the host are below 10000, where
# free_port never picks
SHAPER_PORT = 18000
SHAPER_PORTS = range(SHAPER_PORT, SHAPER_PORT + 1000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, chosen at random outside the kernel's ephemeral range (where
    the port 0 trick picks, and where any outgoing connection may take it before the server that was meant to),
    outside the ports a compose fleet's shapers take on the host (one started later on this host finds them free),
    and never the same twice in this process."""
    ephemeral, rng = _ephemeral_ports(), random.SystemRandom()  # not the run's seed: two launchers must differ
    for _ in range(1000):
        port = rng.randrange(10000, 65536)
        if port in ephemeral or port in _HANDED_OUT or port in SHAPER_PORTS:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free TCP port on 127.0.0.1 outside the ephemeral range after 1000 tries")


# Flower's one knob on a message's way to a ClientApp process: how often a SuperExec looks for new tasks (Flower's
# default 1 s; BENCHMARKS "Seconds per update in deployment"). docker/compose.yml sets the same value.
SUPEREXEC_POLL = ("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: private FLWR_HOME, no telemetry, no runtime installs, the SuperExec's
    task poll interval (unless the environment sets it), this interpreter's bin/ first on PATH
    (SuperLink/SuperNode start flower-superexec by name, and the flwr CLI is found there the same way), and the
    current folder as the user's (``HYBRIDFL_USER_DIR``: their own code is found there last, never in front of an
    installed package or the run's app; common/user_code.py)."""
    env = dict(os.environ)
    env.setdefault(*SUPEREXEC_POLL)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        USER_DIR: os.getcwd(),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def process_home(flwr_home: Path, name: str) -> Path:
    """The FLWR_HOME of process `name` under the operator's `flwr_home` (which holds the CLI's connections and the
    PKI): Flower installs a run's app into the FLWR_HOME of each process that runs it and skips the install when
    the app's folder exists, so two processes sharing one could import an app the other is still unpacking."""
    return flwr_home / "processes" / name


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGTERM and SIGINT that arrive inside the block act when it ends. An interrupt raised inside
    ``subprocess.Popen`` after its fork leaves the child running with no Popen to stop it: a process is started and
    recorded within this block. (Python runs signal handlers in the main thread only; elsewhere nothing is held.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if held:
            signal.raise_signal(held[0])


class ProcessGroup:
    """Processes this script started, each in its own session, stopped together (and only them).

    Stopping also reaches their descendants that left the process group: flower-superlink starts
    its flower-superexec (parent of flwr-serverapp) in a new session, out of reach of ``killpg``.
    ``pids`` holds every process started here, descendants included, once stopped.
    """

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir, self.env = log_dir, env
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.kept: list[Kept] = []
        self.pids: set[int] = set()
        self.homes: set[Path] = set()
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start `cmd` as `name` (log: <log_dir>/<name>.log) in `cwd` with `env`, or else the group's environment
        with a FLWR_HOME of its own (:func:`process_home`), run in it: Flower's processes do not share one."""
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        if env is None and "FLWR_HOME" in self.env:
            home = process_home(Path(self.env["FLWR_HOME"]), name)
            home.mkdir(parents=True, exist_ok=True)
            # ... which is also the folder it runs in: never the user's, which Ray puts first on its workers' path
            env, cwd = {**self.env, "FLWR_HOME": str(home)}, cwd or home
            self.homes.add(home)
        with interrupts_held():
            proc = subprocess.Popen(list(cmd), env=self.env if env is None else env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
            self.procs.append((name, proc))
        return proc

    def keep(self, name: str, cmd: Sequence[str]) -> Kept:
        """Start `cmd` as `name`, and again (as ``name-1``, ``name-2``, ...) within a second whenever it exits (later,
        doubling up to 30 s, while it keeps dying within 10 s), until the group stops: a restart policy, as
        docker/compose.yml's ``restart: unless-stopped``. For the ServerApp's SuperExec: Flower 1.42's
        ``flower-superexec`` exits on one 500 from the SuperLink's task poll (seen at 1000 devices on SQLite), and the
        next run on that SuperLink (a resume) would find none."""
        kept = Kept(self, name, cmd)
        self.kept.append(kept)
        kept.start()
        return kept

    def kill(self, name: str) -> None:
        """SIGKILL process `name` and its process group at once (a device that vanishes)."""
        for n, p in self.procs:
            if n == name:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait()

    def terminate(self, name: str, grace: float = 10.0) -> None:
        """SIGTERM process `name`'s group, SIGKILL it after `grace` s (a device switched off: its SuperNode leaves
        the SuperLink, which lets it join again at once; a killed one is held online for two heartbeats)."""
        for n, p in self.procs:
            if n == name and p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    _signal_group(p.pid, signal.SIGKILL)
                    p.wait()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every group, SIGKILL what is left after `grace` s, descendants included."""
        for kept in self.kept:  # nothing is started again from now on
            kept.stop.set()
            kept.join()
        tree = process_tree([p.pid for _, p in self.procs])  # while children are still linked to parents
        self.pids |= {p.pid for _, p in self.procs} | {p.pid for p in tree}  # those that ended already too
        for _, p in self.procs:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
        _, left = psutil.wait_procs(tree, timeout=grace)
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()  # only the very process seen above: psutil checks that its PID was not reused
        # a descendant started after the snapshot whose parent died (a raylet's agents, spawned while it was being
        # stopped) is nobody's child any more: found by the folder it runs in, the home of the process it came from
        for _ in range(3):
            stray = in_folders(self.homes)
            if not stray:
                break
            self.pids |= {p.pid for p in stray}
            for proc in stray:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            psutil.wait_procs(stray, timeout=grace)
        for name, p in self.procs:
            _signal_group(p.pid, signal.SIGKILL)  # anything still in a group
            try:
                p.wait(grace)  # a clean clone's CI saw a launcher wait here for good (cause unknown): bounded
            except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep): said, not waited for forever
                print(f"{name} (pid {p.pid}) did not end {grace:.0f} s after SIGKILL", file=sys.stderr, flush=True)

    def __enter__(self) -> ProcessGroup:
        # SIGTERM (a `kill`, a service manager, CI's timeout) unwinds like Ctrl-C, so that this group is stopped
        # too rather than left running with nobody to stop it
        self._on_term = (signal.signal(signal.SIGTERM, terminated)
                         if threading.current_thread() is threading.main_thread() else None)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._on_term is not None:
                signal.signal(signal.SIGTERM, self._on_term)


QUICK_EXIT_S, MAX_RESTART_WAIT_S = 10.0, 30.0  # a kept process's crash loop: how short a life, how long a wait


class Kept(threading.Thread):
    """A process of a :class:`ProcessGroup` started again whenever it exits (:meth:`ProcessGroup.keep`):
    :attr:`proc` is its latest incarnation, :attr:`restarts` when each restart came (seconds since the first start)
    and the exit code it followed."""

    def __init__(self, procs: ProcessGroup, name: str, cmd: Sequence[str]) -> None:
        super().__init__(daemon=True, name=f"keep-{name}")
        self.procs, self.process_name, self.cmd = procs, name, list(cmd)
        self.proc = procs.start(name, self.cmd)
        self.restarts: list[dict[str, float | int]] = []
        self.stop, self._t0 = threading.Event(), time.monotonic()

    def run(self) -> None:
        wait, started = 1.0, time.monotonic()
        while not self.stop.wait(wait):
            code = self.proc.poll()
            if code is None:
                continue
            # one that dies at once (a wrong flag, a SuperLink not there) is not started every second for a whole
            # run: the wait doubles, up to MAX_RESTART_WAIT_S, while incarnations live under QUICK_EXIT_S
            wait = min(2 * wait, MAX_RESTART_WAIT_S) if time.monotonic() - started < QUICK_EXIT_S else 1.0
            self.restarts.append({"at-s": round(time.monotonic() - self._t0, 1), "exit-code": code})
            if not self.stop.is_set():  # stop() joins this thread before it stops the group's processes
                print(f"{self.process_name} exited ({code}): started again", file=sys.stderr, flush=True)
                self.proc = self.procs.start(f"{self.process_name}-{len(self.restarts)}", self.cmd)
                started = time.monotonic()


def terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: unwind as an exception does (``finally`` blocks and context managers run), exit 143."""
    raise SystemExit(128 + signum)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def children(parents: set[int]) -> set[int]:
    """The processes whose parent is in `parents` (one level: a warm executor's fork server, or its forks)."""
    found = set()
    for pid in parents:
        with contextlib.suppress(psutil.NoSuchProcess):
            found |= {child.pid for child in psutil.Process(pid).children()}
    return found


def process_tree(roots: list[int]) -> list[psutil.Process]:
    """`roots` and all their live descendants, as processes that a signal reaches only while they are the same
    process (psutil checks the start time: a PID reused since is left alone)."""
    tree: dict[int, psutil.Process] = {}
    for pid in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            tree |= {p.pid: p for p in [root, *root.children(recursive=True)]}
    return list(tree.values())


def in_folders(folders: set[Path]) -> list[psutil.Process]:
    """The live processes (not zombies) whose working directory is in one of `folders`."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            if proc.status() != psutil.STATUS_ZOMBIE and any(Path(proc.cwd()).is_relative_to(f) for f in folders):
                found.append(proc)
    return found


def wait_until(what: str, check: Callable[[], bool], proc: subprocess.Popen, timeout: float = 60.0,
               every: float = 0.25) -> None:
    """Poll `check()` until it is true; raise if `proc` (the process behind `what`) exits first or `timeout`
    passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was healthy")
        if check():
            return
        time.sleep(every)
    raise RuntimeError(f"{what} not healthy after {timeout:.0f}s")


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0, ca: Path | None = None) -> None:
    """Wait for a SuperLink's /health on 127.0.0.1:`port` (HTTPS verified against `ca` when given)."""
    url = f"{'https' if ca else 'http'}://127.0.0.1:{port}/health"

    def healthy() -> bool:
        try:
            return httpx.get(url, timeout=1.0, verify=str(ca) if ca else True).is_success
        except httpx.HTTPError:
            return False

    wait_until(f"flower-superlink on port {port}", healthy, proc, timeout)
