"""The warm ClientApp executor (client_app/warm_executor.py): what it uses of Flower is where it expects it, and a
local deployment on it (TLS, node authentication, the Runtime APIs' secrets) runs as the in-process engine does,
also after its fork server was killed between two runs."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult
from helpers import flower_threads

from client_app.warm_executor import PRELOAD, WarmExecutor
from scripts.deploy_local import deploy_runs
from scripts.flower import device_timings, process_tree
from server_app.inprocess import run_inprocess

JOB = {"preset": "fedavg-digits", "num-clients": 2, "clients-per-round": 2, "num-rounds": 2, "eval-every": 2}


def test_what_it_uses_of_flower_is_there():
    """Flower 1.41–1.42's SuperExec: its loop takes the executor from a module-level ``get_executor``, an executor
    launches an ExecutionSpec, and ``run_clientapp`` takes a task's token. If Flower moves these, this says which."""
    loop = importlib.import_module("flwr.supercore.superexec.run_superexec")
    assert callable(getattr(loop, "get_executor", None)), "flwr's run_superexec no longer calls get_executor"
    for method in ("get_eligible_capacity", "wait_for_capacity", "launch", "reconcile", "close"):
        assert callable(getattr(SubprocessExecutor, method, None)), f"Flower's executor has no {method}()"
    fields = {"task_type", "runtime_api_address", "token", "insecure", "root_certificates_path",
              "runtime_dependency_install"}
    assert fields <= set(inspect.signature(ExecutionSpec).parameters), "ExecutionSpec lost a field the executor reads"
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    params = set(inspect.signature(run_clientapp).parameters)
    assert {"runtime_api_address", "token", "insecure", "certificates", "runtime_dependency_install"} <= params
    assert TaskType.CLIENT_APP.value == "flwr-clientapp" and callable(LaunchResult.failed)
    for module in PRELOAD:
        importlib.import_module(module)


def test_a_launch_the_fork_server_cannot_take_fails_and_the_next_starts_another(monkeypatch):
    """A fork server that dies is replaced before the next task; the launch it could not take is reported failed."""
    executor = WarmExecutor()
    spec = ExecutionSpec(TaskType.CLIENT_APP, "127.0.0.1:1", "token", True, None, False, None, False, 1)
    try:
        executor.reconcile()
        first = executor._server
        first.send_signal(signal.SIGKILL)
        first.wait()
        monkeypatch.setattr(executor, "_start", lambda: None)  # as if the pipe broke mid-launch
        assert executor.launch(spec).status == "failed"
        monkeypatch.undo()
        executor.reconcile()
        assert executor._server is not first and executor._server.poll() is None and executor.restarts == 1
    finally:
        executor.close()


@pytest.mark.e2e
def test_a_warm_deployment_runs_as_in_process_and_survives_its_fork_server_s_death(tmp_path: Path):
    """TLS, node authentication, the secrets; two runs back to back on the same SuperNodes, the fork servers killed
    (SIGKILL) once the first has finished: the second completes too. The first run's events and model are the
    in-process run's (one torch thread on both sides), and the nodes' train messages paid no interpreter start."""
    runs = [{**JOB, "output-dir": str(tmp_path / "out"), "run-name": "first"},
            {**JOB, "strategy": "fedbuff", "buffer-size": 2, "output-dir": str(tmp_path / "out"),
             "run-name": "second"}]
    killed: list[int] = []

    def kill_fork_servers_after_the_first_run(procs, run_path: Path) -> None:
        def watch() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not (run_path / "summary.json").exists():
                time.sleep(0.2)
            executors = {p.pid for name, p in procs.procs if name.startswith("superexec-clientapp")}
            for pid in process_tree(sorted(executors)) - executors:
                try:  # a fork server is an executor's own child (its forks share its command line)
                    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue  # it ended meanwhile
                if parent in executors:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

        threading.Thread(target=watch, daemon=True).start()

    with flower_threads():
        (first, second), _ = deploy_runs(runs, tmp_path / "home", tls=True, auth=True, executor="warm",
                                         on_started=kill_fork_servers_after_the_first_run)
        ref = run_inprocess({**runs[0], "run-name": "ref"})
    assert len(killed) == 2, "both nodes' fork servers were killed between the runs"
    for run in (first, second):
        summary = json.loads((run / "summary.json").read_text())
        assert summary["total-accepted"] == 4 and summary["total-failures"] == 0
    events = lambda out: [(e["client"], e["step"], e["outcome"]) for e in
                          map(json.loads, (out / "events.jsonl").read_text().splitlines())]
    assert events(first) == events(ref)
    a, b = torch.load(first / "model.pt"), torch.load(ref / "model.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    logs = sorted((first / "flower-logs").glob("superexec-clientapp-*.log"))
    trains = [d for d in device_timings(logs) if d["message"] == "train"]
    assert len(trains) == 8  # both runs' messages: the logs are the nodes'
    assert all(d["import-s"] < 0.5 for d in trains), [d["import-s"] for d in trains]  # torch came imported
    assert "starting another" in "".join(p.read_text() for p in logs)
