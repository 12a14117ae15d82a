"""The warm executor's fork server: imports the heavy, app-independent part of every ClientApp task once, then forks
a child per task that runs Flower's own ``run_clientapp`` (flower_internals/superexec.py starts it and hands it tasks).

    python -P .../flower_internals/fork_server.py TASKS_FD REPLIES_FD MARKS_DIR ORPHAN_GRACE_S MODULE...

A task is a JSON line of ``run_clientapp``'s arguments on TASKS_FD; the reply, the child's pid on REPLIES_FD (after
``ready`` once the MODULEs are imported). The children import the app from the task's FAB, so the fork server
imports nothing of hybridfl's (a module imported here would shadow the FAB's): it runs as a file, not ``-m`` (which
would import this package), with ``-P`` (no folder put first on the import path), and needs only the standard library
and Flower. So it runs wherever the file is: a checkout, an installed wheel, or a device container that mounts this
folder beside the warm executor's command (docker/compose.yml).

Flower unzips the FAB and checks every file's hash on every message, although an installed FAB is then used as it
is (0.4 s per message for this project's 2.3 MB FAB): a child marks a FAB whose install it completed, by its SHA-256
(in MARKS_DIR), and later children use the install without unzipping it again. Flower also takes an app folder that
exists for installed, even one that a process killed mid-install left half-moved (no pyproject.toml: every later
message of the node fails to load the app): a child installs into a folder of its own and renames it into place, one
child at a time, and a folder without a mark is installed again (:func:`install_once`, in place of Flower's
``install_from_fab``).
"""

from __future__ import annotations

import fcntl
import gc
import glob
import hashlib
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Flower internals this module relies on (checked by tests/test_flower_internals.py)
RELIES_ON = ("flwr.supernode.runtime.run_clientapp:run_clientapp",
             "flwr.supernode.runtime.run_clientapp:install_from_fab", "flwr.supercore.utils:get_flwr_home")
SOURCE_NEEDLES = {"flwr.supernode.runtime.run_clientapp:run_clientapp": ("install_from_fab(",)}


def install_once(marks: str, install: Callable[..., Path]) -> Callable[..., Path]:
    """Flower's `install` (``install_from_fab(content, install_dir, skip_prompt)``), made to install a FAB once per
    fork server, whole or not at all: marked in `marks` by its SHA-256 once complete."""
    from flwr.supercore.utils import get_flwr_home

    def install_from_fab(content: bytes, install_dir: Any = None, skip_prompt: bool = False) -> Path:
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
                built = install(content, staging, skip_prompt)
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

    return install_from_fab


def end_when_orphaned(parent: int, grace_s: float) -> None:
    """End this child `grace_s` after its executor (`parent`) is gone. Flower's monitor raises SIGINT, whose handler
    runs once the main thread leaves its retry wait (up to 20 s) and then joins the heartbeat thread, which may wait
    for the retry lock the main thread holds: 14 s measured here, over 30 s under load. Its peer is gone, so after
    Flower's own exit had `grace_s` the child ends."""
    while True:
        time.sleep(0.2)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            time.sleep(grace_s)
            print(f"warm executor: the executor (pid {parent}) ended {grace_s:g} s ago and Flower's exit has "
                  "not finished: the ClientApp ends", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def run_child(task: dict[str, Any], grace_s: float) -> None:
    """In a forked child: run Flower's ``run_clientapp`` on `task`, then exit with its code (a traceback printed
    first, as Flower's own process would show it, if it raised)."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    path = task.pop("root_certificates_path")
    task["certificates"] = None if path is None else Path(path).read_bytes()
    code = 1
    try:
        if task.get("parent_pid") is not None:
            threading.Thread(target=end_when_orphaned, args=(task["parent_pid"], grace_s), daemon=True).start()
        run_clientapp(**task)
    except SystemExit as done:  # run_clientapp ends with flwr_exit
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001 - os._exit below would drop it unprinted: the node's log shows it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(tasks_fd: int, replies_fd: int, marks: str, grace_s: float, preload: list[str]) -> None:
    """Import `preload`, then fork a child per task line read from `tasks_fd`, its pid written to `replies_fd`."""
    tasks, replies = os.fdopen(tasks_fd, "r"), os.fdopen(replies_fd, "w")
    for module in preload:
        importlib.import_module(module)
    runtime = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    runtime.install_from_fab = install_once(marks, runtime.install_from_fab)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    # What is imported so far stays out of the children's garbage collections: a collection touches every object it
    # tracks, and each page it touches is copied into the child (a child that trained and collected: 90 MB more per
    # child without this, measured in a container)
    gc.freeze()
    print("ready", file=replies, flush=True)
    for line in tasks:
        task = json.loads(line)
        pid = os.fork()
        if pid == 0:
            tasks.close()
            replies.close()
            run_child(task, grace_s)
        print(pid, file=replies, flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5:])
