"""Run a preset on a local Flower deployment (one SuperLink + N SuperNodes on loopback) and check it.

    python -m scripts.deploy_local [--supernodes N] [--flwr-home PATH] [KEY=VALUE ...]
    e.g.  python -m scripts.deploy_local --supernodes 2 clients-per-round=2 num-rounds=2

KEY=VALUE pairs are run-config overrides with ``flwr run -c`` syntax, as in scripts/simulate.py.
The script validates the config first, then starts ``flower-superlink`` (insecure, subprocess
isolation, in-memory state) and N ``flower-supernode`` processes on free loopback ports, node i
holding partition i of N (N defaults to num-clients; a different --supernodes sets num-clients=N).
It runs ``flwr run . --stream`` against them, checks that the run *finished:completed* and wrote
``summary.json``, and stops exactly the processes it started (logs in <run>/flower-logs/).
Expect a few seconds per message: a SuperNode polls the SuperLink every 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.config import ConfigError, load_config
from scripts.flower import PROJECT_DIR, ProcessGroup, flower_env, flwr_run, free_port, wait_healthy, write_connection
from scripts.simulate import parse_overrides, prepare

CONNECTION = "hybridfl-local"


def process_tree(roots: list[int]) -> set[int]:
    """`roots` and all their live descendants (from ``ps``)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def alive(pids: set[int]) -> set[int]:
    """The PIDs in `pids` that still exist as non-zombie processes."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,stat="], capture_output=True, text=True, check=True).stdout
    live = {int(pid) for pid, stat in (line.split() for line in out.splitlines()) if not stat.startswith("Z")}
    return pids & live


def reap(pids: set[int], grace: float = 10.0) -> None:
    """Wait up to `grace` s for `pids` to exit, then SIGKILL the ones left."""
    deadline = time.monotonic() + grace
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Deployment(ProcessGroup):
    """A ProcessGroup that also stops its processes' descendants outside their process groups.

    flower-superlink starts its flower-superexec (parent of the flwr-serverapp) in a new session, out of
    reach of killpg. A SuperLink stopped cleanly terminates it, and a parent-pid monitor ends it after
    a SIGKILL; this waits for that and kills whatever is left, so nothing started here survives.
    """

    pids: set[int] = set()  # every PID started, children included, known once stopped

    def __exit__(self, *exc: object) -> None:
        self.pids = process_tree([p.pid for _, p in self.procs])  # before the stop, while children are linked
        super().__exit__(*exc)
        reap(self.pids)


def deploy(overrides: dict[str, Any], flwr_home: Path, supernodes: int | None = None) -> tuple[Path, set[int]]:
    """Run the deployment; return the run folder and the PIDs it started (all stopped by now).

    Raises ConfigError for a bad config and RuntimeError with the reason when the run fails.
    """
    if supernodes is not None and supernodes != load_config(overrides).num_clients:
        overrides = {**overrides, "num-clients": supernodes}  # one partition per SuperNode
    overrides, run_path = prepare(overrides)
    n = load_config(overrides).num_clients
    env = flower_env(flwr_home)
    port = free_port()
    node_ports: set[int] = set()
    while len(node_ports) < n:  # free_port can hand out a port twice in a row
        node_ports |= {free_port()} - {port}
    with Deployment(run_path / "flower-logs", env) as procs:
        link = procs.start("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                                         "--disable-runtime-dependency-installation"])
        wait_healthy(port, link)
        for i, node_port in enumerate(sorted(node_ports)):
            procs.start(f"supernode-{i}", ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                                           "--port", str(node_port),
                                           "--node-config", f"partition-id={i} num-partitions={n}"])
        write_connection(flwr_home, CONNECTION, port)
        run_id, status = flwr_run(env, CONNECTION, overrides)
    if status != "finished:completed":
        raise RuntimeError(f"run {run_id} ended as {status!r}; logs in {run_path / 'flower-logs'}")
    if not (run_path / "summary.json").is_file():
        raise RuntimeError(f"run {run_id} completed but wrote no {run_path / 'summary.json'}")
    return run_path, procs.pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--supernodes", type=int, default=None, metavar="N",
                        help="SuperNodes to start, one per client partition (default: num-clients)")
    parser.add_argument("--flwr-home", type=Path, default=PROJECT_DIR / ".flwr",
                        help="FLWR_HOME for this run (default: ./.flwr)")
    args = parser.parse_args(argv)
    try:
        run_path, _ = deploy(parse_overrides(args.overrides), args.flwr_home.resolve(), args.supernodes)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    summary = json.loads((run_path / "summary.json").read_text())
    print(f"\nrun {summary['run']}: final test accuracy {summary['final-test-accuracy']:.4f} "
          f"after {summary['final-version']} versions; outputs in {run_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
