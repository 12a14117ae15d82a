"""Hostile devices: final accuracy with 0, 1 and 10 % of the devices attacking, with and without each defence.

    python -m benchmarks.hostile [--seeds 0,1,2] [--lanes 2] [--out benchmarks/results/hostile/digits.jsonl]

The protocol (``PROTOCOL``): FedAvg on digits, 100 clients (about 14 samples each) at Dirichlet(1.0), 20 a round,
30 rounds of 5 local epochs at lr 0.02, batch 8 (the digits preset's 10-client recipe collapses at 100 clients; this
one reaches 93 % clean); in process, so a run is deterministic. The attackers are a seeded draw of the clients (1 or
10 of 100); each of their train replies is the honest one changed (``ATTACKS``): its update
scaled ×100, its update's sign flipped, or its ``num-examples`` claimed 1000 times over. The defences
(``DEFENCES``): none (the run keys' defaults, which still check a reply's ``num-examples`` against the client's
size), a norm bound at 3 × the recent median norm, the coordinate-wise trimmed mean (β = 0.1) and median
(strategies/robust.py), and, for the lie alone, none without the size check (``max-num-examples`` 10^9: what a
lie did before the check). Every run is appended to ``--out`` as it ends and skipped when found there, so a
stopped benchmark goes on; the table (``*.md`` beside it) is the mean ± std over seeds of the final test
accuracy, printed and written at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PROTOCOL = {"preset": "fedavg-digits", "num-clients": 100, "dirichlet-alpha": 1.0, "clients-per-round": 20,
            "num-rounds": 30, "local-epochs": 5, "batch-size": 8, "lr": 0.02, "max-failed-fraction": 1.0,
            "checkpoint-every": 0}
FRACTIONS = (0.01, 0.1)
ATTACKS = ("scaled", "sign-flip", "lie")
DEFENCES: dict[str, dict[str, Any]] = {
    "none": {},
    "norm bound": {"update-norm-multiple": 3.0},
    "trimmed mean": {"aggregation": "trimmed-mean", "trim-fraction": 0.1},
    "median": {"aggregation": "median"},
    "none, no size check": {"max-num-examples": 10**9},
}
SCALE, LIE = 100.0, 1000


def attackers(fraction: float, seed: int) -> set[int]:
    """The attacking clients: a seeded draw of `fraction` of the protocol's clients."""
    n = PROTOCOL["num-clients"]
    return set(random.Random(seed).sample(range(n), round(fraction * n)))


def hostile_app(attack: str, hostile: set[int]) -> Any:
    """hybridfl's ClientApp, whose train replies from the clients in `hostile` are changed by `attack`."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from client_app.app import app as honest_app
    from common.protocol import ARRAYS, METRICS, NUM_EXAMPLES

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Any) -> Message:
        reply = honest_app(msg, context)
        if context.node_config["partition-id"] not in hostile or reply.has_error():
            return reply
        delta = reply.content[ARRAYS]["params"].numpy()
        metrics = dict(reply.content[METRICS])
        if attack == "lie":
            metrics[NUM_EXAMPLES] = int(metrics[NUM_EXAMPLES]) * LIE
        else:
            delta = delta * (SCALE if attack == "scaled" else -1.0)
        return Message(RecordDict({ARRAYS: ArrayRecord({"params": Array(delta.astype(np.float32))}),
                                   METRICS: MetricRecord(metrics)}), reply_to=msg)

    app.evaluate()(honest_app)
    app.query()(honest_app)
    return app


def points(seeds: list[int]) -> list[dict[str, Any]]:
    """Every run of the table: the clean runs, then each attack at each fraction under each defence that applies."""
    clean = [{"attack": "none", "fraction": 0.0, "defence": d, "seed": s}
             for d in DEFENCES if d != "none, no size check" for s in seeds]
    attacked = [{"attack": a, "fraction": f, "defence": d, "seed": s} for a in ATTACKS for f in FRACTIONS
                for d in DEFENCES if d != "none, no size check" or a == "lie" for s in seeds]
    return clean + attacked


def key(point: dict[str, Any]) -> str:
    return f"{point['attack']}/{point['fraction']}/{point['defence']}/s{point['seed']}"


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One run in this process (one torch thread): its final and best-of-last-5 test accuracy, what it rejected."""
    import torch

    from hybridfl.engine.inprocess import run_inprocess

    torch.set_num_threads(1)
    hostile = attackers(point["fraction"], point["seed"])
    with tempfile.TemporaryDirectory() as tmp:
        out = run_inprocess({**PROTOCOL, **DEFENCES[point["defence"]], "seed": point["seed"], "output-dir": tmp,
                             "run-name": "run"}, client_app=hostile_app(point["attack"], hostile))
        summary = json.loads((out / "summary.json").read_text())
    if summary["total-failures"]:  # an attack that broke on the device measures nothing: stop, do not record it
        raise RuntimeError(f"{key(point)}: {summary['total-failures']} client failures (see its log)")
    return {**point, "key": key(point), "attackers": sorted(hostile),
            "final-test-accuracy": summary["final-test-accuracy"], "max-last-5-evals": summary["max-last-5-evals"],
            "rejected": summary["total-rejected"]}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: a row per attack and fraction, a column per defence, mean ± std over seeds of the final test
    accuracy (%) (the value itself for one seed; "—" not run)."""
    cell: dict[tuple[str, float, str], list[float]] = {}
    for r in results:
        cell.setdefault((r["attack"], r["fraction"], r["defence"]), []).append(100 * r["final-test-accuracy"])
    fmt: Callable[[list[float]], str] = lambda v: ("—" if not v else f"{v[0]:.1f}" if len(v) == 1
                                                   else f"{np.mean(v):.1f} ± {np.std(v):.1f}")
    lines = ["| attack | devices | " + " | ".join(DEFENCES) + " |", "|---|---|" + "---|" * len(DEFENCES)]
    for attack, fraction in [("none", 0.0), *((a, f) for a in ATTACKS for f in FRACTIONS)]:
        row = [fmt(cell.get((attack, fraction, d), [])) for d in DEFENCES]
        lines.append(f"| {attack} | {fraction:.0%} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hostile/digits.jsonl"))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["key"] for line in args.out.read_text().splitlines()} if args.out.exists() else set()
    todo = [p for p in points([int(s) for s in args.seeds.split(",")]) if key(p) not in done]
    print(f"{len(todo)} runs to go ({len(done)} done) -> {args.out}", flush=True)
    with multiprocessing.get_context("spawn").Pool(args.lanes) as pool:
        for result in pool.imap_unordered(run_point, todo):
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"{result['key']}: {100 * result['final-test-accuracy']:.1f} % (rejected {result['rejected']})",
                  flush=True)
    results = [json.loads(line) for line in args.out.read_text().splitlines()]
    text = table(results)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
