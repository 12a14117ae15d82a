"""Flower's SuperExec with its task poll patient with a Runtime API's server errors and paced when idle
(:func:`task_poll`; server_app/superexec.py is the ServerApp's command), and with its ClientApp tasks forked from a
warm process: :class:`WarmExecutor` in place of its subprocess executor (client_app/warm_executor.py is the command,
and says why).

Other task types (none on a SuperNode), and tasks whose app's dependencies Flower installs per run, go to Flower's
subprocess executor.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from flwr.supercore.constant import TaskType
from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult

# Flower internals this module relies on (checked by tests/test_flower_internals.py, with :func:`check`)
RELIES_ON = ("flwr.supercore.constant:TaskType.CLIENT_APP",
             "flwr.supercore.superexec.executor.subprocess_executor:SubprocessExecutor",
             "flwr.supercore.superexec.executor.types:ExecutionSpec",
             "flwr.supercore.superexec.executor.types:LaunchResult.failed",
             "flwr.supercore.superexec.executor.types:LaunchResult.accepted",
             "flwr.supercore.superexec.run_superexec:get_executor",
             "flwr.supercore.superexec.run_superexec:_get_task_poll_interval",
             "flwr.supercore.cli.flower_superexec:flower_superexec",
             "flwr.supercore.runtime.runtime_http_client:RuntimeHttpClient.AcquireTask",
             "flwr.supernode.runtime.run_clientapp:run_clientapp")
LOOP = "flwr.supercore.superexec.run_superexec"

# What the fork server imports before it forks: the heavy, app-independent part of every ClientApp task. None of
# hybridfl's app packages: the children import the app from the task's FAB, and a module imported here would shadow
# it. torch._dynamo: torch.optim imports it when it builds its first optimizer (1.8 s on an idle 2-core machine, every
# train message's child did; about 150 MB, shared by the children instead of each child's own).
PRELOAD = ("torch", "torch._dynamo", "numpy", "flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "flwr.app")

# Seconds a child whose executor died has for Flower's own exit (its task output pushed, its heartbeat stopped)
# before the child ends itself: nothing it could still send has anyone to receive it.
ORPHAN_GRACE_S = 5.0


def fork_server_command(tasks_fd: int, replies_fd: int, marks: str, preload: Sequence[str] = PRELOAD) -> list[str]:
    """The fork server's command line: its file run as a script (flower_internals/fork_server.py says why)."""
    return [sys.executable, "-P", str(Path(__file__).with_name("fork_server.py")), str(tasks_fd), str(replies_fd),
            marks, str(ORPHAN_GRACE_S), *preload]


class WarmExecutor(SubprocessExecutor):
    """Flower's executor protocol: ClientApp tasks to the fork server (started, and started again when it died,
    here), the rest as Flower's subprocess executor runs them."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._tasks: Any = None
        self._replies: Any = None
        self._marks = tempfile.TemporaryDirectory(prefix="warm-executor-")  # the FABs installed whole
        self.restarts = 0
        self.failed_starts = 0

    def _running(self) -> bool:
        return self._server is not None and self._server.poll() is None

    def _start(self) -> None:
        if self._running():
            return
        if self._server is not None:
            self.restarts += 1
            print(f"warm executor: the fork server ended (exit {self._server.returncode}); starting another",
                  file=sys.stderr, flush=True)
        task_r, task_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self._server = subprocess.Popen(fork_server_command(task_r, reply_w, self._marks.name),
                                        pass_fds=(task_r, reply_w))
        os.close(task_r)
        os.close(reply_w)
        self._tasks, self._replies = os.fdopen(task_w, "w"), os.fdopen(reply_r, "r")
        if self._replies.readline().strip() != "ready":
            raise RuntimeError(f"the warm executor's fork server did not start (exit {self._server.wait()})")

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        # A task whose app's dependencies Flower installs per run needs a fresh interpreter: a fork already holds
        # torch and numpy, so the app's own versions could not take effect
        if spec.task_type != TaskType.CLIENT_APP or spec.runtime_dependency_install:
            return super().launch(spec)
        task = {"runtime_api_address": spec.runtime_api_address, "token": spec.token, "insecure": spec.insecure,
                "root_certificates_path": None if spec.insecure else spec.root_certificates_path,
                "runtime_dependency_install": spec.runtime_dependency_install,
                "parent_pid": spec.parent_pid}  # as Flower's: the child ends when this executor does
        try:
            self._start()
            print(json.dumps(task), file=self._tasks, flush=True)
            if not self._replies.readline().strip().isdigit():  # the child's pid: it runs
                raise EOFError("no child started")
        except (OSError, EOFError, RuntimeError) as err:  # the next launch starts another fork server
            return LaunchResult.failed(f"warm executor: {type(err).__name__}: {err}")
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Keep a fork server running: a dead one is replaced between tasks, not during one. Called in Flower's
        loop, which an exception would end (and the node's executor with it): a fork server that cannot start is
        reported and tried again at the next call; meanwhile launches fail, each reported to Flower."""
        try:
            self._start()
        except (OSError, RuntimeError) as err:
            self.failed_starts += 1
            print(f"warm executor: cannot start the fork server ({type(err).__name__}: {err}); trying again",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._running():
            self._tasks.close()  # end of input: the server's loop ends
            try:
                self._server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._marks.cleanup()


def check() -> list[str]:
    """What :data:`RELIES_ON` cannot say: the executor protocol's methods, the fields of a task it reads, and
    ``run_clientapp``'s arguments; one line per thing that moved."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    moved = [f"Flower's SubprocessExecutor has no {m}()" for m in
             ("get_eligible_capacity", "wait_for_capacity", "launch", "reconcile", "close")
             if not callable(getattr(SubprocessExecutor, m, None))]
    fields = {"task_type", "runtime_api_address", "token", "insecure", "root_certificates_path",
              "runtime_dependency_install", "parent_pid"} - set(inspect.signature(ExecutionSpec).parameters)
    moved += [f"ExecutionSpec has no field {f!r}" for f in sorted(fields)]
    args = {"runtime_api_address", "token", "insecure", "certificates", "runtime_dependency_install",
            "parent_pid"} - set(inspect.signature(run_clientapp).parameters)
    moved += [f"run_clientapp takes no {a!r}" for a in sorted(args)]
    if TaskType.CLIENT_APP.value != "flwr-clientapp":
        moved.append(f"TaskType.CLIENT_APP is {TaskType.CLIENT_APP.value!r}, not 'flwr-clientapp'")
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError as err:
            moved.append(f"the fork server's preload {module} does not import ({err})")
    return moved


# How long a task poll answered with server errors is asked again before the SuperExec exits as Flower's does
PATIENCE_S = 120.0
# A SuperExec that acquired no task for IDLE_AFTER_S asks every IDLE_POLL_S (Flower's default) rather than every
# FLWR_SUPEREXEC_TASK_POLL_INTERVAL (0.2 s in hybridfl's deployments: a node's next message follows its last reply
# within a second, and waits for the poll). Measured idle, a 4-node deployment's five SuperExecs at 0.2 s were 0.08
# of a core of Runtime API requests, most of an idle deployment's CPU.
IDLE_AFTER_S = 10.0
IDLE_POLL_S = 1.0


def task_poll(patience_s: float = PATIENCE_S, idle_after_s: float = IDLE_AFTER_S,
              idle_poll_s: float = IDLE_POLL_S) -> None:
    """Flower 1.42's SuperExec task poll (``AcquireTask``), patient and paced.

    Patient: Flower's SuperExec exits on one 5xx answer, and the app it started, which watches its parent's pid
    (``--parent-pid``), exits with it: a SQLite SuperLink starved of CPU answered 500 ("database is locked") for a
    moment, and its run failed ("Task failed with unknown error", in CI's fleet-load test). Here a poll answered 5xx
    is asked again, after 0.5 s, then twice as long each time up to 8 s, for up to `patience_s` seconds, and then
    raises as before.

    Paced: Flower's loop asks, then sleeps its interval, whether or not a task came. After `idle_after_s` without a
    task a poll first waits what brings the period to `idle_poll_s`; the first task answered restores the interval.
    A busy node keeps the short interval; a node idle for a while takes up to `idle_poll_s` to start its next task."""
    asked = RuntimeHttpClient.AcquireTask
    if getattr(asked, "patient", False):
        return
    loop = importlib.import_module(LOOP)
    last_task = time.monotonic()

    def acquire(self: RuntimeHttpClient, request: Any) -> Any:
        nonlocal last_task
        if time.monotonic() - last_task > idle_after_s:  # Flower's interval, read as its loop reads it
            time.sleep(max(0.0, idle_poll_s - loop._get_task_poll_interval()))
        waited, wait = 0.0, 0.5
        while True:
            try:
                reply = asked(self, request)
                break
            except httpx.HTTPStatusError as err:
                if err.response.status_code < 500 or waited >= patience_s:
                    raise
                print(f"superexec: the task poll was answered {err.response.status_code}; asking again in {wait:g} s",
                      file=sys.stderr, flush=True)
                time.sleep(wait)
                waited, wait = waited + wait, min(2 * wait, 8.0)
        if reply.HasField("task"):
            last_task = time.monotonic()
        return reply

    acquire.patient = True  # type: ignore[attr-defined]
    RuntimeHttpClient.AcquireTask = acquire  # type: ignore[method-assign]


def run_superexec(executor: SubprocessExecutor | None = None) -> None:
    """``flower-superexec`` (its command line, loop and authentication) with its task poll patient and paced, and
    `executor` (a :class:`WarmExecutor`) in place of its own where given."""
    task_poll()
    if executor is not None:
        loop = importlib.import_module(LOOP)
        loop.get_executor = lambda *args, **kwargs: executor
    from flwr.supercore.cli.flower_superexec import flower_superexec

    flower_superexec()
