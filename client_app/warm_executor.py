"""A warm ClientApp executor: Flower's SuperExec, with ClientApp tasks forked from a process that imported once.

    python -m client_app.warm_executor [flower-superexec's flags: --insecure | --root-certificates F,
                                        --runtime-api-address HOST:PORT, --superexec-auth-secret-file F, ...]

Flower's SuperExec starts a new ``flwr-clientapp`` process for every message: Python, Flower and torch are imported
again each time (1.6 s + 1.6 s per train message of `benchmarks/deploy_overhead.py` on a 2-core machine). This
command is Flower's own ``flower-superexec`` — its command line, its loop, its SuperExec authentication — with one
part replaced: a ClientApp task is handed to a *fork server*, a process started once that imported torch and
Flower's ClientApp runtime, and that forks a child per task. The child runs Flower's own ``run_clientapp`` on the
task's token: it pulls the message, the Context and the FAB from the SuperNode, loads the app from the FAB and
pushes the reply, as ``flwr-clientapp`` does, then exits. So:

- Flower's semantics are kept: node state travels in the Context through the SuperNode; an exception in the app is
  Flower's error reply; a run or FAB is imported afresh by every child (the fork server imports no app code), so
  nothing of one run leaks into another.
- A fork server that dies is started again by the executor before the next task (tests/test_warm_executor.py);
  memory stays bounded because every child exits. A child that dies mid-message (SIGKILL, out of memory) loses only
  its message: once its task's heartbeat expires (Flower's 30 s x patience 2) the SuperNode answers it with Flower's
  error "ClientApp stopped responding", as for a dead ``flwr-clientapp`` (tested).
- A child whose executor died (SIGKILL) gets Flower's exit (its parent monitor's SIGINT), and ends itself if that
  has not finished ORPHAN_GRACE_S later: Flower's exit waits on its retries first (over 30 s measured under load).
- A FAB that a child installed whole is not unzipped and re-verified by the next children (marked by its SHA-256);
  one that a killed child left half installed is installed again (Flower would take its folder for installed).
- Not kept across messages: the node's data and model (read from the node's partition cache, ~0.5 s) and a CUDA
  context (CUDA cannot cross a fork: each child makes its own).

Other task types (none on a SuperNode), and tasks whose app's dependencies Flower installs per run, go to Flower's
subprocess executor. What it uses of Flower is pinned by
``tests/test_warm_executor.py`` (the executor protocol, ``run_superexec``'s ``get_executor``, ``run_clientapp``).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult

# What the fork server imports before it forks: the heavy, app-independent part of every ClientApp task. None of
# hybridfl's own modules: the children import the app from the task's FAB, and a module imported here would shadow it.
# torch._dynamo: torch.optim imports it when it builds its first optimizer (1.8 s on an idle 2-core machine, every
# train message's child did; about 150 MB, shared by the children instead of each child's own).
PRELOAD = ("torch", "torch._dynamo", "numpy", "flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "flwr.app")

# Seconds a child whose executor died has for Flower's own exit (its task output pushed, its heartbeat stopped)
# before the child ends itself: nothing it could still send has anyone to receive it.
ORPHAN_GRACE_S = 5.0

# The fork server, run as `python -P -c` (no folder put first on the import path): argv = the task and reply pipes'
# file descriptors, a folder for its marks, ORPHAN_GRACE_S, then the modules to import. A task is a JSON line of
# run_clientapp's arguments; the reply its pid.
# Flower unzips the FAB and checks every file's hash on every message, although an installed FAB is then used as it
# is (0.4 s per message for this project's 2.3 MB FAB); a child marks a FAB whose install it completed, by its
# SHA-256, and later children use the install without unzipping it again. Flower also takes an app folder that
# exists for installed, even one that a process killed mid-install left half-moved (no pyproject.toml: every later
# message of the node fails to load the app): a child installs into a folder of its own and renames it into place,
# one child at a time, and a folder without a mark is installed again. `install_from_fab` and `marks` are the
# fork server's (tests/test_warm_executor.py runs this part alone).
_INSTALL = r"""
import fcntl, glob, hashlib, os, shutil, tempfile
from pathlib import Path
from flwr.supercore.utils import get_flwr_home
def install_once(content, install_dir=None, skip_prompt=False):
    mark = os.path.join(marks, hashlib.sha256(content).hexdigest())
    with open(os.path.join(marks, "install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released also when a child is killed holding it
        if os.path.exists(mark):
            return Path(Path(mark).read_text())
        base = Path(install_dir or get_flwr_home()).expanduser()
        base.mkdir(parents=True, exist_ok=True)
        for left in glob.glob(str(base / ".install-*")):  # a killed child's
            shutil.rmtree(left, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=".install-", dir=base))
        try:
            built = install_from_fab(content, staging, skip_prompt)
            path = base / built.relative_to(staging)
            if path.exists():
                shutil.rmtree(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.rename(built, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        with open(mark + ".tmp", "w") as out:
            out.write(str(path))
        os.replace(mark + ".tmp", mark)
        return path
"""
_SERVER = r"""
import hashlib, importlib, json, os, signal, sys, threading, time, traceback
tasks, replies = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
marks = sys.argv[3]
for module in sys.argv[5:]:
    importlib.import_module(module)
from flwr.supernode.runtime import run_clientapp as runtime
from flwr.supernode.runtime.run_clientapp import run_clientapp
install_from_fab = runtime.install_from_fab
""" + _INSTALL + r"""
runtime.install_from_fab = install_once
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
ORPHAN_GRACE_S = float(sys.argv[4])


def end_when_orphaned(parent):
    # Flower's monitor raises SIGINT, whose handler runs once the main thread leaves its retry wait (up to 20 s) and
    # then joins the heartbeat thread, which may wait for the retry lock the main thread holds: 14 s measured here,
    # over 30 s under load. Its peer is gone, so after Flower's own exit had ORPHAN_GRACE_S the child ends.
    while True:
        time.sleep(0.2)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            time.sleep(ORPHAN_GRACE_S)
            print(f"warm executor: the executor (pid {parent}) ended {ORPHAN_GRACE_S:g} s ago and Flower's exit has "
                  "not finished: the ClientApp ends", file=sys.stderr)
            sys.stdout.flush(); sys.stderr.flush(); os._exit(1)


# What is imported so far stays out of the children's garbage collections: a collection touches every object it
# tracks, and each page it touches is copied into the child (a child that trained and collected: 90 MB
# more per child without this, measured in a container)
import gc
gc.freeze()
print("ready", file=replies, flush=True)
for line in tasks:
    task = json.loads(line)
    pid = os.fork()
    if pid == 0:
        tasks.close(); replies.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        path = task.pop("root_certificates_path")
        task["certificates"] = None if path is None else open(path, "rb").read()
        code = 1
        try:
            if task.get("parent_pid") is not None:
                threading.Thread(target=end_when_orphaned, args=(task["parent_pid"],), daemon=True).start()
            run_clientapp(**task)
        except SystemExit as done:  # run_clientapp ends with flwr_exit
            code = done.code if isinstance(done.code, int) else 1
        except BaseException:  # os._exit below would drop it unprinted: the node's log shows it, as Flower's would
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
    print(pid, file=replies, flush=True)
"""


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
        self._server = subprocess.Popen([sys.executable, "-P", "-c", _SERVER, str(task_r), str(reply_w),
                                         self._marks.name, str(ORPHAN_GRACE_S), *PRELOAD], pass_fds=(task_r, reply_w))
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


def main() -> None:
    """``flower-superexec`` with the warm executor in place of its subprocess executor."""
    loop = importlib.import_module("flwr.supercore.superexec.run_superexec")
    executor = WarmExecutor()
    loop.get_executor = lambda *args, **kwargs: executor
    from flwr.supercore.cli.flower_superexec import flower_superexec

    flower_superexec()


if __name__ == "__main__":
    main()
