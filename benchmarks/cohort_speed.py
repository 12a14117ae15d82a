"""Cohort training against one client at a time: client updates per second of an in-process run, side by side.

    python -m benchmarks.cohort_speed [--preset feddle-fmnist/fedbuff-dir0.1-n20] [--steps 30] [--repeats 2]
                                       [--processes 1,4,8] [--out results.jsonl]

The job is a preset (default: the Feddle CNN table's protocol, FedBuff at Dir(0.1)/N(20): Fashion-MNIST on 500
clients, 10 sampled per step, Adam lr 1e-3 for 2 epochs of batch 32) for ``--steps`` server steps, evaluated only
at the start and the end. In this one process it runs an untimed warm-up (CUDA's start, the data's load), then
``--repeats`` rounds of the three modes in alternating order (one client at a time; the cohort, each step a CUDA
graph on CUDA; the cohort run eagerly), the same seed each, and prints for each mode the client updates per
second of the runtime's steps (accepted updates / the steps' seconds from metrics.jsonl: dispatch, the clients'
training and the server's step; not the start or the evaluations) and the ratios to one at a time of the medians.
``--processes`` then runs that many copies of the cohort job at once, one process and torch thread each (a sweep's
lanes), and prints their total updates per second: Σ accepted / the longest process's step seconds.
Every line printed is also appended to ``--out`` (JSON lines) as it is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from common import cohort_step
from hybridfl.engine import cohort, inprocess
from hybridfl.engine.inprocess import run_inprocess

# one client at a time; together, each step a CUDA graph where there is CUDA; together, eagerly
MODES = ("off", "on", "eager")


def measure(preset: str, steps: int, mode: str, out_dir: str, name: str) -> dict[str, Any]:
    """One run of `preset` for `steps` steps in `mode` (:data:`MODES`): its updates and step seconds."""
    cohort_step.CUDA_GRAPHS = mode != "eager"
    trained: list[int] = []

    def counted(messages, contexts):  # the cohort trains messages in flight ahead of their steps: count them
        replies = cohort.train_cohort(messages, contexts)
        trained.append(len(replies))
        return replies

    inprocess.train_cohort = counted
    try:
        out = run_inprocess({"preset": preset, "num-rounds": steps, "eval-every": steps, "checkpoint-every": 0,
                             "cohort-training": "off" if mode == "off" else "on", "output-dir": out_dir,
                             "run-name": name})
    finally:
        inprocess.train_cohort = cohort.train_cohort
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["round"] > 0]
    seconds = sum(r["seconds"] for r in steps_rows)
    accepted = sum(r["accepted"] for r in steps_rows)
    graphed = [s.graph is not None for s in cohort_step._STEPS.values()]
    # trained ahead, a reply due after the last step is computed and never accepted: a short run charges the
    # cohort for it, so `trained-by-cohort` says how many it computed
    return {"mode": mode, "steps": len(steps_rows), "accepted": accepted, "seconds": round(seconds, 3),
            "updates-per-s": round(accepted / seconds, 2), "trained-by-cohort": sum(trained),
            "cohort-steps-graphed": f"{sum(graphed)}/{len(graphed)}"}


def emit(line: dict[str, Any], out: Path | None) -> None:
    print(json.dumps(line), flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def side_by_side(args: argparse.Namespace, device: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            measure(args.preset, 2, mode, tmp, f"warm-up-{mode}")
        got: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.repeats):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                result = measure(args.preset, args.steps, mode, tmp, f"{mode}-{i}")
                got[mode].append(result["updates-per-s"])
                emit({"kind": "side-by-side", "repeat": i, "device": device, "preset": args.preset, **result}, args.out)
    median = {m: statistics.median(v) for m, v in got.items()}
    emit({"kind": "ratio", "device": device, "preset": args.preset, "steps": args.steps, "repeats": args.repeats,
          **{f"{m}-updates-per-s": round(v, 2) for m, v in median.items()},
          "cohort/sequential": round(median["on"] / median["off"], 2),
          "eager cohort/sequential": round(median["eager"] / median["off"], 2)}, args.out)


def lanes(args: argparse.Namespace, device: str, count: int) -> None:
    """`count` processes of the cohort job at once; their total updates per second."""
    code = ("import json, logging, sys, tempfile, torch\ntorch.set_num_threads(1)\n"
            "logging.getLogger('flwr').setLevel(logging.WARNING)\nfrom benchmarks.cohort_speed import measure\n"
            "with tempfile.TemporaryDirectory() as tmp:\n"
            f"    print(json.dumps(measure({args.preset!r}, {args.steps}, 'on', tmp, 'lane')))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(count)]
    results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a lane failed: exit codes {[p.returncode for p in procs]}")
    longest = max(r["seconds"] for r in results)
    emit({"kind": "lanes", "device": device, "preset": args.preset, "processes": count, "steps": args.steps,
          "accepted": sum(r["accepted"] for r in results), "longest-seconds": longest,
          "updates-per-s-per-process": round(statistics.mean(r["updates-per-s"] for r in results), 2),
          "total-updates-per-s": round(sum(r["accepted"] for r in results) / longest, 2)}, args.out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="feddle-fmnist/fedbuff-dir0.1-n20")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--processes", default="", help="comma-separated lane counts, e.g. 1,4,8 (default: none)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    side_by_side(args, device)
    for count in (int(c) for c in args.processes.split(",") if c):
        lanes(args, device, count)


if __name__ == "__main__":
    main()
