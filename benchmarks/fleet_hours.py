"""Which method on which fleet, in hours: synchronous FedAvg, FedBuff and Feddle-ID on one lognormal fleet, on the
real engine and in the simulation with device time, side by side.

    python -m benchmarks.fleet_hours [--fleet lognormal] [--clients 12] [--rounds 20] [--async-rounds 60]
                                     [--modes sim real]
                                     [--methods fedavg fedbuff feddle] [--out benchmarks/results/fleet-hours]

On one fleet (common/fleet.py, drawn by seed 0) and one task (digits, Dirichlet 0.5, the presets' CNN, seed 0):
synchronous FedAvg runs ``--rounds`` rounds of half the fleet; FedBuff and Feddle-ID keep the whole fleet busy, step
every half-fleet of arrivals (``buffer-size``) and run ``--async-rounds`` rounds of that many arrivals (they need
more updates to reach what FedAvg reaches; the question is how long that takes):

- **sim**: the in-process engine, device time from the profiles (runtime's module docstring): FedAvg on the virtual
  clock with no delay (a barrier: a round lasts as long as its slowest device), FedBuff and Feddle-ID on the device
  clock (updates handed over in order of completion);
- **real**: a local deployment (hybridfl/launch/deploy_local.py) with the fleet applied to real SuperNodes
  (hybridfl/launch/real_fleet.py: shaped links, paced work); FedAvg on the same barrier, the asynchronous methods on the
  wall clock. Its time is the host's: the rounds' seconds added up (the server's evaluations between rounds left out,
  as the simulation leaves them out).

A real run also says how often the host fell behind its devices (``host-behind``: the share of train messages whose
work on the host outlasted the profile's pace, so that the device was slower than its profile) and the median
host work per message (``work-s-median``): where the host falls behind, the real run is the host's time, not the
fleet's, and the simulation cannot predict it.

Time to accuracy: when a run's test accuracy first reaches the target (``--target``; default: synchronous FedAvg's
final accuracy in the same mode). Each finished run is appended to ``<out>/runs.jsonl`` (a run already there is not
run again: the benchmark resumes); the table is printed from that file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch.deploy_local import deploy
from tools.probes import device_timings

METHODS = {"fedavg": {"preset": "fedavg-digits", "clock": "virtual", "delay-sigma": 0.0},
           "fedbuff": {"preset": "fedbuff-digits", "delay-sigma": 0.0},
           "feddle": {"preset": "feddle-digits", "delay-sigma": 0.0}}


def overrides(method: str, mode: str, fleet: str, clients: int, rounds: int, async_rounds: int) -> dict[str, Any]:
    half = clients // 2
    run = {**METHODS[method], "num-clients": clients, "clients-per-round": half, "num-rounds": rounds,
           "eval-every": 1, "fleet": fleet, "seed": 0, "checkpoint-every": 0}
    if method != "fedavg":
        run.update({"clock": "device" if mode == "sim" else "wall", "concurrency": clients, "buffer-size": half,
                    "num-rounds": async_rounds})
    return run


def curve(run: Path, mode: str) -> list[tuple[float, float]]:
    """(seconds, test accuracy) after each evaluated round: device time (sim) or the rounds' host seconds (real)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out, elapsed = [], 0.0
    for row in rows:
        elapsed += row.get("seconds", 0.0)
        if "test-accuracy" in row:
            out.append((row["device-t"] if mode == "sim" else elapsed, row["test-accuracy"]))
    return out


def measure(method: str, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run = {**overrides(method, mode, args.fleet, args.clients, args.rounds, args.async_rounds), "output-dir": str(work),
           "run-name": f"{method}-{mode}"}
    if mode == "sim":
        path = run_inprocess(run)
    else:
        path, _ = deploy(run, work / "flwr-home", supernodes=args.clients)
    summary = json.loads((path / "summary.json").read_text())
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    fleet = json.loads((path / "fleet.json").read_text()) if (path / "fleet.json").exists() else None
    trains = [t for t in device_timings(sorted((path / "flower-logs").glob("superexec-clientapp-*.log")))
              if t["message"] == "train"] if mode == "real" else []
    return {"key": key(args, method, mode), "method": method, "mode": mode, "fleet": args.fleet,
            "clients": args.clients, "rounds": run["num-rounds"], "curve": curve(path, mode),
            "final-accuracy": summary["final-test-accuracy"], "accepted": summary["total-accepted"],
            "lost": summary["total-failures"] + summary["total-timeouts"] + summary["total-vanished"]
            + summary.get("total-unavailable", 0),  # a summary from before the SuperLink's losses were counted apart
            "bytes": sum(r.get("bytes-down", 0) + r.get("bytes-up", 0) for r in rows),
            "real-fleet": fleet and fleet["total"],
            # the host kept each device at its profile's pace only where the device's work ended before the pace did
            "host-behind": sum(t.get("paced-s", 0.0) < 0.01 for t in trains) / len(trains) if trains else None,
            "work-s-median": statistics.median(t["work-s"] for t in trains) if trains else None}


def key(args: argparse.Namespace, method: str, mode: str) -> str:
    """A run's key in runs.jsonl: its fleet, fleet size, method, rounds and mode."""
    rounds = args.rounds if method == "fedavg" else args.async_rounds
    return f"{args.fleet}/{args.clients}/{method}/{rounds}/{mode}"


def time_to(curve: list[list[float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target - 1e-9), None)


def table(results: list[dict[str, Any]], target: float | None) -> str:
    """Per method: final accuracy, seconds to the target in each mode and the simulation's error."""
    by = {(r["method"], r["mode"]): r for r in results}
    lines = ["| method | mode | final acc. | target | time to target | total time | updates (lost) | MB moved | "
             "host behind |", "|---|---|---|---|---|---|---|---|---|"]
    for (method, mode), r in sorted(by.items()):
        goal = target if target is not None else (by.get(("fedavg", mode)) or r)["final-accuracy"]
        tta = time_to(r["curve"], goal)
        behind = "" if r.get("host-behind") is None else f"{r['host-behind']:.0%}"
        lines.append(f"| {method} | {mode} | {r['final-accuracy']:.3f} | {goal:.3f} | "
                     f"{'not reached' if tta is None else f'{tta:.0f} s'} | {r['curve'][-1][0]:.0f} s | "
                     f"{r['accepted']} ({r['lost']}) | {r['bytes'] / 1e6:.0f} | {behind} |")
    lines.append("")
    for method in sorted({m for m, _ in by}):
        sim, real = by.get((method, "sim")), by.get((method, "real"))
        if sim and real:
            goal = target if target is not None else by.get(("fedavg", "real"), real)["final-accuracy"]
            t_sim, t_real = time_to(sim["curve"], goal), time_to(real["curve"], goal)
            total = sim["curve"][-1][0] / real["curve"][-1][0] - 1
            tta = (f"{t_sim / t_real - 1:+.0%}" if t_sim and t_real else "n/a (target not reached in both)")
            lines.append(f"- {method}: the simulation's time to {goal:.3f} vs the real engine's: {tta}; "
                         f"its total time: {total:+.0%}")
    for mode in ("sim", "real"):
        avg, buff = by.get(("fedavg", mode)), by.get(("fedbuff", mode))
        if avg and buff:
            t_avg = time_to(avg["curve"], avg["final-accuracy"])
            t_buff = time_to(buff["curve"], avg["final-accuracy"])
            ratio = f"{t_buff / t_avg:.2f}" if t_buff and t_avg else "n/a (not reached)"
            lines.append(f"- {mode}: FedBuff's time to FedAvg's final accuracy / FedAvg's = {ratio} (goal: ≤ 0.33)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default="lognormal")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=20, help="synchronous FedAvg's rounds")
    parser.add_argument("--async-rounds", type=int, default=60, help="FedBuff's and Feddle-ID's rounds")
    parser.add_argument("--modes", nargs="+", default=["sim", "real"], choices=["sim", "real"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fleet-hours"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs.jsonl"
    done = {json.loads(line)["key"]: json.loads(line) for line in runs.read_text().splitlines()} \
        if runs.exists() else {}
    for mode in args.modes:
        for method in args.methods:
            if key(args, method, mode) in done:
                continue
            with tempfile.TemporaryDirectory(prefix="fleet-hours-") as work:
                result = measure(method, mode, args, Path(work))
            with runs.open("a") as f:
                f.write(json.dumps(result) + "\n")
            done[result["key"]] = result
            print(f"{result['key']}: final accuracy {result['final-accuracy']:.3f}, {result['curve'][-1][0]:.0f} s",
                  flush=True)
    keys = {key(args, method, mode) for method in METHODS for mode in ("sim", "real")}
    print(table([r for k, r in done.items() if k in keys], args.target))


if __name__ == "__main__":
    main()
