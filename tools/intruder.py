"""What a process that reaches the devices' port and holds only the public ``ca.crt`` tries against a deployment.

Flower 1.42 serves its Fleet, Control and Runtime APIs on one port, and the open-source Control API authenticates
nobody: on the SuperLink's own port, such a process registers a key of its own, starts a run of its own app (code on
the server and on every device), lists and stops the operator's runs. Behind the edge proxy (docker/edge/), each
attempt must be refused. The compose test on a real engine (tools/compose_engine.py), the compose twin
(tests/test_compose.py) and the deployment tutorial's commands (tests/test_tutorial.py) run these attempts; each
also runs :func:`operator_runs_it` once, so that a refusal is known to be the edge's and not a broken app's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from hybridfl.launch.flwr_cli import Flwr, final_status, local_flwr, write_connection
from hybridfl.launch.pki import node_key
from hybridfl.launch.processes import flower_env
from tools.probes import acquire_task_anonymously

APP = Path(__file__).resolve().parent / "intruder_app"
CONNECTION = "intruder"


def _flwr(env: dict[str, str], *args: str) -> tuple[bool, str]:
    """Whether a ``flwr ... --format json`` call succeeded, and what it said."""
    out = subprocess.run(["flwr", *args, "--format", "json"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=APP)
    try:
        reply = json.loads(out.stdout)
    except json.JSONDecodeError:
        reply = {}
    said = (out.stdout + out.stderr).strip().replace("\n", " ")[-300:]
    return out.returncode == 0 and bool(reply.get("success")), said


def attempts(port: int, ca: Path | None, workdir: Path, run_id: int, marks: Path) -> dict[str, str]:
    """Each attempt through 127.0.0.1:`port` (TLS verified against `ca`, or plain HTTP) with a FLWR_HOME and a key
    of its own in `workdir`: what it got, ``refused: ...`` or ``ALLOWED: ...``. `run_id` is one of the operator's
    runs (to stop); the intruder's app would write its marks under `marks`."""
    env = flower_env(workdir / "home")
    write_connection(workdir / "home", CONNECTION, port, ca)
    key = node_key(workdir, "intruder-key")
    outcome: dict[str, str] = {}
    for what, args in (("register a SuperNode key of its own", ("supernode", "register", f"{key}.pub", CONNECTION)),
                       ("start a run of its own app", ("run", str(APP), CONNECTION, "--run-config",
                                                       f'mark-dir="{marks}"')),
                       ("list the operator's runs", ("ls", CONNECTION)),
                       ("stop the operator's run", ("stop", str(run_id), CONNECTION))):
        ok, said = _flwr(env, *args)
        outcome[what] = f"{'ALLOWED' if ok else 'refused'}: {said}"
    response = acquire_task_anonymously(f"127.0.0.1:{port}", ca)
    outcome["take a task from the Runtime API"] = ("ALLOWED: a task was handed out" if response is None else
                                                   f"refused: {response.status_code} {response.text.strip()[:200]}")
    return outcome


def breaches(outcome: dict[str, str], marks: Path) -> list[str]:
    """The attempts that were not refused, and any mark the intruder's app left (empty: all kept out)."""
    left = [f"{what}: {got}" for what, got in outcome.items() if not got.startswith("refused")]
    return left + [f"its app ran: {p}" for p in sorted(marks.glob("*"))] if marks.is_dir() else left


def operator_runs_it(env: dict[str, str], connection: str, marks: Path, flwr: Flwr = local_flwr) -> str:
    """The operator's `flwr` (`flwr`: how it runs; `connection` in `env`'s FLWR_HOME) starts the same app and waits
    for it: its run's final status (its ServerApp and ClientApps then wrote their marks under `marks`)."""
    out = subprocess.run([*flwr(APP), "run", ".", connection, "--format", "json", "--run-config",
                          f'mark-dir="{marks}"'], env=env, capture_output=True, text=True, timeout=120, cwd=APP)
    try:
        run_id = int(json.loads(out.stdout)["run-id"])
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise RuntimeError(f"the operator could not start {APP}: {out.stdout}{out.stderr}") from err
    return final_status(env, connection, run_id, timeout=300, flwr=flwr)
