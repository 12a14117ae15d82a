"""Local deployment end to end: a SuperLink and two SuperNodes as real processes, a 2-round run, clean stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from helpers import DITTO_TWO_NODES, flower_threads, personal_accuracies

from hybridfl.cli import main
from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch import processes
from hybridfl.launch.deploy_local import deploy
from hybridfl.launch.pki import node_key
from hybridfl.launch.processes import free_port
from tools.probes import acquire_task_anonymously, device_timings


def running(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process, according to ``ps``."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


@pytest.mark.e2e
def test_local_deployment_with_tls_and_auth_runs_keeps_node_state_refuses_intruders_and_stops(tmp_path: Path) -> None:
    """TLS and node authentication (the launcher's default): the two registered SuperNodes train, and each keeps
    its own state from round to round (Ditto's personal models: the accuracies are the in-process run's); a
    SuperNode with its own unregistered key
    and a plain-HTTP one are refused by the SuperLink (their own exit and the SuperLink's reason are asserted).
    The wire's codecs too (issue 70): updates as topk16 with error feedback, models as topk differences (the first
    message a whole model as int8); each node's residual and model carried from its first message to its second
    across Flower's process per message, as the in-process run does (a difference applies only to the model the
    first message left: else the second fails).
    One deployment for these claims: each costs a SuperLink, SuperNodes and a process per message."""
    overrides = {**DITTO_TWO_NODES, "output-dir": str(tmp_path / "out"), "run-name": "e2e", "update-codec": "topk16",
                 "model-codec": "topk", "model-difference": True}
    home = tmp_path / "flwr-home"
    refused: dict[str, tuple[int | None, str]] = {}
    runtime: dict[str, httpx.Response | None] = {}

    def start_intruders(procs, run_path: Path) -> None:
        link = next(p for name, p in procs.procs if name == "superlink")
        port = int(link.args[link.args.index("--port") + 1])
        with pytest.raises(httpx.RemoteProtocolError):  # HTTPS only: a plain-HTTP request gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        base = ["flower-supernode", "--superlink", f"127.0.0.1:{port}", "--max-retries", "1"]
        intruders = {
            "unregistered": procs.start("unregistered", base + [
                "--root-certificates", str(home / "pki" / "ca.crt"),
                "--auth-supernode-private-key", str(node_key(tmp_path, "unregistered")), "--port", str(free_port())]),
            "plain-http": procs.start("plain-http", base + ["--insecure", "--port", str(free_port())])}
        for name, proc in intruders.items():
            proc.wait(timeout=120)
            refused[name] = (proc.returncode, (run_path / "flower-logs" / f"{name}.log").read_text())
        # a process without the Runtime APIs' secrets asks for the ServerApp's and a node's ClientApp's tasks
        node = next(p for name, p in procs.procs if name == "supernode-0")
        runtime[f"127.0.0.1:{port}"] = acquire_task_anonymously(f"127.0.0.1:{port}", home / "pki" / "ca.crt")
        node_api = f"127.0.0.1:{node.args[node.args.index('--port') + 1]}"
        runtime[node_api] = acquire_task_anonymously(node_api)

    with flower_threads():  # the nodes' processes and the reference compute alike
        run_path, pids = deploy(overrides, home, supernodes=2, on_started=start_intruders,
                                node_config=f'cache-dir="{tmp_path / "cache"}"')
        ref = run_inprocess({**overrides, "run-name": "ref"})

    assert run_path == tmp_path / "out" / "e2e"
    assert personal_accuracies(run_path) == pytest.approx(personal_accuracies(ref), abs=1e-6)
    summary = json.loads((run_path / "summary.json").read_text())
    assert summary["final-version"] == 2
    assert summary["total-accepted"] == 4
    assert summary["client-eval"]["replies"] == 2
    rounds = [json.loads(line)["round"] for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2]
    # Flower's SuperExec authentication refused both, and the SuperExecs that hold the secrets ran the run
    assert len(runtime) == 2 and all(r is not None and r.status_code == 401 and "Authentication failed" in r.text
                                     for r in runtime.values()), {a: r and (r.status_code, r.text) for a, r in
                                                                  runtime.items()}
    code, log = refused["unregistered"]
    assert code != 0 and "Failed to activate SuperNode" in log
    assert "No SuperNode found with the given public key" in (run_path / "flower-logs" / "superlink.log").read_text()
    code, log = refused["plain-http"]
    # The reason line varies with timing (a closed or a reset connection); Flower's exit code 305 does not.
    assert code != 0 and "Exit Code: 305" in log and "could not establish a connection to the SuperLink" in log
    # One ClientApp process per message: each logs where its time went, and each node's partition was built
    # once for the run and kept in its cache-dir (client_app/node_cache.py).
    for i in range(2):
        lines = device_timings([run_path / "flower-logs" / f"superexec-clientapp-{i}.log"])
        assert [d["message"] for d in lines].count("train") == 2
        assert all(d["flower-s"] > 0 and d["import-s"] > 0 for d in lines)  # a fresh process every time
    assert len(list((tmp_path / "cache").glob("run-*/partition-[01]-*.npz"))) == 2
    # topk16: each node kept its residual in its cache folder; what the devices sent is what the run counted (4 bytes
    # an entry, 1 % of float32 at topk-fraction 0.01) and Flower's framing
    assert len(list((tmp_path / "cache").glob("run-*/residual-[01].npy"))) == 2
    assert len(list((tmp_path / "cache").glob("run-*/model-[01].npy"))) == 2
    # round 2's models went as differences (2 % of float32 against int8's 25 %), as in the in-process run
    down = [[json.loads(line)["bytes-down"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (run_path, ref)]
    assert down[0] == down[1] and 0 < down[0][2] < down[0][1] / 10, down
    counted, pulled = summary["bytes-up-per-update"], summary["pulled-bytes-per-reply"]
    assert counted < pulled < 1.1 * counted + 4096, (counted, pulled)
    # each Flower process had a FLWR_HOME of its own; the operator's holds the CLI's connection and the PKI only
    homes = {p.name: p for p in (home / "processes").iterdir()}
    assert set(homes) == {"superlink", "superexec-serverapp", "supernode-0", "supernode-1", "superexec-clientapp-0",
                          "superexec-clientapp-1", "unregistered", "plain-http"}
    assert all(any((homes[name] / "apps").iterdir()) for name in ("superexec-serverapp", "superexec-clientapp-0",
                                                                  "superexec-clientapp-1"))
    assert not (home / "apps").exists()
    # superlink + 2 supernodes + their 3 SuperExecs + 2 intruders, and the app processes the SuperExecs start
    assert len(pids) >= 10
    assert [pid for pid in pids if running(pid)] == []


def test_deployment_flags_are_checked_before_starting_anything(tmp_path: Path, capsys) -> None:
    assert main(["run", "--flwr-home", str(tmp_path / "flwr-home"), "--plain-http"]) == 2  # in-process: no HTTP
    assert "'--mode' = 'in-process'" in capsys.readouterr().err
    assert main(["run", "--mode", "deployment", "--flwr-home", str(tmp_path / "flwr-home"), "--latency", "x"]) == 2
    assert "I=SECONDS" in capsys.readouterr().err
    assert not (tmp_path / "flwr-home").exists()


def test_free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """Outgoing connections take their source ports from the kernel's ephemeral range (where binding port 0 picks
    too): a port chosen there can be taken before the server that was meant to listen on it starts. Nor is one a
    port a compose fleet's link shaper takes on the host (300 picks would hit those 1000 almost surely)."""
    ports = [processes.free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    assert not set(ports) & set(processes._ephemeral_ports()) and min(ports) >= 10000
    assert not set(ports) & set(processes.SHAPER_PORTS)


def test_bad_config_exits_2_before_starting_anything(tmp_path: Path) -> None:
    assert main(["run", "--mode", "deployment", "--flwr-home", str(tmp_path / "flwr-home"), "num-rounds=0"]) == 2
    assert not (tmp_path / "flwr-home").exists()


@pytest.mark.e2e
def test_async_deployment_survives_a_slow_and_a_lost_supernode(tmp_path: Path) -> None:
    """Wall clock on 3 real SuperNodes for 30 s of steps: node 2 is slowed by 10 s per update, node 1 is killed
    after the first step. The run finishes; the fast node contributes more updates than the slow one, which
    contributes. A time budget, not a count of steps: 5 steps took 8 s on a quiet machine, before the slow node's
    first reply (the 60 s reply timeout leaves it room on a loaded 2-core machine, where 30 s timed all its updates
    out)."""
    overrides = {"num-clients": 3, "clients-per-round": 3, "num-rounds": 10_000, "time-budget-s": 30.0,
                 "dataset": "digits", "strategy": "fedasync", "clock": "wall", "concurrency": 3,
                 "reply-timeout-s": 60.0,
                 "local-epochs": 1, "cnn-width": 8,  # light work: the nodes' speeds differ by the 10 s alone
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

    # plain HTTP: asynchrony is the point here (the first test has the default, TLS and node authentication), and it
    # spares CI three `flwr supernode register` processes
    run_path, _ = deploy(overrides, tmp_path / "flwr-home", supernodes=3, latency={2: 10.0},
                         on_started=kill_node_1_after_first_step, plain_http=True)
    assert killed_at, "the SuperNode was never killed"
    summary = json.loads((run_path / "summary.json").read_text())
    events = [json.loads(line) for line in (run_path / "events.jsonl").read_text().splitlines()]
    accepted = Counter(e["client"] for e in events if e["outcome"] == "accepted")
    assert accepted[0] > accepted[2] >= 1
    assert summary["final-version"] == sum(accepted.values())  # FedAsync: one version per update
    # each arrival refilled its slot at once (the runtime records a reply -> dispatch interval only then), but the
    # last ones of the run; how long that took is the machine's (a median of 0.75 s on CI's starved CPU share)
    assert summary["reply-to-dispatch-s"]["count"] >= len(events) - overrides["concurrency"]


def test_a_launcher_stopped_by_sigterm_stops_the_processes_it_started(tmp_path: Path) -> None:
    """A launcher killed with SIGTERM (a `kill`, a service manager, a CI timeout) unwinds as after Ctrl-C: the
    processes its ProcessGroup started are stopped, not left running with nobody to stop them; it exits 143."""
    script = ("import sys, time\nfrom pathlib import Path\nfrom hybridfl.launch.processes import ProcessGroup\n"
              "with ProcessGroup(Path(sys.argv[1]), {}) as procs:\n"
              "    print(procs.start('sleeper', ['sleep', '300']).pid, flush=True)\n    time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parent.parent)
    sleeper = int(launcher.stdout.readline())
    assert running(sleeper)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 143
    deadline = time.monotonic() + 10
    while running(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(sleeper)
