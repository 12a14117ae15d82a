"""Starting and stopping Flower processes safely: an isolated FLWR_HOME, free loopback ports,
environment for offline machines, process groups stopped by PID, and a run's real final status
(``flwr run`` exits 0 even when the run failed)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

PROJECT_DIR = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: private FLWR_HOME, no telemetry, no runtime installs,
    and this interpreter's bin/ first on PATH (SuperLink/SuperNode start flower-superexec by name)."""
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    })
    return env


def toml_value(value: Any) -> str:
    """A Python value as a TOML literal for ``flwr run -c``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def run_config_arg(overrides: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())


class ProcessGroup:
    """Processes this script started, each in its own session, stopped together (and only them)."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir, self.env = log_dir, env
        self.procs: list[tuple[str, subprocess.Popen]] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: Sequence[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(list(cmd), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=PROJECT_DIR)
        self.procs.append((name, proc))
        return proc

    def stop(self, name: str | None = None, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Stop process `name` (or all) and its children: SIGTERM to the group, SIGKILL after `grace` s."""
        targets = [(n, p) for n, p in self.procs if name is None or n == name]
        for _, p in targets:
            if p.poll() is None:
                _signal_group(p.pid, sig)
        deadline = time.monotonic() + grace
        for _, p in targets:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait()
        for _, p in targets:
            _signal_group(p.pid, signal.SIGKILL)  # children left behind in the group

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait for a SuperLink's /health on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"flower-superlink on port {port} not healthy after {timeout:.0f}s")


def write_connection(flwr_home: Path, name: str, port: int) -> None:
    """A SuperLink connection `name` -> 127.0.0.1:`port` (insecure) in $FLWR_HOME/config.toml."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')


def flwr_run(env: dict[str, str], connection: str, overrides: Mapping[str, Any],
             federation_config: str | None = None, timeout: float = 3600.0) -> tuple[int, str]:
    """``flwr run . <connection> --stream``; returns (run id, its final status text).

    Output is streamed to this process's stdout as it comes.
    """
    cmd = [str(Path(sys.executable).parent / "flwr"), "run", ".", connection, "--stream"]
    if overrides:
        cmd += ["--run-config", run_config_arg(overrides)]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=PROJECT_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    run_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if run_id is None and (m := re.search(r"started run (\d+)", line)):
            run_id = int(m.group(1))
    proc.wait(timeout=timeout)
    if run_id is None:
        raise RuntimeError(f"flwr run did not start a run (exit code {proc.returncode})")
    return run_id, run_status(env, connection, run_id)


def run_status(env: dict[str, str], connection: str, run_id: int) -> str:
    """A run's status text, e.g. ``finished:completed`` (from ``flwr ls --format json``)."""
    out = subprocess.run([str(Path(sys.executable).parent / "flwr"), "ls", connection, "--run-id", str(run_id),
                          "--format", "json"], env=env, cwd=PROJECT_DIR, capture_output=True, text=True, timeout=120)
    try:
        runs = json.loads(out.stdout)["runs"]
    except (json.JSONDecodeError, KeyError) as err:
        raise RuntimeError(f"cannot read the status of run {run_id}: {out.stdout}{out.stderr}") from err
    return str(runs[0]["status"])
