"""hybridfl on a real Ray cluster of two nodes on this machine: a head and a worker raylet on 127.0.0.1 in a network
namespace with loopback only (tests/ray_nodes.py; stopped by PID; no mocks). A simulation joins the cluster instead of
starting a Ray of its own, its clients run on both nodes, and its model is the local simulation's. A sweep places
its runs on both nodes as Ray tasks and survives the worker node's death."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from helpers import digest

from hybridfl.cli import main as cli
from server_app.checkpoint import CHECKPOINT, read_checkpoint

HYBRIDFL = str(Path(sys.executable).parent / "hybridfl")
# four clients on two rounds of FedAvg: each node's client actor trains more than once; CI's two cores run this beside
# the rest of the suite and the Docker engine test, where Ray's workers start slowly: the nodes get 5 minutes to answer
JOB = ["dataset=synthetic", "num-clients=4", "clients-per-round=4", "num-rounds=2", "local-epochs=1", "batch-size=16",
       "wait-nodes-s=300"]
# one two-node cluster at a time (`make test` distributes by --dist loadgroup): each is a dozen Ray processes, on CI's
# two cores beside the rest of the suite
ONE_CLUSTER = pytest.mark.xdist_group("ray-cluster")


class Nodes:
    """tests/ray_nodes.py's two-node cluster, run in a network namespace of its own with loopback only (`unshare
    -n`): Ray replaces 127.0.0.1 in an address by the machine's interface address (ray-project/ray#59110) outside
    one, which no test may use. Commands that join the cluster run in that namespace (`argv`); the cluster's
    processes are stopped by their PIDs, every process left in the namespace with them."""

    def __init__(self, folder: Path) -> None:
        probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True) if os.geteuid() == 0 else None
        if probe is None or probe.returncode:  # not root, or a container without CAP_SYS_ADMIN (Docker's seccomp)
            pytest.skip("a network namespace of the cluster's own (unshare -n, nsenter) needs root and the right to "
                        f"make one: {probe.stderr.strip() if probe else 'not root'}")
        self.stderr = folder / "ray-nodes.log"
        host = [sys.executable, str(Path(__file__).with_name("ray_nodes.py"))]
        with self.stderr.open("w") as log:
            self.process = subprocess.Popen(["unshare", "-n", *host], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, text=True, start_new_session=True)
        try:
            started = self._answer("the cluster's address", 300)
            info = json.loads(started)
        except BaseException:
            self.namespace = self._namespace()  # whatever it started in there is stopped too
            self.close()
            raise
        self.namespace = self._namespace()
        self.address: str = info["address"]
        self.node_ids: set[str] = set(info["nodes"])
        self.logs = Path(info["logs"])

    def _namespace(self) -> str:
        """tests/ray_nodes.py's network namespace once it is in its own ("" before that, or once it has ended): never
        this process's, whose processes :meth:`close` must not kill."""
        with contextlib.suppress(OSError):
            theirs = os.readlink(f"/proc/{self.process.pid}/ns/net")
            if theirs != os.readlink("/proc/self/ns/net"):
                return theirs
        return ""

    def _answer(self, what: str, timeout_s: float) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        assert line, f"tests/ray_nodes.py gave no {what} in {timeout_s:.0f} s:\n" + self.stderr.read_text()[-3000:]
        return line

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run in the cluster's network namespace."""
        return ["nsenter", f"--net=/proc/{self.process.pid}/ns/net", "--", *argv]

    def kill_worker(self) -> None:
        """The worker node's processes killed (SIGKILL), as a crash would."""
        assert self.process.stdin is not None
        self.process.stdin.write("kill-worker\n")
        self.process.stdin.flush()
        assert self._answer("answer to kill-worker", 120).strip() == "killed"

    def log(self) -> str:
        """The warnings and errors of the cluster's raylets and GCS, the last 20 of each log: why a task or an actor
        did not start (a worker that did not register, a node out of memory), for a failing test's message."""
        lines = []
        for log in sorted([*self.logs.glob("raylet*.out"), *self.logs.glob("gcs_server*.out")]):
            found = [line for line in log.read_text(errors="replace").splitlines() if re.match(r"\[[^]]* [WE] ", line)]
            lines += [f"--- {log.name}", *found[-20:]]
        return "\n".join(["", "Ray's own log:", *lines])

    def close(self) -> None:
        """The cluster shut down (end of tests/ray_nodes.py's input), then every process still in its namespace
        killed by PID."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for pid in ([int(p) for p in os.listdir("/proc") if p.isdigit()] if self.namespace else []):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/net") == self.namespace:
                    os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


# Ray gives a node's raylet a fixed 30 s to register with the GCS (ray/_private/node.py): at the suite's start in CI,
# beside the engine test's main job at 8 times the suite's CPU weight, the worker node once took longer. The cluster is
# then started again, as a simulation's Ray is (hybridfl/launch/simulate.py)
START_TRIES = 3


def _started(make: Callable[[], Nodes], tries: int = START_TRIES) -> Nodes:
    """`make()`'s cluster, made again, up to `tries` times in all, while Ray's node startup times out."""
    for _ in range(tries - 1):
        try:
            return make()
        except AssertionError as err:  # Nodes stopped what it had started; its error holds tests/ray_nodes.py's log
            if "timed out during startup" not in str(err):
                raise
    return make()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """One cluster for the module's tests (one worker runs them all: ONE_CLUSTER), started once: each start is a
    dozen Ray processes' worth of CPU on CI's two cores. The test that kills its worker node comes last in the file."""
    nodes = _started(lambda: Nodes(tmp_path_factory.mktemp("ray-nodes")))
    try:
        yield nodes
    finally:
        nodes.close()


def _hybridfl(args: list[str], folder: Path, env: dict[str, str] | None = None,
              nodes: Nodes | None = None) -> subprocess.CompletedProcess:
    """The command as a user runs it, from `folder` (in `nodes`' namespace where given), without a RAY_ADDRESS of
    this machine's unless `env` says."""
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"FLWR_TELEMETRY_ENABLED": "0"}
    argv = [HYBRIDFL, *args]
    return subprocess.run(nodes.argv(argv) if nodes else argv, cwd=folder, env=base | (env or {}),
                          capture_output=True, text=True, timeout=600)


@ONE_CLUSTER
@pytest.mark.e2e
def test_a_simulation_on_a_two_node_cluster_trains_on_both_nodes_and_ends_at_the_in_process_model(
        tmp_path: Path, two_nodes) -> None:
    on_cluster = _hybridfl(["run", *JOB, "run-name=cluster", "--mode", "simulation", "--ray", two_nodes.address],
                           tmp_path, nodes=two_nodes)
    assert on_cluster.returncode == 0, on_cluster.stdout[-3000:] + on_cluster.stderr[-3000:] + two_nodes.log()
    run = tmp_path / "outputs" / "cluster"
    logs = on_cluster.stdout + "".join(p.read_text(errors="replace") for p in (run / "flower-logs").glob("*.log"))
    used = set(re.findall(r'"ray-node": "([0-9a-f]+)"', logs))
    assert used == two_nodes.node_ids, used  # both nodes

    # the same job in-process, torch on one thread as on the Ray workers (a simulation is the in-process run,
    # model for model: tests/test_e2e_simulation.py)
    local = _hybridfl(["run", *JOB, "run-name=local"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    assert digest(run / "model.pt") == digest(tmp_path / "outputs" / "local" / "model.pt")
    assert json.loads((run / "summary.json").read_text())["final-version"] == 2


@ONE_CLUSTER
@pytest.mark.e2e
def test_a_client_no_node_can_host_is_refused_before_anything_starts(tmp_path: Path, two_nodes) -> None:
    """Through RAY_ADDRESS, as Ray reads it: two CPUs per client where every node has one would queue for ever."""
    out = _hybridfl(["run", *JOB, "--mode", "simulation", "--client-num-cpus", "2"], tmp_path,
                    {"RAY_ADDRESS": two_nodes.address}, two_nodes)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "'--client-num-cpus' = 2.0" in out.stderr and "at most 1" in out.stderr, out.stderr
    assert not (tmp_path / ".flwr" / "processes").exists()  # no Flower process was started


def test_an_address_where_no_cluster_answers_is_refused_at_once(tmp_path: Path, capsys, monkeypatch) -> None:
    from hybridfl.launch.processes import free_port

    monkeypatch.chdir(tmp_path)
    assert cli(["run", *JOB, "--mode", "simulation", "--ray", f"127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err
    assert "'--ray'" in err and "did not answer" in err, err
    assert not (tmp_path / ".flwr").exists()


def test_the_cluster_flags_belong_to_the_simulation(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli(["run", *JOB, "--ray", "127.0.0.1:6379"]) == 2
    assert "'--mode' = 'in-process'" in capsys.readouterr().err


SWEEP = {"runs": [{"presets": "fedavg-digits", "grid": {"lr": [0.05, 0.1]}, "seeds": [0, 1]}],
         "overrides": {"num-rounds": 4, "eval-every": 1, "checkpoint-every": 1, "validation-size": 100}}


def _sweep_spec(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**SWEEP, "results": f"{name}/runs.jsonl"}))  # relative: the driver's folder
    return path


DRIVER_ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}


def _checkpointed(tmp_path: Path, since: float) -> list[Path]:
    """The "cluster" sweep's runs with a checkpoint written after `since` (epoch seconds)."""
    found = []
    for path in (tmp_path / "cluster").glob(f"*/{CHECKPOINT}"):
        with contextlib.suppress(FileNotFoundError):  # between a checkpoint's write and its rename
            if path.stat().st_mtime > since:
                found.append(path.parent)
    return found


@contextlib.contextmanager
def _driver(tmp_path: Path, cluster: Nodes, checkpoints: int) -> Iterator[tuple[subprocess.Popen, float]]:
    """`hybridfl sweep` of the "cluster" spec on `cluster` and its start (epoch seconds), handed over once
    `checkpoints` of its runs have a checkpoint it wrote (or it ended); killed on the way out if it is still
    running."""
    sweep = [HYBRIDFL, "sweep", str(_sweep_spec(tmp_path, "cluster")), "--ray", cluster.address]
    started = time.time()
    driver = subprocess.Popen(cluster.argv(sweep), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=DRIVER_ENV)
    try:
        deadline = time.monotonic() + 480
        while len(_checkpointed(tmp_path, started)) < checkpoints and driver.poll() is None:
            assert time.monotonic() < deadline, f"{checkpoints} runs of the sweep did not start" + cluster.log()
            time.sleep(0.2)
        yield driver, started
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _recorded(tmp_path: Path) -> list[str]:
    """The keys of the "cluster" sweep's results, in the order they were appended."""
    return [json.loads(line)["key"] for line in (tmp_path / "cluster" / "runs.jsonl").read_text().splitlines()]


def _scores(report: str) -> list[str]:
    """The report's rows without their seconds column (the one thing two machines' runs may not share)."""
    return [line.rsplit("|", 2)[0] for line in report.splitlines() if line.startswith("|")]


@ONE_CLUSTER
@pytest.mark.e2e
def test_a_sweep_driver_stopped_then_started_again_survives_the_worker_node_and_reports_what_jobs_2_reports(
        tmp_path: Path, two_nodes) -> None:
    """Four runs, one per node at a time. SIGTERM to the driver once a run has a checkpoint: it exits 143 at once
    (Ray's driver exits 15 unless the command's handler is put back), its tasks are cancelled. A driver started again
    goes on; the worker node is killed once both nodes' runs have a checkpoint of this driver's: the worker's run is run
    again on the head, resumed from that checkpoint, and the head's is not interrupted; every run is recorded once,
    and the report is the local sweep's."""
    with _driver(tmp_path, two_nodes, checkpoints=1) as (driver, _):
        driver.send_signal(signal.SIGTERM)
        out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 143, out[-4000:]
    assert not (tmp_path / "cluster" / "runs.jsonl").exists() or len(_recorded(tmp_path)) < 4
    with _driver(tmp_path, two_nodes, checkpoints=2) as (driver, started):  # both nodes' runs going on
        at_kill = {run: read_checkpoint(run)["round"] for run in _checkpointed(tmp_path, started)
                   if not (run / "summary.json").exists()}
        two_nodes.kill_worker()
        out, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, out[-4000:] + two_nodes.log()
    keys = _recorded(tmp_path)
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 4, keys
    resumed = {run: json.loads((run / "summary.json").read_text())["resumed-after-round"] for run in at_kill}
    # the worker's run went on from a checkpoint at least as late as the one it had when its node died; the head's
    # run, not interrupted, from an earlier one (the first driver's) or none
    assert len(at_kill) == 2 and sum(resumed[run] >= at_kill[run] >= 1 for run in at_kill) == 1, (resumed, at_kill)

    local = subprocess.run([HYBRIDFL, "sweep", str(_sweep_spec(tmp_path, "local")), "--jobs", "2"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    reports = [(tmp_path / name / "runs.md").read_text() for name in ("cluster", "local")]
    assert _scores(reports[0]) == _scores(reports[1]) and len(_scores(reports[0])) == 4, reports


@pytest.mark.parametrize(("cpus", "gpus", "key", "allowed"), [
    (2, 0, "--client-num-cpus", "at most 1: no node of the cluster has more CPUs"),
    (1, 0.5, "--client-num-gpus", "at most 0.25: no node of the cluster with 1 CPUs has more GPUs"),
    (0, 0, "--client-num-cpus", "more than 0 CPUs or GPUs"),
    (1, -1, "--client-num-gpus", "0 or more"),
])
def test_a_task_no_node_can_host_names_the_key_and_the_most_a_node_has(cpus, gpus, key, allowed) -> None:
    from common.errors import ConfigError
    from hybridfl.launch.cluster import check_fits

    nodes = [{"CPU": 1.0, "GPU": 0.25}, {"CPU": 1.0}]
    check_fits(nodes, 1, 0.25, "the cluster")  # the first node hosts it
    with pytest.raises(ConfigError) as err:
        check_fits(nodes, cpus, gpus, "the cluster")
    assert err.value.key == key and allowed in str(err.value), str(err.value)


@pytest.mark.parametrize(("flags", "key"), [(["--run-num-cpus", "2"], "'--ray'"),
                                             (["--ray", "127.0.0.1:6379", "--jobs", "2"], "'--jobs'")])
def test_the_sweeps_cluster_flags_are_checked_before_anything_runs(tmp_path: Path, capsys, monkeypatch, flags,
                                                                   key) -> None:
    monkeypatch.chdir(tmp_path)  # the spec's results are relative to the driver's folder
    spec = _sweep_spec(tmp_path, "flags")
    assert cli(["sweep", str(spec), *flags]) == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "flags").exists()


def test_a_cluster_whose_node_startup_timed_out_is_started_again_and_any_other_failure_is_not() -> None:
    made: list[int] = []

    def make(failures: list[str]):  # fails with each of `failures` in turn, then makes a cluster
        def once():
            made.append(1)
            if failures:
                raise AssertionError(failures.pop(0))
            return "cluster"
        return once

    timeout = "Exception: The current node timed out during startup."
    assert _started(make([timeout, timeout]), tries=3) == "cluster" and len(made) == 3
    made.clear()
    with pytest.raises(AssertionError, match="timed out"):
        _started(make([timeout] * 3), tries=3)
    assert len(made) == 3
    made.clear()
    with pytest.raises(AssertionError, match="gave no"):
        _started(make(["tests/ray_nodes.py gave no the cluster's address in 300 s", timeout]), tries=3)
    assert len(made) == 1
