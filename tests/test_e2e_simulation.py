"""`flwr run .` local simulation (Ray) through scripts/simulate.py, with a temporary FLWR_HOME."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import simulate
from server_app.inprocess import run_inprocess

JOB = {"dataset": "synthetic", "num-clients": 3, "clients-per-round": 3, "num-rounds": 2, "local-epochs": 1,
       "batch-size": 16}
ASYNC_JOB = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 6, "local-epochs": 1,
             "batch-size": 16, "strategy": "fedbuff", "buffer-size": 2, "delay-sigma": 2.0}


def events(out) -> list[tuple]:
    return [(e["client"], e["base-version"], e["dispatch-step"], e["step"], e["outcome"])
            for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())]


@pytest.mark.e2e
def test_flwr_run_simulation_completes_and_matches_in_process(tmp_path):
    out = simulate.simulate({**JOB, "output-dir": str(tmp_path), "run-name": "sim"}, tmp_path / "flwr-home")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final-version"] == 2 and summary["total-accepted"] == 6 and summary["total-failures"] == 0
    assert summary["client-eval"]["replies"] == 3
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    # The -c overrides reached the ServerApp (the run used 3 clients, not the preset's 10).
    assert summary["config"]["num-clients"] == 3 and summary["config"]["dataset"] == "synthetic"
    # Same job in-process: same partitions, seeds and aggregation order. Ray actors run torch with one
    # thread, this process with more, so float sums may differ in the last bits; the runs agree closely.
    ref = run_inprocess({**JOB, "output-dir": str(tmp_path), "run-name": "ref"})
    a, b = torch.load(out / "model.pt"), torch.load(ref / "model.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-3


@pytest.mark.e2e
def test_virtual_clock_events_are_the_same_under_flwr_run_and_in_process(tmp_path):
    """The virtual clock decides the event sequence from the seed alone, whatever order Ray's workers
    physically answer in."""
    sim = simulate.simulate({**ASYNC_JOB, "output-dir": str(tmp_path), "run-name": "sim"}, tmp_path / "flwr-home")
    ref = run_inprocess({**ASYNC_JOB, "output-dir": str(tmp_path), "run-name": "ref"})
    assert events(sim) == events(ref)
    raw = [json.loads(line) for line in (ref / "events.jsonl").read_text().splitlines()]
    assert len(raw) >= 8 and any(e["staleness"] > 0 for e in raw)  # a real asynchronous sequence


def test_bad_config_fails_before_starting_anything(tmp_path, capsys):
    rc = simulate.main(["num-rounds=0", "--flwr-home", str(tmp_path / "home")])
    assert rc == 2
    assert "config key 'num-rounds' = 0" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()
