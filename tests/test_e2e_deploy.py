"""Local deployment end to end: a SuperLink and two SuperNodes as real processes, a 2-round run, clean stop."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from scripts.deploy_local import deploy, main


def running(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process, according to ``ps``."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


@pytest.mark.e2e
def test_local_deployment_runs_and_stops_its_processes(tmp_path: Path) -> None:
    overrides = {"num-clients": 2, "clients-per-round": 2, "num-rounds": 2, "dataset": "digits",
                 "output-dir": str(tmp_path / "out"), "run-name": "e2e"}
    run_path, pids = deploy(overrides, tmp_path / "flwr-home", supernodes=2)  # raises unless finished:completed

    assert run_path == tmp_path / "out" / "e2e"
    summary = json.loads((run_path / "summary.json").read_text())
    assert summary["final-version"] == 2
    assert summary["total-accepted"] == 4
    assert summary["client-eval"]["replies"] == 2
    rounds = [json.loads(line)["round"] for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2]
    assert (run_path / "flower-logs" / "supernode-1.log").is_file()
    # superlink + 2 supernodes, plus the flower-superexec each of them starts
    assert len(pids) >= 6
    assert [pid for pid in pids if running(pid)] == []


def test_bad_config_exits_2_before_starting_anything(tmp_path: Path) -> None:
    assert main(["--flwr-home", str(tmp_path / "flwr-home"), "num-rounds=0"]) == 2
    assert not (tmp_path / "flwr-home").exists()


@pytest.mark.e2e
def test_async_deployment_survives_a_slow_and_a_lost_supernode(tmp_path: Path) -> None:
    """Wall clock on 3 real SuperNodes: node 2 is slowed by 10 s per update, node 1 is killed after the
    first step. The run finishes; the fast node contributes more updates than the slow one. (The 60 s reply
    timeout leaves the slow node room on a loaded 2-core machine, where 30 s timed all its updates out.)"""
    overrides = {"num-clients": 3, "clients-per-round": 3, "num-rounds": 5, "dataset": "digits",
                 "strategy": "fedasync", "clock": "wall", "concurrency": 3, "reply-timeout-s": 60.0,
                 "output-dir": str(tmp_path / "out"), "run-name": "async"}
    killed_at: list[float] = []

    def kill_node_1_after_first_step(procs, run_path: Path) -> None:
        def watch() -> None:
            metrics = run_path / "metrics.jsonl"
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:  # round 0 + step 1
                    procs.kill("supernode-1")
                    killed_at.append(time.monotonic())
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()

    run_path, _ = deploy(overrides, tmp_path / "flwr-home", supernodes=3, latency={2: 10.0},
                         on_started=kill_node_1_after_first_step)
    assert killed_at, "the SuperNode was never killed"
    summary = json.loads((run_path / "summary.json").read_text())
    events = [json.loads(line) for line in (run_path / "events.jsonl").read_text().splitlines()]
    accepted = Counter(e["client"] for e in events if e["outcome"] == "accepted")
    assert accepted[0] > accepted[2] >= 1
    assert summary["final-version"] == sum(accepted.values())  # FedAsync: one version per update
    assert len(events) >= 15  # 5 steps of 3 arrivals (lost ones count as arrivals)
    assert summary["reply-to-dispatch-s"]["median"] < 0.5
