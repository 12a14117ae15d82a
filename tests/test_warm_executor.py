"""The warm ClientApp executor (client_app/warm_executor.py, flower_internals/superexec.py and fork_server.py) and the
paced SuperNode (client_app/supernode.py, flower_internals/supernode.py; what they rely on of Flower:
tests/test_flower_internals.py), and a local deployment on them (TLS, node authentication, the Runtime APIs' secrets)
runs as the in-process engine does, also after its fork server was killed between two runs."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
import torch
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult
from helpers import flower_threads

from client_app import supernode as command
from flower_internals import supernode
from flower_internals.superexec import ORPHAN_GRACE_S, WarmExecutor, fork_server_command
from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.deploy_local import deploy, deploy_runs
from hybridfl.launch.processes import children
from tools.probes import alive, device_timings

EXAMPLE = PROJECT_DIR / "examples" / "tabular"
JOB = {"preset": "fedavg-digits", "num-clients": 2, "clients-per-round": 2, "num-rounds": 2, "eval-every": 2}


def test_a_child_of_the_fork_server_trains_without_importing_anything_more_of_torch():
    """What the fork server imports (PRELOAD) covers what local training imports lazily: torch.optim's first
    optimizer imports torch._dynamo (1.8 s on an idle 2-core machine), once in the fork server instead of in every
    message's child."""
    script = ("import importlib, sys; from flower_internals.superexec import PRELOAD\n"
              "for m in PRELOAD: importlib.import_module(m)\n"
              "import torch; before = set(sys.modules)\n"
              "m = torch.nn.Linear(3, 2); m(torch.ones(1, 3)).sum().backward()\n"
              "for o in (torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.Adam(m.parameters())): o.step()\n"
              "print(sorted(n for n in set(sys.modules) - before if n.startswith('torch')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_paced_supernode_asks_again_soon_after_a_reply_and_then_as_flower_does(monkeypatch):
    """Flower's 3 s idle wait becomes 0.05 s after each reply, doubling back to 3 s; its 0.5 s check for the
    ClientApp's reply becomes 0.02 s; any other wait is left alone. On Flower's own loop module, the pushes reset it."""
    slept: list[float] = []
    monkeypatch.setattr(supernode.time, "sleep", slept.append)
    pacer = supernode.Pacer()
    for seconds in (3, 3, 0.5, 7):  # before any reply: Flower's waits, the reply check paced
        pacer.sleep(seconds)
    pacer.replied()
    for _ in range(8):
        pacer.sleep(3)
    assert slept == [3, 3, 0.02, 7, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3, 3]
    assert pacer.monotonic() > 0  # the rest of `time` is the real module

    loop = importlib.import_module(supernode.LOOP)
    pushed: list[object] = []
    monkeypatch.setattr(loop, "_push_messages", pushed.append)
    monkeypatch.setattr(loop, "time", loop.time)  # undone after the test
    paced = supernode.Pacer()
    supernode.pace(loop, paced)
    assert loop.time is paced
    paced.sleep(3)
    loop._push_messages("replies")
    assert pushed == ["replies"] and paced.next_wait_s == supernode.FIRST_WAIT_S


def test_the_paced_supernode_s_idle_ceiling_is_its_flag_and_the_rest_are_flowers(monkeypatch, capsys):
    """`--idle-wait-s 10`: idle asks every 10 s, after a reply 0.05 s doubling up to 10 s; the flag is taken out of
    flower-supernode's own, which reach it in their order; a bad value exits 2 naming it, before Flower starts."""
    slept: list[float] = []
    monkeypatch.setattr(supernode.time, "sleep", slept.append)
    pacer = supernode.Pacer(idle_wait_s=10.0)
    pacer.sleep(3)
    pacer.replied()
    for _ in range(10):
        pacer.sleep(3)
    assert slept == [10, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10, 10]

    import flwr.supernode.cli

    got: list[tuple[list[str], float]] = []
    monkeypatch.setattr(command, "pace", lambda loop, paced: got.append((list(sys.argv[1:]), paced.idle_wait_s)))
    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", lambda: None)
    monkeypatch.setattr(sys, "argv", ["supernode", "--superlink", "127.0.0.1:1", "--idle-wait-s", "10",
                                      "--insecure", "--node-config", "partition-id=0"])
    command.main()
    assert got == [(["--superlink", "127.0.0.1:1", "--insecure", "--node-config", "partition-id=0"], 10.0)]
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setattr(sys, "argv", ["supernode", "--idle-wait-s", bad])
        with pytest.raises(SystemExit) as done:
            command.main()
        assert done.value.code == 2 and len(got) == 1 and "--idle-wait-s" in capsys.readouterr().err


def test_the_paced_supernode_s_heartbeat_is_its_flag_in_flower_s_own_connection(monkeypatch, capsys):
    """`--heartbeat-s 120`: Flower's own HTTPS connection (a fake transport under it) declares 120 s when it activates
    its node and in every heartbeat, and its sender waits 0.7-0.9 × (120 − 5) s between beats (Flower's formula on
    30 s: 17.5-22.5 s); the flag is taken out of flower-supernode's; outside what the SuperLink accepts it exits 2."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.proto.fleet_pb2 import ActivateNodeResponse
    from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatResponse
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    for name in supernode.HEARTBEAT_MODULES:  # monkeypatch puts Flower's 30 s back after the test
        module = importlib.import_module(name)
        monkeypatch.setattr(module, supernode.HEARTBEAT_NAME, getattr(module, supernode.HEARTBEAT_NAME))
    sent, waits, beat = [], [], threading.Event()

    class Transport:
        @classmethod
        def from_server_address(cls, *_, **__):
            return contextlib.nullcontext(cls())

        def ActivateNode(self, request):
            sent.append(("activate", request.heartbeat_interval))
            return ActivateNodeResponse(node_id=7)

        def SendNodeHeartbeat(self, request):
            sent.append(("heartbeat", request.heartbeat_interval))
            beat.set()
            return SendNodeHeartbeatResponse(success=True)

        def DeactivateNode(self, request):
            sent.append(("deactivate", request.node_id))

    class Stop(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)  # until the connection ends and stops the sender

    class Sender(heartbeat.HeartbeatSender):
        def __init__(self, fn):
            super().__init__(fn)
            self._stop_event = Stop()

    monkeypatch.setattr(fleet_http_connection, "FleetHttpClient", Transport)
    monkeypatch.setattr(fleet_http_connection, "HeartbeatSender", Sender)
    got: list[list[str]] = []
    monkeypatch.setattr(command, "pace", lambda loop, paced: got.append(list(sys.argv[1:])))
    import flwr.supernode.cli

    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", lambda: None)
    monkeypatch.setattr(sys, "argv", ["supernode", "--heartbeat-s", "120", "--superlink", "127.0.0.1:1"])
    command.main()
    assert got == [["--superlink", "127.0.0.1:1"]]
    private = ec.generate_private_key(ec.SECP384R1())
    with fleet_http_connection.http_request_response("127.0.0.1:1", True, None,
                                                     authentication_keys=(private, private.public_key())) as conn:
        assert conn[0] == 7 and beat.wait(10)
        deadline = time.monotonic() + 10
        while not waits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sent == [("activate", 120), ("heartbeat", 120), ("deactivate", 7)]
    assert len(waits) == 1 and 0.7 * 115 <= waits[0] <= 0.9 * 115
    for bad in ("9", "1801", "nan", "soon"):
        monkeypatch.setattr(sys, "argv", ["supernode", "--heartbeat-s", bad])
        with pytest.raises(SystemExit) as done:
            command.main()
        assert done.value.code == 2 and len(got) == 1 and "--heartbeat-s" in capsys.readouterr().err


def test_the_paced_supernode_refuses_a_loop_it_was_not_written_for():
    """A Flower whose SuperNode loop no longer has the waits: a clear error naming what moved, not a silent no-op."""
    fake = types.ModuleType("flwr.supernode.start_client_internal")
    source = "import time\ndef _push_messages(): pass\ndef loop():\n    time.sleep(5)\n"
    exec(compile(source, "<fake>", "exec"), fake.__dict__)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inspect, "getsource", lambda module: source)
        with pytest.raises(RuntimeError, match=r"has no `time.sleep\(3\)`.*flower-supernode instead"):
            supernode.pace(fake, supernode.Pacer())


def test_a_child_ends_when_its_executor_dies_as_flower_s_clientapp_does():
    """An executor killed (SIGKILL) while its child waits on a SuperNode that does not answer: the child, told the
    executor's pid as Flower's `flwr-clientapp` is, ends within ORPHAN_GRACE_S of the executor's end (plus a poll and
    the time a loaded machine takes to schedule it), and the fork server with it; without the executor's pid the
    child retried for over a minute (measured), an orphan."""
    script = ("import os, time\nfrom flwr.supercore.constant import TaskType\n"
              "from flwr.supercore.superexec.executor.types import ExecutionSpec\n"
              "from flower_internals.superexec import WarmExecutor\nex = WarmExecutor()\n"
              "spec = ExecutionSpec(TaskType.CLIENT_APP, '127.0.0.1:1', 'token', True, None, False, os.getpid(), "
              "False, 1)\nprint(ex.launch(spec).status, ex._server.pid, flush=True)\ntime.sleep(300)\n")
    executor = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                cwd=PROJECT_DIR)
    status, server = executor.stdout.readline().split()
    time.sleep(3)
    forks = children({int(server)})
    assert status == "accepted" and len(forks) == 1  # still trying to reach the SuperNode
    executor.kill()
    executor.wait()
    deadline = time.monotonic() + 0.2 + ORPHAN_GRACE_S + 10
    while (left := alive(forks | {int(server)})) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


@contextlib.contextmanager
def fork_server(*modules: str, env: dict[str, str] | None = None):
    """The warm executor's fork server started by hand, importing `modules`: (the server, its task pipe, its reply
    pipe), ready; killed on the way out."""
    task_r, task_w = os.pipe()
    reply_r, reply_w = os.pipe()
    with __import__("tempfile").TemporaryDirectory() as marks:
        server = subprocess.Popen(fork_server_command(task_r, reply_w, marks, modules), pass_fds=(task_r, reply_w),
                                  stderr=subprocess.PIPE, text=True, env=env)
        os.close(task_r)
        os.close(reply_w)
        tasks, replies = os.fdopen(task_w, "w"), os.fdopen(reply_r, "r")
        try:
            assert replies.readline().strip() == "ready"
            yield server, tasks, replies
        finally:
            server.kill()


def test_a_child_whose_flower_exit_hangs_ends_itself_once_its_executor_is_gone(tmp_path):
    """Flower's exit in a child whose executor died can wait on its retries (over 30 s measured under load): a child
    whose ClientApp runtime ignores SIGINT and never returns still ends ORPHAN_GRACE_S after its executor, with a line
    saying why, and not before."""
    (tmp_path / "hung_runtime.py").write_text(
        "import signal, time\nimport flwr.supernode.runtime.run_clientapp as runtime\n\n\n"
        "def hang(**task):\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(600)\n\n\n"
        "runtime.run_clientapp = hang\n")
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with fork_server("hung_runtime", env={**os.environ, "PYTHONPATH": str(tmp_path)}) as (server, tasks, replies):
        print(json.dumps({"root_certificates_path": None, "parent_pid": parent.pid}), file=tasks, flush=True)
        child = int(replies.readline())
        time.sleep(1)
        assert alive({child}) == {child}  # a live executor: the child runs on
        parent.kill()
        parent.wait()
        gone = time.monotonic()
        while alive({child}) and time.monotonic() < gone + 0.2 + ORPHAN_GRACE_S + 10:
            time.sleep(0.1)
        ended = time.monotonic() - gone
        with contextlib.suppress(ProcessLookupError):  # one that did not end would hold the server's stderr open
            os.kill(child, signal.SIGKILL)
        tasks.close()
        server.wait(timeout=60)
        err = server.stderr.read()
    assert ORPHAN_GRACE_S <= ended <= 0.2 + ORPHAN_GRACE_S + 10
    assert f"the executor (pid {parent.pid}) ended" in err and "the ClientApp ends" in err


def test_the_paced_supernode_on_another_loop_ends_with_one_line(tmp_path, monkeypatch):
    """`python -m client_app.supernode` under a Flower whose SuperNode loop moved: exit 1 with one line saying
    what moved and what to run instead, before it connects anywhere."""
    (tmp_path / "moved_loop.py").write_text("import time\n\ndef loop():\n    time.sleep(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(command, "LOOP", "moved_loop")
    with pytest.raises(SystemExit) as done:
        command.main()
    message = str(done.value.code)
    assert message.startswith("error: flwr ") and "moved_loop has no `time.sleep(3)`" in message
    assert "\n" not in message and "run Flower's own flower-supernode instead" in message


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


def test_a_fork_server_that_cannot_start_is_reported_and_flowers_loop_goes_on(monkeypatch, capsys):
    """reconcile() runs in Flower's SuperExec loop, which an exception ends: a fork server that cannot start is
    reported, counted and tried again at the next call."""
    executor = WarmExecutor()

    def broken() -> None:
        raise RuntimeError("the warm executor's fork server did not start (exit 1)")

    monkeypatch.setattr(executor, "_start", broken)
    try:
        executor.reconcile()
        executor.reconcile()
        assert executor.failed_starts == 2
        assert capsys.readouterr().err.count("warm executor: cannot start the fork server (RuntimeError") == 2
        monkeypatch.undo()
        executor.reconcile()
        assert executor._running() and executor.failed_starts == 2
    finally:
        executor.close()


def test_a_task_that_installs_its_apps_dependencies_goes_to_flowers_executor(monkeypatch):
    """A fork holds torch and numpy already: an app whose dependencies Flower installs per run gets a fresh
    `flwr-clientapp` process from Flower's own executor; the fork server is not even started for it."""
    launched: list[ExecutionSpec] = []
    monkeypatch.setattr(SubprocessExecutor, "launch", lambda self, spec: launched.append(spec) or
                        LaunchResult.accepted())
    executor = WarmExecutor()
    spec = ExecutionSpec(TaskType.CLIENT_APP, "127.0.0.1:1", "token", True, None, True, None, False, 1)
    try:
        assert executor.launch(spec).status == "accepted" and launched == [spec] and executor._server is None
    finally:
        executor.close()


def test_a_child_whose_app_raises_prints_its_traceback_in_the_nodes_log():
    """The fork server's child ends with os._exit (never the server's own cleanup): an exception that is not
    Flower's exit is printed first, as `flwr-clientapp` would print it, and the child exits 1."""
    with fork_server() as (server, tasks, replies):
        # run_clientapp(**task) with an argument it does not take: a TypeError inside the child
        print(json.dumps({"root_certificates_path": None, "not_an_argument": 1}), file=tasks, flush=True)
        assert replies.readline().strip().isdigit()
        tasks.close()
        server.wait(timeout=60)
        err = server.stderr.read()
    assert "Traceback (most recent call last)" in err and "TypeError" in err and "not_an_argument" in err


def _fab(folder: Path) -> bytes:
    """A FAB of a two-file app, built by Flower."""
    from flwr.cli.build import build_fab_from_disk

    (folder / "tiny").mkdir(parents=True)
    (folder / "tiny" / "__init__.py").write_text("")
    (folder / "tiny" / "apps.py").write_text("app = None\n")
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "tiny"\nversion = "1.0.0"\ndependencies = []\n'
        '[tool.flwr.app]\npublisher = "hybridfl-tests"\n'
        '[tool.flwr.app.components]\nserverapp = "tiny.apps:app"\nclientapp = "tiny.apps:app"\n'
        '[tool.flwr.app.config]\nkey = 1\n')
    return build_fab_from_disk(folder)


def test_a_fab_install_that_a_killed_child_left_half_done_is_installed_again(tmp_path: Path, monkeypatch):
    """Flower takes an app folder that exists for installed: one left without its pyproject.toml by a child killed
    mid-install failed every later message of that node (seen in CI). The fork server's install puts it back whole,
    and a whole install is used as it is."""
    from flwr.cli.install import install_from_fab

    from flower_internals.fork_server import install_once as once

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    marks = tmp_path / "marks"
    marks.mkdir()
    fab = _fab(tmp_path / "app")
    install_once = once(str(marks), install_from_fab)
    path = install_once(fab, skip_prompt=True)
    assert path.parent == tmp_path / "home" / "apps" and (path / "pyproject.toml").is_file()
    whole = sorted(str(f.relative_to(path)) for f in path.rglob("*"))
    assert "tiny/apps.py" in whole and not list((tmp_path / "home").glob(".install-*"))
    # killed between Flower's moves: the folder is there, its pyproject.toml is not, and no mark
    (path / "pyproject.toml").unlink()
    assert not (install_from_fab(fab, skip_prompt=True) / "pyproject.toml").exists()  # Flower's own: taken as is
    again = install_once(fab, skip_prompt=True)  # the mark of the first install: used as it is
    assert again == path and not (path / "pyproject.toml").exists()
    for mark in marks.iterdir():
        mark.unlink()
    (tmp_path / "home" / ".install-left-by-a-killed-child").mkdir()
    again = install_once(fab, skip_prompt=True)
    assert again == path and sorted(str(f.relative_to(path)) for f in path.rglob("*")) == whole
    assert not list((tmp_path / "home").glob(".install-*"))


def test_close_waits_for_a_fork_server_it_had_to_kill():
    """A fork server that does not end at the end of its input (stopped here) is killed and reaped: no zombie."""
    executor = WarmExecutor()
    executor.reconcile()
    server = executor._server
    server.send_signal(signal.SIGSTOP)
    executor.close()
    assert server.returncode == -signal.SIGKILL


def warm_processes(procs, name: str) -> tuple[set[int], set[int]]:
    """The fork servers of the executors whose process names start with `name`, and their children (one per
    message being handled). A fork server is an executor's own child; its forks share its command line."""
    servers = children({p.pid for n, p in procs.procs if n.startswith(name)})
    return servers, children(servers)


@pytest.mark.e2e
def test_a_message_whose_child_is_killed_is_counted_and_the_node_goes_on(tmp_path: Path):
    """SIGKILL of the child handling node 0's first train message (slowed 15 s so that it is caught mid-message):
    Flower's rule for a dead ClientApp applies: once the task's heartbeat expires (30 s x patience 2) the SuperNode
    answers the message with Flower's error "ClientApp stopped responding"; the server counts it failed, the run
    completes, and node 0's next message is handled as usual."""
    killed: list[int] = []

    def kill_a_child_mid_message(procs, run_path: Path) -> None:
        def watch() -> None:
            deadline = time.monotonic() + 900  # the deployment's start, under CI's load, included
            while time.monotonic() < deadline and not killed:
                _, children = warm_processes(procs, "superexec-clientapp-0")
                for pid in children:
                    # the train message's child: alive 8 s, inside its 15 s. The node's first message (it describes
                    # itself) has a child too, briefly: under load it lived past 2 s, was killed instead, and no
                    # train message failed
                    with contextlib.suppress(psutil.Error, OSError):
                        if time.time() - psutil.Process(pid).create_time() >= 8.0:
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()

    job = {**JOB, "reply-timeout-s": 300, "output-dir": str(tmp_path / "out"), "run-name": "killed"}
    run, _ = deploy(job, tmp_path / "home", latency={0: 15.0}, executor="warm", on_started=kill_a_child_mid_message)
    assert killed
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["outcome"] != "accepted"]
    assert [(e["round"], e["client"], e["outcome"]) for e in lost] == [(1, 0, "failure")], lost
    assert "ClientApp stopped responding" in lost[0]["reason"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["total-accepted"] == 3 and summary["final-version"] == 2


@pytest.mark.e2e
def test_a_warm_deployment_runs_as_in_process_and_survives_its_fork_server_s_death(tmp_path: Path, monkeypatch):
    """TLS, node authentication, the secrets; two runs of different apps back to back on the same SuperNodes (this
    project, then the example project with its own package), the fork servers killed (SIGKILL) once the first has
    finished: the second completes too, on its own app with the user's package and the preset of its own config
    table (Feddle-ID). The first run's events and model are the in-process run's (one torch thread on both sides),
    and the nodes' train messages paid no interpreter start."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    runs = [{**JOB, "output-dir": str(tmp_path / "out"), "run-name": "first"},
            {"num-clients": 2, "clients-per-round": 2, "num-rounds": 2, "output-dir": str(tmp_path / "out"),
             "run-name": "second"}]  # its app declares only these keys (and preset, left to its own table)
    killed: list[int] = []

    def kill_fork_servers_after_the_first_run(procs, run_path: Path) -> None:
        def watch() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not (run_path / "summary.json").exists():
                time.sleep(0.2)
            servers, _ = warm_processes(procs, "superexec-clientapp")
            for pid in servers:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        threading.Thread(target=watch, daemon=True).start()

    with flower_threads():
        (first, second), _ = deploy_runs(runs, tmp_path / "home", executor="warm",
                                         on_started=kill_fork_servers_after_the_first_run,
                                         app_dir=[None, EXAMPLE])
        ref = run_inprocess({**runs[0], "run-name": "ref"})
    assert len(killed) == 2, "both nodes' fork servers were killed between the runs"
    summaries = [json.loads((run / "summary.json").read_text()) for run in (first, second)]
    assert summaries[0]["total-accepted"] == 4 and summaries[1]["total-accepted"] > 0  # the second: virtual delays
    assert [s["total-failures"] for s in summaries] == [0, 0]
    assert summaries[1]["config"]["model"] == "tabular_task.task:mlp" and summaries[1]["config"]["strategy"] == "feddle"
    events = lambda out: [(e["client"], e["round"], e["outcome"]) for e in
                          map(json.loads, (out / "events.jsonl").read_text().splitlines())]
    assert events(first) == events(ref)
    a, b = torch.load(first / "model.pt"), torch.load(ref / "model.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    logs = sorted((first / "flower-logs").glob("superexec-clientapp-*.log"))
    trains = [d for d in device_timings(logs) if d["message"] == "train"]
    assert len(trains) >= 5  # both runs' messages: the logs are the nodes'
    assert all(d["torch-preloaded"] for d in trains), trains  # torch came imported, from the fork server
    assert "starting another" in "".join(p.read_text() for p in logs)


def test_a_superexecs_task_poll_asks_a_5xx_again_and_slows_down_once_idle(monkeypatch) -> None:
    """flower_internals.superexec.task_poll. Patient: Flower's `AcquireTask` answered 500 twice, then a task: the
    task, after waits of 0.5 and 1 s; a 401 is raised at once; 500s past the patience are raised. Paced (Flower's
    interval 0.2 s, on a fake clock): no wait of its own within `idle_after_s` of the last task, then 0.8 s more
    before each ask (a 1 s period), until a task comes. Installed twice, it wraps once."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskResponse
    from flwr.proto.task_pb2 import Task
    from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient

    from flower_internals import superexec as module

    def answered(code: int) -> httpx.HTTPStatusError:
        request = httpx.Request("POST", "https://127.0.0.1/v1/runtime/acquire-task")
        return httpx.HTTPStatusError("no", request=request, response=httpx.Response(code, request=request))

    task, none = AcquireTaskResponse(task=Task(task_id=7), token="t"), AcquireTaskResponse()
    script: list = []
    now = [0.0]

    def acquire(self, request):
        reply = script.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    waits: list[float] = []
    monkeypatch.setattr(RuntimeHttpClient, "AcquireTask", acquire)  # restored after the test, wrapper and all
    monkeypatch.setattr(module.time, "sleep", sleep)
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")
    module.task_poll(patience_s=5.0, idle_after_s=10.0, idle_poll_s=1.0)
    module.task_poll(patience_s=5.0, idle_after_s=10.0, idle_poll_s=1.0)
    client = object.__new__(RuntimeHttpClient)
    script[:] = [answered(500), answered(503), task]
    assert client.AcquireTask("req") is task and waits == [0.5, 1.0]
    script[:], waits[:] = [answered(401)], []
    with pytest.raises(httpx.HTTPStatusError):
        client.AcquireTask("req")
    assert waits == []
    script[:] = [answered(500)] * 10
    with pytest.raises(httpx.HTTPStatusError):
        client.AcquireTask("req")
    assert waits == [0.5, 1.0, 2.0, 4.0] and len(script) == 5  # 7.5 s waited >= 5: the fifth 500 is raised

    now[0], waits[:] = 100.0, []
    script[:] = [task, none, none, none, task, none]
    for seconds in (0, 9.9, 0.2, 0.2, 0, 0):  # Flower's loop sleeping between asks, the idle time passing
        now[0] += seconds
        client.AcquireTask("req")
    # idle since the last task (at 1.5 s): 0.8 s more, the task; 9.9 s after it no wait; 10.1, 11.1 and 12.1 s after
    # it 0.8 s more each, the last bringing a task; the next ask, busy again, none
    assert waits == pytest.approx([0.8] * 4)
