"""The operator's ``flwr`` command, driven from Python: a SuperLink connection written, a SuperNode registered, a run
started and followed to its real final status (``flwr run`` exits 0 even when the run failed), a launcher's outcome
reported as an exit code. With the local ``flwr``, the registration and the status asks go through the Control API
from this process (flower_internals/control.py); ``flwr run`` stays Flower's command."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from common.config import ConfigError
from flower_internals import control
from hybridfl.launch.bundle import app_config, flower_app, toml_value
from hybridfl.launch.processes import interrupts_held


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


def write_connection(flwr_home: Path, name: str, port: int, ca: Path | None = None) -> None:
    """A SuperLink connection `name` -> 127.0.0.1:`port` in $FLWR_HOME/config.toml: HTTPS verified against
    the root certificate `ca` when given, plain HTTP otherwise."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    security = {"root-certificates": str(ca)} if ca else {"insecure": True}
    (flwr_home / "config.toml").write_text(tomli_w.dumps(
        {"superlink": {"default": name, name: {"address": f"127.0.0.1:{port}", **security}}}))


# How this process runs Flower's `flwr` CLI: the command line before flwr's own arguments, given the folder the
# command works in (the app that `flwr run .` sends; None: no app). Here, `flwr` on this machine in that folder;
# compose's operator runs it in the server's network namespace instead (hybridfl/launch/compose.py `operator`).
Flwr = Callable[[Path | None], list[str]]


def local_flwr(folder: Path | None) -> list[str]:
    """`flwr` on this machine (the caller runs it in `folder`)."""
    return ["flwr"]


def _home(env: Mapping[str, str]) -> Path | None:
    """The FLWR_HOME that `env` gives Flower's CLI (None: Flower's default)."""
    return Path(env["FLWR_HOME"]) if env.get("FLWR_HOME") else None


def register_supernode(env: dict[str, str], connection: str, public_key: Path, flwr: Flwr = local_flwr) -> int:
    """``flwr supernode register``: allow the SuperNode holding `public_key`'s private key (a path as `flwr` sees it)
    on a SuperLink started with ``--enable-supernode-auth``; returns its node id (fixed by the key, across restarts).
    The local `flwr`'s registration is made from this process (flower_internals/control.py); another (compose's
    operator) runs the command."""
    if flwr is local_flwr:
        return control.register_keys(_home(env), connection, [public_key])[0]
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
POLL_S = 2.0  # between a run's status asks where its log stream cannot be followed


def flwr_run(env: dict[str, str], connection: str, overrides: Mapping[str, Any],
             federation_config: str | None = None, timeout: float | None = None,
             app_dir: Path | None = None, flwr: Flwr = local_flwr, log: Path | None = None,
             unreachable_s: float = UNREACHABLE_S) -> tuple[int, str]:
    """``flwr run . <connection> --stream`` in `app_dir` (None: hybridfl's own app,
    :func:`hybridfl.launch.bundle.flower_app`; or a user's Flower app that runs hybridfl's apps: examples/tabular);
    returns (run id, its final status text). `timeout`: seconds before the run is given up on (a check's bound); None, a
    user's run: as long as it takes. `unreachable_s`: how long the SuperLink may leave the run's status unanswered
    (:func:`final_status`).

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
    """A run's status text, e.g. ``finished:completed`` (as ``flwr ls --format json`` says it); with `field`
    ``status-details``, Flower's reason for it (e.g. "Task failed because the run expired": no heartbeat). The local
    `flwr` is asked from this process (flower_internals/control.py: no process per ask); another (compose's operator)
    runs ``flwr ls``."""
    if flwr is local_flwr:
        status, details = control.run_status(_home(env), connection, run_id)
        return {"status": status, "status-details": details}[field]
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
    drops (a SuperLink restarting with ``--database`` keeps the run going), so ask until the run ended, until
    `timeout` seconds (None: no bound), or until the SuperLink has not answered for `unreachable_s` (it is gone, not
    restarting). Between asks, while the SuperLink answers, the run's log stream is followed (``flwr log --stream``,
    which the SuperLink ends once the run finished): one process for the rest of a run, where a ``flwr ls`` every
    :data:`POLL_S` took ~1 s of CPU each, 3 s in a container without Flower's bytecode."""
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
        if since is None and follow_log(env, connection, run_id, deadline - now, flwr) >= POLL_S:
            continue  # the stream ended after a while: the run finished, or the connection dropped
        time.sleep(POLL_S)



def follow_log(env: dict[str, str], connection: str, run_id: int, timeout: float, flwr: Flwr = local_flwr
               ) -> float:
    """``flwr log RUN_ID --stream``, its output discarded, until it ends or `timeout` seconds passed; returns the
    seconds it took."""
    start = time.monotonic()
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([*flwr(None), "log", str(run_id), connection, "--stream"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=None if math.isinf(timeout) else max(timeout, 1.0))
    return time.monotonic() - start


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
