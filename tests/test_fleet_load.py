"""The fleet load generator (benchmarks/fleet_load.py, issue 69), short: its command as written, a fleet through a
SuperLink restart, and every device reply reconciled with the run's fates of its messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import needs_nginx

from benchmarks.fleet_load import reconcile
from hybridfl.bundle import PROJECT_DIR

REPO = PROJECT_DIR


@pytest.mark.e2e
def test_fifty_devices_through_a_superlink_restart_have_every_reply_reconciled(tmp_path):
    """50 devices (Flower's Fleet client through the edge, registered keys) answer FedBuff for 2 minutes on a
    SuperLink with SQLite state, killed (SIGKILL) 30 s into training and started again: the run completes, trains
    on after the restart, and each train reply a device logged has exactly one fate in the run (an event, or in
    flight at the end), and no accepted update lacks a device's reply."""
    needs_nginx()
    work = tmp_path / "load"
    done = subprocess.run([sys.executable, "-m", "benchmarks.fleet_load", "--devices", "50", "--minutes", "2",
                           "--processes", "2", "--concurrency", "10", "--database",
                           "--fault", "restart-superlink@30", "--workdir", str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((work / "figures.json").read_text())
    assert figures["connected"] == 50 and figures["state"] == "sqlite"
    [restart] = figures["faults"]
    assert restart["fault"] == "restart-superlink"
    events = [json.loads(line) for line in (work / "runs" / "fleet-load" / "events.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e["outcome"] == "accepted"]
    assert max(e["t"] for e in accepted) > restart["at-s"] + restart["took-s"] + 5  # it trained on after it
    check = figures["reconciliation"]
    assert check["reconciled"] and check["train-replies"] >= check["by-fate"]["accepted"] == len(accepted) > 0
    assert "train-seconds" in figures and figures["pull-s"]["count"] > 0


def _device(message: str, kind: str = "train") -> dict:
    return {"event": "replied", "kind": kind, "message": message, "device": 0}


def test_reconciliation_finds_a_reply_with_two_fates_one_with_none_and_an_update_no_device_sent():
    """What `reconcile` must catch, each alone: a message handed over twice, a device's reply the run has no fate
    for, an accepted update no device logged (allowed only from a device whose process was killed)."""
    events = [{"message": "a", "outcome": "accepted", "client": 0}, {"message": "b", "outcome": "timeout", "client": 1}]
    good = reconcile(events, ["c"], [_device("a"), _device("b"), _device("c"), _device("q", "query")], set())
    assert good["reconciled"] and good["by-fate"] == {"accepted": 1, "timeout": 1, "in flight at the end": 1}
    twice = reconcile([*events, {"message": "a", "outcome": "accepted", "client": 0}], ["c"],
                      [_device("a"), _device("b"), _device("c")], set())
    assert not twice["reconciled"] and twice["two-fates"] == 1
    no_fate = reconcile(events, [], [_device("a"), _device("b"), _device("c")], set())
    assert not no_fate["reconciled"] and no_fate["by-fate"]["no fate"] == 1
    unsent = reconcile(events, ["c"], [_device("b"), _device("c")], set())
    assert not unsent["reconciled"] and unsent["accepted-without-a-device-reply"] == 1
    killed = reconcile(events, ["c"], [_device("b"), _device("c")], {0})
    assert killed["reconciled"] and killed["accepted-from-a-killed-device-log"] == 1


def test_a_profile_summary_leaves_out_idle_threads_and_counts_each_frame_once_per_sample(tmp_path, capsys):
    """benchmarks/pyspy_summary.py: a sample whose innermost frame is a wait is idle; a frame that appears twice on
    one stack counts once for that sample."""
    from benchmarks import pyspy_summary

    profile = tmp_path / "p.txt"
    profile.write_text("main (a.py:1);wait_loop (threading.py:1);Condition.wait (threading.py:327) 6\n"
                       "main (a.py:1);handle (flwr/x.py:2);handle (flwr/x.py:2);verify (flwr/y.py:3) 3\n"
                       "main (a.py:1);handle (flwr/x.py:2) 1\n")
    total, busy, own, within = pyspy_summary.summarise(profile.read_text().splitlines())
    assert (total, busy) == (10, 4) and own == {"verify (flwr/y.py:3)": 3, "handle (flwr/x.py:2)": 1}
    assert within["handle (flwr/x.py:2)"] == 4 and "Condition.wait (threading.py:327)" not in within
    assert pyspy_summary.main([str(profile)]) == 0
    assert "10 samples, 4 busy (40.0 %)" in capsys.readouterr().out
