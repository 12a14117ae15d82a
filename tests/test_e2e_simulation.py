"""`flwr run .` local simulation (Ray) through hybridfl/launch/simulate.py, with a temporary FLWR_HOME."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import digest, flower_threads, rows, simulated

from hybridfl.cli import main as cli
from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch import flwr_cli, processes, simulate
from hybridfl.launch.processes import process_tree
from server_app.checkpoint import CHECKPOINT
from tools.probes import alive

JOB = {"dataset": "synthetic", "num-clients": 3, "clients-per-round": 3, "num-rounds": 2, "local-epochs": 1,
       "batch-size": 16}
ASYNC_JOB = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 6, "local-epochs": 1,
             "batch-size": 16, "strategy": "fedbuff", "buffer-size": 2, "delay-sigma": 2.0}


def command_lines(pids: set[int]) -> dict[int, str]:
    """pid -> full command line (from /proc: `ps` may cut long ones to the terminal's width)."""
    lines = {}
    for pid in pids:
        try:
            lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return lines


def events(out) -> list[tuple]:
    return [(e["client"], e["base-version"], e["dispatch-round"], e["round"], e["outcome"])
            for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())]


@pytest.mark.e2e
def test_fedmerge_under_flwr_run_sends_each_client_its_own_model(tmp_path):
    """Personalised evaluation under `flwr run`: every client's loss on its own test split matches the in-process
    run's, where tests/test_fedmerge.py checks each is its own merge softmax(A_i)·Θ; the merges differ."""
    job = {**JOB, "num-clients": 4, "clients-per-round": 4, "num-rounds": 3, "strategy": "fedmerge",
           "global-models": 3, "partitioner": "clusters", "num-clusters": 2, "client-test-fraction": 0.25,
           "client-validation-fraction": 0.1}
    with flower_threads():
        sim = simulated({**job, "output-dir": str(tmp_path), "run-name": "sim"}, tmp_path / "flwr-home")
        ref = run_inprocess({**job, "output-dir": str(tmp_path), "run-name": "ref"})
    last = [json.loads((out / "clients.jsonl").read_text().splitlines()[-1]) for out in (sim, ref)]
    assert last[0]["round"] == last[1]["round"] == 3 and last[0]["clients"] == [0, 1, 2, 3]
    assert max(abs(a - b) for a, b in zip(last[0]["eval-loss"], last[1]["eval-loss"])) < 1e-3
    weights = torch.tensor(last[0]["merge-weights"])
    assert torch.allclose(weights, torch.tensor(last[1]["merge-weights"]), atol=1e-4)
    assert float((weights - weights.mean(0)).abs().max()) > 1e-3  # the clients' merges are not all the same


@pytest.mark.e2e
def test_serverapp_killed_under_flwr_run_resumes_to_the_model_of_an_uninterrupted_run(tmp_path):
    """`flwr run` of an asynchronous job: the ServerApp's process (flwr-simulation) is SIGKILLed after a checkpoint,
    and the rest of the server machine with it (SuperLink, SuperExec, Ray). A new `flwr run` with resume=<run
    folder> ends with the very model of an uninterrupted run (in-process, torch on one thread like Ray's workers):
    the first run's -c overrides reached its ServerApp, and the virtual clock decides the event sequence from the
    seed alone, whatever order Ray's workers physically answer in, so the run is the in-process one event for
    event."""
    # 24 rounds, killed after the second checkpoint: on a loaded machine the watcher may lag the run by
    # many rounds, and it must still find the ServerApp running.
    job = {**ASYNC_JOB, "num-rounds": 24, "checkpoint-every": 2, "output-dir": str(tmp_path), "run-name": "killed"}
    out, killed = tmp_path / "killed", []

    def kill_the_server_after_a_checkpoint() -> None:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 600
        while time.monotonic() < deadline:
            # step 5's line: step 4's checkpoint is complete (a step's metrics line comes before its checkpoint)
            if (out / CHECKPOINT).exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 6:
                tree = {p.pid for p in process_tree([os.getpid()])} - {os.getpid()}
                serverapp = [pid for pid, args in command_lines(tree).items() if "flwr-simulation" in args]
                for pid in [*serverapp, *sorted(tree - set(serverapp))]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed.append((serverapp, tree))
                return
            time.sleep(0.05)

    threading.Thread(target=kill_the_server_after_a_checkpoint, daemon=True).start()
    with pytest.raises(RuntimeError), flower_threads():
        simulated(job, tmp_path / "flwr-home")
    assert killed, "no checkpoint was written"
    assert killed[0][0], f"no flwr-simulation process among {command_lines(killed[0][1])}"
    time.sleep(1)
    assert not alive(killed[0][1]), "a process of the killed run survived"
    assert not (out / "summary.json").exists()
    with flower_threads():
        resumed = simulated({"resume": str(out)}, tmp_path / "flwr-home")
        ref = run_inprocess({**job, "run-name": "ref"})
    summary, want = (json.loads((run / "summary.json").read_text()) for run in (resumed, ref))
    assert summary["resumed-after-round"] >= 4 and summary["final-version"] > 0
    assert summary["config"]["num-clients"] == 4 and summary["config"]["dataset"] == "synthetic"  # not the preset's
    count = lambda s: (s["final-version"], s["total-accepted"], s["total-failures"], s["client-eval"]["replies"])
    assert count(summary) == count(want) and summary["total-failures"] == 0 and summary["client-eval"]["replies"] == 4
    assert digest(resumed / "model.pt") == digest(ref / "model.pt")
    assert rows(resumed, "events.jsonl") == rows(ref, "events.jsonl")
    assert len(rows(ref, "events.jsonl")) >= 8 and any(e["staleness"] > 0 for e in rows(ref, "events.jsonl"))
    same = lambda r: {k: v for k, v in r.items() if not k.startswith("test-")}
    assert [same(r) for r in rows(resumed)] == [same(r) for r in rows(ref)]


def test_bad_config_fails_before_starting_anything(tmp_path, capsys):
    rc = cli(["run", "--mode", "simulation", "num-rounds=0", "--flwr-home", str(tmp_path / "home")])
    assert rc == 2
    assert "config key 'num-rounds' = 0" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()


FAKE_FLWR = """#!{python}
# `flwr` as a simulation whose Ray does not start answers: `run` streams Ray's error for the first {fails} runs,
# then completes its run (a summary in its folder); `ls` gives the run's status
import json, re, sys
from pathlib import Path

count = Path({count!r})
if sys.argv[1] == "run":
    n = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(n))
    config = sys.argv[sys.argv.index("--run-config") + 1]
    run = Path(re.search(r'output-dir="([^"]+)"', config)[1]) / re.search(r'run-name="([^"]+)"', config)[1]
    (run / "metrics.jsonl").write_text(f"attempt {{n}}\\n")
    print(f"Successfully started run {{10 + n}}")
    if n <= {fails}:
        print("ERROR :     An exception occured!! The current node timed out during startup. This could happen ...")
    else:
        (run / "summary.json").write_text("{{}}")
else:
    n = int(sys.argv[sys.argv.index("--run-id") + 1]) - 10
    print(json.dumps({{"runs": [{{"status": "finished:failed" if n <= {fails} else "finished:completed"}}]}}))
"""


@pytest.fixture
def no_superlink(monkeypatch):
    """simulate() with a sleeping process where its SuperLink would be: the fake `flwr` or `flwr_run` below never
    reaches one, and a real one is seconds of CPU per start."""
    class Sleepers(processes.ProcessGroup):
        def start(self, name, cmd, env=None, cwd=None):
            return super().start(name, ["sleep", "600"], env, cwd)

    monkeypatch.setattr(simulate, "ProcessGroup", Sleepers)
    monkeypatch.setattr(simulate, "wait_healthy", lambda *args, **kwargs: None)


@pytest.mark.parametrize("fails", [2, 3])
def test_a_run_whose_ray_did_not_start_runs_once_more_in_a_fresh_folder(tmp_path, monkeypatch, capsys, fails,
                                                                         no_superlink):
    """Ray's raylet has a fixed 30 s to start; on a busy machine the run fails before any client ran, and says so in
    the run's stream. simulate() then moves the attempt's folder aside and, after a pause, starts the run once more
    (a fake `flwr` streaming Ray's error each time), up to RAY_START_ATTEMPTS starts: the last
    start's outcome is the run's."""
    flwr = tmp_path / "bin" / "flwr"
    flwr.parent.mkdir()
    flwr.write_text(FAKE_FLWR.format(python=sys.executable, count=str(tmp_path / "runs"), fails=fails))
    flwr.chmod(0o755)
    monkeypatch.setattr(simulate, "flwr_run", functools.partial(flwr_cli.flwr_run, flwr=lambda _: [str(flwr)]))
    pauses: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # the retries' pauses recorded, any other wait kept
        if seconds >= simulate.RAY_RETRY_PAUSE_S:
            pauses.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(simulate.time, "sleep", sleep)
    job = {**JOB, "output-dir": str(tmp_path / "out"), "run-name": "r"}
    run = tmp_path / "out" / "r"
    aside = tmp_path / "out" / "r-ray-did-not-start"
    if fails < simulate.RAY_START_ATTEMPTS:
        assert simulate.simulate(job, tmp_path / "home") == run
        assert (run / "metrics.jsonl").read_text() == "attempt 3\n" and not simulate.ray_did_not_start(run)
    else:
        with pytest.raises(RuntimeError, match="run 13 ended as 'finished:failed'"):
            simulate.simulate(job, tmp_path / "home")
    assert (tmp_path / "runs").read_text() == "3"
    assert pauses == [simulate.RAY_RETRY_PAUSE_S, 2 * simulate.RAY_RETRY_PAUSE_S]
    assert (aside / "metrics.jsonl").read_text() == "attempt 1\n" and simulate.ray_did_not_start(aside)
    assert (aside.with_name(aside.name + "-2") / "metrics.jsonl").read_text() == "attempt 2\n"
    assert "timed out during startup" in (aside / "flower-logs" / simulate.STREAM_LOG).read_text()
    err = capsys.readouterr().err
    assert f"its folder is now {aside}" in err and "(attempt 3 of 3)" in err


def test_a_run_that_failed_for_another_reason_is_not_started_again(tmp_path, monkeypatch, no_superlink):
    """Only Ray's failure to start is retried: any other failure is the run's outcome, at once."""
    calls: list[Path] = []

    def always_failed(env, connection, overrides, federation_config=None, app_dir=None, log=None):
        calls.append(Path(overrides["output-dir"]) / overrides["run-name"])
        log.write_text("ValueError: a failure of the run itself\n")
        return 13, "finished:failed"

    monkeypatch.setattr(simulate, "flwr_run", always_failed)
    with pytest.raises(RuntimeError, match="run 13 ended as 'finished:failed'"):
        simulate.simulate({**JOB, "output-dir": str(tmp_path / "out"), "run-name": "s"}, tmp_path / "home")
    assert calls == [tmp_path / "out" / "s"] and not (tmp_path / "out" / "s-ray-did-not-start").exists()
