"""The fleet load generator (benchmarks/fleet_load.py, issue 69), short: its command as written, a fleet through a
SuperLink restart, and every device reply reconciled with the run's fates of its messages."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import needs_nginx

from benchmarks.fleet_load import reconcile
from hybridfl.launch.bundle import PROJECT_DIR

REPO = PROJECT_DIR


@pytest.mark.e2e
@pytest.mark.late
def test_thirty_devices_through_a_superlink_restart_have_every_reply_reconciled(tmp_path):
    """30 devices (Flower's Fleet client through the edge, registered keys) answer FedBuff for 60 s on a SuperLink
    with SQLite state, killed (SIGKILL) 10 s after the run's first accepted update and started again: the run
    completes, accepts updates after the restart (the events written once it is back), and resumes from its
    checkpoint for 2 more steps (a message lost in the restart waits 60 s for its reply, not the default 120, before
    the run counts it and ends); each train reply a device logged has exactly one fate in the run and its resumed
    part (an event, or in flight at the end), and no accepted update lacks a device's reply."""
    needs_nginx()
    work = tmp_path / "load"
    done = subprocess.run([sys.executable, "-m", "benchmarks.fleet_load", "--devices", "30", "--minutes", "1.0",
                           "--processes", "2", "--concurrency", "10", "--database",
                           "--fault", "restart-superlink@10", "--resume-steps", "2", "--reply-timeout-s", "60",
                           "--workdir", str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((work / "figures.json").read_text())
    assert figures["connected"] == 30 and figures["state"] == "sqlite"
    [restart] = figures["faults"]
    assert restart["fault"] == "restart-superlink"
    events = [json.loads(line) for line in (work / "runs" / "fleet-load" / "events.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e["outcome"] == "accepted"]
    resumed = figures["resumed"]
    last = resumed["from-step"]
    assert resumed["resumed-after-round"] == last and resumed["steps"] == [last + 1, last + 2], resumed
    assert 0 < resumed["accepted"] < len(accepted) and max(e["round"] for e in accepted) == last + 2
    assert [e for e in events[restart["events-before"]:] if e["outcome"] == "accepted" and e["round"] <= last]
    check = figures["reconciliation"]
    assert check["reconciled"] and check["train-replies"] >= check["by-fate"]["accepted"] == len(accepted) > 0, check
    assert "train-seconds" in figures and figures["pull-s"]["count"] > 0


def _device(message: str, kind: str = "train", event: str = "replied", **fields: str) -> dict:
    return {"event": event, "kind": kind, "message": message, "device": 0, **fields}


def test_reconciliation_finds_a_reply_with_two_fates_one_with_none_and_an_update_no_device_sent():
    """What `reconcile` must catch, each alone: a message handed over twice, a device's reply the run has no fate
    for (a push the SuperLink lost is one), an accepted update no device logged (allowed only from a device whose
    process was killed)."""
    events = [{"message": "a", "outcome": "accepted", "client": 0}, {"message": "b", "outcome": "timeout", "client": 1}]
    good = reconcile(events, ["c"], [], [_device("a"), _device("b"), _device("c"), _device("q", "query")], set())
    assert good["reconciled"] and good["by-fate"] == {"accepted": 1, "timeout": 1, "in flight at the end": 1}
    twice = reconcile([*events, {"message": "a", "outcome": "accepted", "client": 0}], ["c"], [],
                      [_device("a"), _device("b"), _device("c")], set())
    assert not twice["reconciled"] and twice["two-fates"] == 1
    no_fate = reconcile(events, [], [], [_device("a"), _device("b"), _device("c")], set())
    assert not no_fate["reconciled"] and no_fate["by-fate"]["no fate"] == 1
    unsent = reconcile(events, ["c"], [], [_device("b"), _device("c")], set())
    assert not unsent["reconciled"] and unsent["accepted-without-a-device-reply"] == 1
    killed = reconcile(events, ["c"], [], [_device("b"), _device("c")], {0})
    assert killed["reconciled"] and killed["accepted-from-a-killed-device-log"] == 1
    # a device whose push failed after the SuperLink registered its reply (seen through a SuperLink restart: the
    # objects were stored, the acknowledgement lost) sent it; failing before the push, it did not
    pushed = reconcile(events, ["c"], [], [_device("a", event="failed", stage="push"), _device("b"), _device("c")],
                       set())
    assert pushed["reconciled"] and pushed["push-failed"] == {"accepted": 1} and pushed["by-fate"]["accepted"] == 1
    trained = reconcile(events, ["c"], [], [_device("a", event="failed", stage="train"), _device("b"), _device("c")],
                        set())
    assert not trained["reconciled"] and trained["accepted-without-a-device-reply"] == 1
    lost = reconcile(events[1:], [], [], [_device("a", event="failed", stage="push"), _device("b")], set())
    assert not lost["reconciled"] and lost["push-failed"] == {"no fate": 1}
    # a train message whose push the SuperLink lost in a restart (sent again under a new id) may still be delivered
    # and answered: its fate is "pushed again", and a message both pushed again and handed over has two
    again = reconcile(events, ["c"], ["d"], [_device("a"), _device("b"), _device("c"), _device("d")], set())
    assert again["reconciled"] and again["by-fate"]["pushed again"] == 1
    both = reconcile(events, ["c"], ["a"], [_device("a"), _device("b"), _device("c")], set())
    assert not both["reconciled"] and both["two-fates"] == 1


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


def test_a_fault_is_kind_at_seconds_and_a_fault_the_setup_cannot_take_fails_at_start(capsys):
    """`--fault KIND@SECONDS`: an unknown kind or a bad time is refused naming what is allowed; a SuperLink restart
    without --database (its runs would be lost) and more device faults than untouched processes fail before anything
    starts."""
    import argparse

    from benchmarks.fleet_load import fault, main

    assert fault("restart-edge@12.5") == ("restart-edge", 12.5)
    for bad in ("reboot@3", "restart-edge", "restart-edge@-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="restart-superlink, restart-edge"):
            fault(bad)
    for argv, said in ((["--fault", "restart-superlink@5"], "needs --database"),
                       (["--processes", "2", "--fault", "drop-devices@1", "--fault", "replace-devices@2"],
                        "fewer than --processes"),
                       (["--reply-timeout-s", "0"], "--reply-timeout-s > 0")):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_device_faults_hit_a_new_process_each_and_a_replaced_one_starts_again():
    """Workers.hit: the last process not hit yet is killed; `replace-devices` starts its devices again under a new
    name, `drop-devices` does not; every device of a killed process is counted as killed; the fleet's processes
    (what the sampler measures and `stop` ends) are the untouched and the restarted ones."""
    from benchmarks.fleet_load import Workers

    class Procs:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []
            self.procs: list[tuple[str, object]] = []

        def start(self, name, cmd, env=None):
            self.calls.append(("start", name))
            self.procs.append((name, type("P", (), {"pid": 100 + len(self.procs)})()))

        def kill(self, name):
            self.calls.append(("kill", name))

    server = type("S", (), {"procs": Procs()})()
    workers = Workers(server, lambda first, count: [str(first), str(count)], {}, 10, 3)
    assert workers.parts == [(0, 4), (4, 4), (8, 2)]
    assert workers.hit("replace-devices") == [8, 9]
    assert workers.hit("drop-devices") == [4, 5, 6, 7]
    assert server.procs.calls[3:] == [("kill", "devices-8"), ("start", "devices-8-again"), ("kill", "devices-4")]
    assert workers.killed == {4, 5, 6, 7, 8, 9} and workers.names[4] == "devices-4-dropped"
    assert [p.pid for p in workers.processes()] == [100, 103]  # devices-0 and devices-8-again


def test_memory_growth_is_the_latest_process_slope_over_training_after_its_warm_up_per_hour(tmp_path):
    """Sampler.growth: % per hour of the mean, from the latest pid's samples between TRAIN_WARM_UP_S after the run's
    first accepted update and its last (the events file's first and last growth, as the sampler sees it), and after
    the pid's own first minute; None before training or for under 5 minutes of samples."""
    from benchmarks.fleet_load import TRAIN_WARM_UP_S, Sampler

    events = tmp_path / "events.jsonl"
    sampler = Sampler({"superlink": lambda: 1}, events)
    old = [(t, 1, 500.0 + t) for t in range(0, 400, 10)]  # a process that grew fast, then was restarted
    new = [(t, 2, 100.0 + (t - 400) / 360) for t in range(400, 2010, 10)]  # 10 MiB per hour around ~101 MiB
    evaluation = [(t, 2, 300.0 + t) for t in range(2010, 2300, 10)]  # the final evaluation: not training
    sampler.series["superlink"] = old + new + evaluation
    sampler.watch(50.0)
    assert sampler.growth("superlink") is None  # no update accepted yet
    for now in (300.0, 900.0, 2000.0, 2200.0):  # updates at 300, 900 and 2000; none since
        if now < 2100:
            with events.open("a") as f:
                f.write('{"outcome": "accepted"}\n')
        sampler.watch(now)
    assert sampler.training == (300.0, 2000.0) and sampler.window() == [300.0 + TRAIN_WARM_UP_S, 2000.0]
    growth = sampler.growth("superlink")
    mean = np.mean([m for t, _, m in new if t >= 300 + TRAIN_WARM_UP_S])
    assert growth == pytest.approx(100 * 10 / mean, abs=0.01)
    sampler.series["superlink"] = new[:45]  # 400-840 s: 4 minutes after the warm-up's end at 600 s
    assert sampler.growth("superlink") is None


def test_a_root_of_several_processes_is_sampled_as_their_sum_and_a_changed_set_as_a_restart(tmp_path):
    """The devices' root is all their processes: one RSS, their sum; CPU only between samples of the same set (a
    process replaced is another set, as a restarted SuperLink is another pid)."""
    import psutil

    from benchmarks.fleet_load import Sampler

    children = [subprocess.Popen([sys.executable, "-c", f"x = bytearray({n} * 2**20); import time; time.sleep(60)"])
                for n in (40, 80)]
    try:
        pids = [c.pid for c in children]
        time.sleep(2.0)  # both have allocated
        sampler = Sampler({"devices": lambda: list(pids), "one": lambda: pids[0]}, tmp_path / "events.jsonl")
        last: dict = {}
        sampler.sample(last)
        sampler.sample(last)
        rss = [psutil.Process(p).memory_info().rss / 2**20 for p in pids]
        (_, both, mib), (_, one, one_mib) = sampler.series["devices"][-1], sampler.series["one"][-1]
        assert both == tuple(pids) and one == pids[0]
        assert mib == pytest.approx(sum(rss), rel=0.05) and one_mib == pytest.approx(rss[0], rel=0.05)
        assert mib - one_mib > 70  # the second process's 80 MiB counted in the devices' root only
        assert len(sampler.cpu["devices"]) == 1
        pids[1] = pids[0]  # the set changed: no CPU figure across it
        sampler.sample(last)
        assert len(sampler.cpu["devices"]) == 1 and len(sampler.cpu["one"]) == 2
    finally:
        for c in children:
            c.kill()
            c.wait()


def test_the_reply_pull_request_follows_the_fields_flower_s_proto_has(monkeypatch):
    """Flower 1.42's ServerAppIo pull asks by `message_ids`; the 1.43 development line's by a `reply_to_message_ids`
    list (what benchmarks/fleet_load.py runs against flwr-nightly)."""
    from flower_internals import replies

    real = replies.pull_request(["a", "b"])  # the installed Flower's own message
    if "reply_to_message_ids" in replies.PullAppMessagesRequest.DESCRIPTOR.fields_by_name:
        assert list(real.reply_to_message_ids.vals) == ["a", "b"]  # 1.43 has no message_ids
    else:
        assert list(real.message_ids) == ["a", "b"]

    class Newer:
        DESCRIPTOR = type("D", (), {"fields_by_name": {"reply_to_message_ids": None}})

        def __init__(self, **fields):
            self.fields = fields

    monkeypatch.setattr(replies, "PullAppMessagesRequest", Newer)
    asked = replies.pull_request(["a"]).fields["reply_to_message_ids"]
    assert list(asked.vals) == ["a"]


def test_a_fleet_larger_than_the_data_is_refused_before_anything_starts(tmp_path, capsys):
    """Each device holds a part of digits' 1438 training samples: 1439 devices stop at the arguments, naming the key,
    the value and the bound, with nothing started (the run's own check came only once the ServerApp ran)."""
    from benchmarks.fleet_load import main

    with pytest.raises(SystemExit) as stopped:
        main(["--devices", "1439", "--minutes", "1", "--workdir", str(tmp_path / "load")])
    assert stopped.value.code == 2
    assert "'num-clients' = 1439 is not allowed: expected at least 1 and at most the 1438" in capsys.readouterr().err
    assert not (tmp_path / "load" / "home").exists() and not (tmp_path / "load" / "certs").exists()


def test_faults_are_timed_from_the_run_s_first_accepted_update_not_its_round_zero(tmp_path):
    """inject: a fault waits for the run's first accepted update (events.jsonl's first line; round 0's metrics alone
    are too early: a restart in the first round under CI's load lost every message out), then comes at its time."""
    from benchmarks.fleet_load import inject

    calls: list[tuple[str, float]] = []

    class Server:
        def restart(self, what: str) -> None:
            calls.append((what, time.monotonic()))

    (tmp_path / "metrics.jsonl").write_text('{"round": 0}\n')
    done, record = threading.Event(), []
    thread = threading.Thread(target=inject, args=([("restart-edge", 0.3)], Server(), None, tmp_path, done, record))
    thread.start()
    time.sleep(1.0)
    assert calls == [] and thread.is_alive()  # round 0 evaluated, nothing accepted yet: no fault
    first = time.monotonic()
    (tmp_path / "events.jsonl").write_text('{"outcome": "accepted"}\n')
    thread.join(30)
    assert [what for what, _ in calls] == ["edge"] and calls[0][1] - first >= 0.3
    assert record[0]["fault"] == "restart-edge" and "error" not in record[0]
