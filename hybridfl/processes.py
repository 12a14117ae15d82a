"""Starting and stopping Flower processes safely: an isolated FLWR_HOME, free loopback ports,
environment for offline machines, process groups stopped by PID, and a run's real final status
(``flwr run`` exits 0 even when the run failed)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
import tomli_w

from common.config import ConfigError
from common.user_code import USER_DIR
from hybridfl.bundle import app_config, flower_app, toml_value

_HANDED_OUT: set[int] = set()


def _ephemeral_ports() -> range:
    """The kernel's range for the source ports of outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


# Device i's link shaper in the compose fleet listens on the host's port SHAPER_PORT + i (hybridfl/compose_fleet.py);
# the other ports the compose files publish on the host are below 10000, where free_port never picks
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


def run_config_arg(overrides: Mapping[str, Any], app_dir: Path | None = None) -> str:
    """`overrides` as ``flwr run -c``'s argument for the Flower app in `app_dir` (None: hybridfl's own): Flower
    accepts only the keys the app's ``[tool.flwr.app.config]`` declares, so the others (a user's own method's keys)
    travel packed in ``method-options`` when the app declares it, and are refused naming the first one when it does
    not."""
    declared = app_config(app_dir)
    packed = {k: v for k, v in overrides.items() if k not in declared}
    plain = {k: v for k, v in overrides.items() if k in declared}
    if packed:
        if "method-options" not in declared:
            key = next(iter(packed))
            raise ConfigError(key, packed[key], f"a key that {app_dir or '.'}/pyproject.toml declares in "
                              "[tool.flwr.app.config] (Flower's `flwr run -c` accepts no other)")
        plain["method-options"] = "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in packed.items()) + " }"
    return " ".join(f"{k}={toml_value(v)}" for k, v in plain.items())


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


def write_connection(flwr_home: Path, name: str, port: int, ca: Path | None = None) -> None:
    """A SuperLink connection `name` -> 127.0.0.1:`port` in $FLWR_HOME/config.toml: HTTPS verified against
    the root certificate `ca` when given, plain HTTP otherwise."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    security = {"root-certificates": str(ca)} if ca else {"insecure": True}
    (flwr_home / "config.toml").write_text(tomli_w.dumps(
        {"superlink": {"default": name, name: {"address": f"127.0.0.1:{port}", **security}}}))


# How this process runs Flower's `flwr` CLI: the command line before flwr's own arguments, given the folder the
# command works in (the app that `flwr run .` sends; None: no app). Here, `flwr` on this machine in that folder;
# compose's operator runs it in the server's network namespace instead (hybridfl/compose.py `operator`).
Flwr = Callable[[Path | None], list[str]]


def local_flwr(folder: Path | None) -> list[str]:
    """`flwr` on this machine (the caller runs it in `folder`)."""
    return ["flwr"]


def register_supernode(env: dict[str, str], connection: str, public_key: Path, flwr: Flwr = local_flwr) -> int:
    """``flwr supernode register``: allow the SuperNode holding `public_key`'s private key (a path as `flwr` sees it)
    on a SuperLink started with ``--enable-supernode-auth``; returns its node id (fixed by the key, across restarts)."""
    out = subprocess.run([*flwr(None), "supernode", "register", str(public_key),
                          connection, "--format", "json"], env=env, capture_output=True,
                         text=True, timeout=120)
    try:
        reply = json.loads(out.stdout)
    except json.JSONDecodeError:
        reply = {}
    if not reply.get("success"):
        raise RuntimeError(f"cannot register {public_key}: {out.stdout}{out.stderr}")
    return int(reply["node-id"])


UNREACHABLE_S = 30.0  # a SuperLink silent this long is gone, not restarting (a saturated one can be slower)


def flwr_run(env: dict[str, str], connection: str, overrides: Mapping[str, Any],
             federation_config: str | None = None, timeout: float | None = None,
             app_dir: Path | None = None, flwr: Flwr = local_flwr, log: Path | None = None,
             unreachable_s: float = UNREACHABLE_S) -> tuple[int, str]:
    """``flwr run . <connection> --stream`` in `app_dir` (None: hybridfl's own app, :func:`hybridfl.bundle.flower_app`;
    or a user's Flower app that runs hybridfl's apps: examples/tabular); returns (run id, its final status text).
    `timeout`: seconds before the run is given up on (a check's bound); None, a user's run: as long as it takes.
    `unreachable_s`: how long the SuperLink may leave the run's status unanswered (:func:`final_status`).

    Output is streamed to this process's stdout as it comes, and appended to `log` where one is given (what the
    run's own processes said: a simulation's Ray, the ServerApp).
    """
    cmd = ["run", ".", connection, "--stream"]
    if overrides:
        cmd += ["--run-config", run_config_arg(overrides, app_dir)]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    proc: subprocess.Popen | None = None
    watchdog: threading.Timer | None = None
    run_id = None
    with flower_app(app_dir) as folder:
        cmd = [*flwr(folder), *cmd]
        print("$", shlex.join(cmd), flush=True)
        try:
            with interrupts_held():
                proc = subprocess.Popen(cmd, env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
                if timeout is not None:
                    # the output loop below blocks; the watchdog bounds it. A daemon: a launcher interrupted (SIGTERM,
                    # Ctrl-C) must not wait for it at exit (a live Timer kept one hanging for its whole timeout)
                    watchdog = threading.Timer(timeout, proc.kill)
                    watchdog.daemon = True
                    watchdog.start()
            assert proc.stdout is not None
            with open(log, "a") if log is not None else contextlib.nullcontext() as saved:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    if saved is not None:
                        saved.write(line)
                    if run_id is None and (m := re.search(r"started run (\d+)", line)):
                        run_id = int(m.group(1))
            proc.wait()
        finally:
            timed_out = watchdog is not None and not watchdog.is_alive()
            if watchdog is not None:
                watchdog.cancel()
            if proc is not None and proc.poll() is None:  # interrupted: the flwr CLI goes too, reaped, not a zombie
                proc.kill()
                proc.wait()
    if timed_out:
        raise RuntimeError(f"flwr run did not finish within {timeout:.0f}s")
    if run_id is None:
        raise RuntimeError(f"flwr run did not start a run (exit code {proc.returncode})")
    return run_id, final_status(env, connection, run_id, timeout, unreachable_s, flwr=flwr)


def run_status(env: dict[str, str], connection: str, run_id: int, flwr: Flwr = local_flwr, field: str = "status"
               ) -> str:
    """A run's status text, e.g. ``finished:completed`` (from ``flwr ls --format json``); with `field`
    ``status-details``, Flower's reason for it (e.g. "Task failed because the run expired": no heartbeat)."""
    out = subprocess.run([*flwr(None), "ls", connection, "--run-id", str(run_id),
                          "--format", "json"], env=env, capture_output=True, text=True, timeout=120)
    try:
        runs = json.loads(out.stdout)["runs"]
    except (json.JSONDecodeError, KeyError) as err:
        raise RuntimeError(f"cannot read the status of run {run_id}: {out.stdout}{out.stderr}") from err
    return str(runs[0][field])


def final_status(env: dict[str, str], connection: str, run_id: int, timeout: float | None = None,
                 unreachable_s: float = UNREACHABLE_S, flwr: Flwr = local_flwr) -> str:
    """The run's status once it is ``finished:*``. ``flwr run --stream`` also returns when its connection
    drops (a SuperLink restarting with ``--database`` keeps the run going), so poll until the run ended, until
    `timeout` seconds (None: no bound), or until the SuperLink has not answered for `unreachable_s` (it is gone, not
    restarting)."""
    deadline, status, since = time.monotonic() + (math.inf if timeout is None else timeout), "unknown", None
    while True:
        try:
            status, since = run_status(env, connection, run_id, flwr), None
        except (RuntimeError, subprocess.TimeoutExpired):
            since = since or time.monotonic()
        now = time.monotonic()
        if since is not None and now - since > unreachable_s:
            return f"unknown: the SuperLink has not answered for {unreachable_s:.0f}s (last status: {status})"
        if status.startswith("finished") or now > deadline:
            return status
        time.sleep(2.0)


def run_and_report(fn: Callable[[], Path], verbose: bool = False) -> int:
    """Run a launcher; print its summary. Exit code 0 = completed, 1 = the run failed, 2 = bad config. A failure
    other than a bad config or a failed run (which say what went wrong themselves) prints one line, the exception,
    and writes its traceback to a file that the line names (`verbose`: prints it too)."""

    try:
        run_path = fn()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - any other failure: one line here, the traceback in a file
        trace = traceback.format_exc()
        if verbose:
            print(trace, file=sys.stderr)
        fd, name = tempfile.mkstemp(prefix=f"hybridfl-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:  # a new file, 0600, at a name nobody could have guessed and planted
            f.write(trace)
        path = Path(name)
        print(f"error: {type(err).__name__}: {err} (the traceback: {path})", file=sys.stderr)
        return 1
    summary = json.loads((run_path / "summary.json").read_text())
    print(f"\nrun {summary['run']}: final test accuracy {summary['final-test-accuracy']:.4f} "
          f"after {summary['final-version']} versions; outputs in {run_path}")
    return 0


def check_completed(run_id: int, status: str, run_path: Path) -> None:
    """Raise unless the run finished:completed and wrote its summary."""
    if status != "finished:completed":
        raise RuntimeError(f"run {run_id} ended as {status!r}; logs in {run_path / 'flower-logs'}")
    if not (run_path / "summary.json").is_file():
        raise RuntimeError(f"run {run_id} completed but wrote no {run_path / 'summary.json'}")
