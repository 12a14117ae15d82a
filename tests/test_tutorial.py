"""docs/tutorials/deployment.md's secured commands, run as written on loopback (`SERVER` is localhost, two devices,
free ports): the run completes through the edge proxy, and a process that reaches the devices' port holding only
ca.crt is refused everything the SuperLink's own port would give it (tools/intruder.py); the operator's `flwr` on
the SuperLink's port starts the same foreign app, which then runs on the server and both devices."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from helpers import needs_nginx, readme_commands

from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.flwr_cli import final_status, write_connection
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, wait_healthy
from tools import intruder

TUTORIAL = PROJECT_DIR / "docs" / "tutorials" / "deployment.md"
LONG_RUNNING = ("flower-superlink", "nginx", "server_app.superexec", "client_app.supernode",
                "client_app.warm_executor")  # a command, or a module run with `python -m`
SPEAKS = r"INFO .*run \S+: \S+ on \S+ \("  # the ServerApp's first line: "run NAME: METHOD on DATASET (..."


def commands(tmp_path: Path, ports: dict[str, int], output: Path) -> list[str]:
    """The tutorial's commands for this machine: each value below replaced where the tutorial has it (each must be
    there: a tutorial that changes them fails here), each of device 0's (its key's registration, its two processes)
    repeated for device 1."""
    swaps = {"SERVER": "localhost", "--nodes 10": "--nodes 2", "num-partitions=10": "num-partitions=2",
             "num-clients=10": "num-clients=2 clients-per-round=2 num-rounds=2", "/abs/path": str(output),
             "$PWD": str(tmp_path), **{str(port): str(mine) for port, mine in ports.items()}}
    text = "\n".join(readme_commands(TUTORIAL))
    for token, value in swaps.items():
        assert token in text, f"the tutorial no longer says {token!r}"
        text = text.replace(token, value)
    out = []
    for line in text.splitlines():
        out.append(line)
        if "supernode-0" in line:
            out.append(line.replace("supernode-0", "supernode-1").replace("partition-id=0", "partition-id=1")
                       .replace(str(ports[9094]), str(ports[9094] + 1)))
    return out


@pytest.mark.e2e
def test_the_tutorials_secured_deployment_runs_and_keeps_an_intruder_on_the_devices_port_out(tmp_path: Path) -> None:
    needs_nginx()
    ports = {9093: free_port(), 8000: free_port(), 9094: free_port()}
    output = tmp_path / "outputs"
    env = flower_env(tmp_path / "home")
    env["PATH"] = f"{env['PATH']}:/usr/sbin:/sbin"
    write_connection(tmp_path / "home", "mine", ports[9093], tmp_path / "certs" / "ca.crt")  # the tutorial's config
    lines = commands(tmp_path, ports, output)
    run = lines.pop()
    assert run.startswith("flwr run . mine")
    with ProcessGroup(tmp_path / "logs", env) as procs:
        for i, line in enumerate(lines):
            argv = shlex.split(line)
            command = argv[2] if argv[:2] == ["python", "-m"] else argv[0]
            if command in LONG_RUNNING:
                name = f"{i}-{command}"
                procs.start(name, argv, {**env, "FLWR_HOME": str(tmp_path / "home" / name)}, cwd=tmp_path)
                if argv[0] == "flower-superlink":
                    wait_healthy(ports[9093], dict(procs.procs)[name], 90, tmp_path / "certs" / "ca.crt")
                continue
            done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{line}:\n{done.stdout}{done.stderr}"
        streamed = tmp_path / "logs" / "flwr-run.log"
        main = subprocess.Popen(shlex.split(run), env={**env, "PYTHONUNBUFFERED": "1"}, cwd=PROJECT_DIR,
                                stdout=streamed.open("w"), stderr=subprocess.STDOUT)  # read while it runs
        try:
            # running once its ServerApp speaks (a minute or more under load): its first line streamed, read from
            # the stream's file rather than by `flwr ls` every 2 s (each a process of its own, ~2 s of CPU)
            deadline, said = time.monotonic() + 300, ""
            while not re.search(SPEAKS, said) and main.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
                said = streamed.read_text()
            started = re.search(r"started run (\d+)", said)
            assert started and re.search(SPEAKS, said), f"the operator's run did not start: {said}"
            run_id = int(started.group(1))
            marks = tmp_path / "marks"
            outcome = intruder.attempts(ports[8000], tmp_path / "certs" / "ca.crt", tmp_path / "intruder", run_id,
                                        marks)
            assert intruder.breaches(outcome, marks) == [], outcome
            assert all("404" in got for got in outcome.values()), outcome  # the edge's answer, not the SuperLink's
            main.wait(600)
        finally:
            main.kill()
        assert final_status(env, "mine", run_id) == "finished:completed", streamed.read_text()[-3000:]
        summary = json.loads(next(output.glob("*/summary.json")).read_text())
        assert summary["final-version"] == 2 and summary["total-failures"] == 0
        assert (tmp_path / "superlink.db").stat().st_mode & 0o777 == 0o600  # the tutorial made it private
        # the refusals were the edge's: on the SuperLink's own port the operator runs the same app everywhere
        assert intruder.operator_runs_it(env, "mine", marks) == "finished:completed"
        assert len(list(marks.glob("server-run-*"))) == 1 and len(list(marks.glob("node-*"))) == 2
