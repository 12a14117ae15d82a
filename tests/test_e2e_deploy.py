"""Local deployment end to end: a SuperLink and two SuperNodes as real processes, a 2-round run, clean stop."""

from __future__ import annotations

import json
import subprocess
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
