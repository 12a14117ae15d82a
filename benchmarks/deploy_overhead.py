"""Seconds per update in deployment: where a device's time goes besides its training, before and after.

    python -m benchmarks.deploy_overhead [--rounds 4] [--compose outputs/compose-test]

In deployment Flower's SuperExec starts one ``flwr-clientapp`` process per message. This runs FedAvg on digits with
one SuperNode on a local deployment (hybridfl/launch/deploy_local.py: SuperLink, SuperNode and their SuperExecs, process
isolation; the node keeps its partition for the run and the SuperExecs poll every 0.2 s) three times, side by side
in one run (``--executor`` of ``hybridfl run --mode deployment``):

- flower: Flower's ``flower-supernode`` and ``flower-superexec``, a new process per message;
- warm-executor: the ClientApp tasks run by client_app/warm_executor.py, a child forked per message from a process
  that imported torch and Flower; Flower's SuperNode;
- warm: the same, and the SuperNode's waits paced (client_app/supernode.py: it asks again soon after each reply
  instead of sleeping 3 s).

Per update (a train message; rounds after the first) it splits the step's wall time (dispatch to reply, on the
server) into the device's own log line (client_app/app.py ``device timing``: Flower's process start until our module
loaded,
our imports (torch), the data, the model, the work) and the rest, which is Flower's: the SuperNode's and the
SuperExec's polls, moving the messages, starting the process. With --compose it also prints what the compose
test measured on the real engine (tools/compose_engine.py: the main job's train messages, split the same way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from hybridfl.launch.deploy_local import EXECUTORS, deploy_runs
from tools.probes import device_timings

PARTS = ("flower-s", "import-s", "data-s", "model-s", "work-s")


def round_seconds(run: Path) -> list[float]:
    return [row["seconds"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if row.get("round", 0) > 0]


def breakdown(trains: list[dict[str, Any]], steps: list[float]) -> dict[str, float]:
    """Mean seconds per update of each part, the first round left out (the run's first data load);
    ``flower-rest`` = the step's wall time (dispatch to reply, server side) − the device's own line."""
    pairs = list(zip(trains, steps, strict=True))[1:]
    out = {part: statistics.mean(d.get(part, 0.0) for d, _ in pairs) for part in PARTS}
    out["update"] = statistics.mean(step for _, step in pairs)
    out["flower-rest"] = out["update"] - statistics.mean(d["flower-s"] + d["handler-s"] for d, _ in pairs)
    out["outside-work"] = out["update"] - out["work-s"]
    return out


def measure(rounds: int, executor: str, workdir: Path) -> dict[str, float]:
    run = {"preset": "fedavg-digits", "num-clients": 1, "clients-per-round": 1, "num-rounds": rounds,
           "output-dir": str(workdir / "runs"), "run-name": executor}
    (path,), _ = deploy_runs([run], workdir / f"home-{executor}", executor=executor)
    logs = sorted((path / "flower-logs").glob("superexec-clientapp-*.log"))
    trains = [d for d in device_timings(logs) if d["message"] == "train"]
    return breakdown(trains, round_seconds(path))


def table(columns: dict[str, dict[str, float]]) -> str:
    names = {"flower-s": "Flower: process start until our module loads", "flower-rest":
             "Flower: polls, moving messages, process spawn", "import-s": "ours: imports (torch)",
             "data-s": "ours: the node's data", "model-s": "ours: model build and load",
             "outside-work": "**outside the training**", "work-s": "the training",
             "update": "the update, dispatch to reply"}
    head = "| seconds per update (one train message) | " + " | ".join(columns) + " |"
    rows = [head, "|---|" + "---:|" * len(columns)]
    for key, name in names.items():
        rows.append(f"| {name} | " + " | ".join(f"{c[key]:.2f}" for c in columns.values()) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--executors", default=",".join(EXECUTORS),
                        help=f"comma-separated device setups, the first the reference ({', '.join(EXECUTORS)})")
    parser.add_argument("--compose", type=Path, default=None,
                        help="a compose test's workdir (outputs/compose-test): print its timings.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        columns = {executor: measure(args.rounds, executor, Path(tmp)) for executor in args.executors.split(",")}
    print(table(columns))
    reference, base = next(iter(columns.items()))
    for name, col in columns.items():
        print(f"outside the training, {name}: {col['outside-work']:.2f} s = "
              f"{col['outside-work'] / base['outside-work']:.2f} of {reference}'s; Flower's process start + our "
              f"imports {col['flower-s'] + col['import-s']:.2f} s")
    if args.compose:
        timings = json.loads((args.compose / "timings.json").read_text())
        print("\ncompose test:", json.dumps({k: v for k, v in timings.items() if k != "images"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
