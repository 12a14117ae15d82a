"""Server-side latency of the asynchronous runtime on a local deployment, next to Flower's own loop.

    python -m benchmarks.async_latency [--supernodes 3] [--rounds 6] [--executors flower,warm]

On ONE local deployment (a flower-superlink and N flower-supernodes on loopback, the same
processes for both jobs) it runs, one after the other, the same training work — N clients,
`rounds` x N local updates of the CNN on digits, one local epoch each:

* hybridfl: FedBuff (K = N) on the runtime's wall clock, concurrency N. Printed: the server-side
  latency from pulling a reply to pushing the next dispatch (median, p95; goal <= 0.1 s) and
  accepted updates per second of training time.
* Flower: FedAvg driven by Flower's own ``Strategy.start()`` (``loop="flower"``): synchronous rounds
  through ``grid.send_and_receive``, federated evaluation off. Printed: updates per second.

Both jobs evaluate on the server's test split after every step/round. ``--executors flower,warm`` repeats it on a
deployment whose nodes run the warm executor (client_app/warm_executor.py). Numbers go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hybridfl.launch.deploy_local import deploy_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supernodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--executors", default="flower",
                        help="comma-separated: each node's ClientApp executor, one deployment each (flower, warm)")
    args = parser.parse_args(argv)
    n = args.supernodes
    rows, rates = [], {}
    for executor in args.executors.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            common = {"dataset": "digits", "num-clients": n, "clients-per-round": n, "num-rounds": args.rounds,
                      "local-epochs": 1, "output-dir": str(Path(tmp) / "out")}
            runs = [{**common, "run-name": "hybridfl", "strategy": "fedbuff", "buffer-size": n, "clock": "wall",
                     "concurrency": n},
                    {**common, "run-name": "flower", "strategy": "fedavg", "loop": "flower"}]
            paths, _ = deploy_runs(runs, Path(tmp) / "flwr-home", executor=executor)
            hyb, flw = (json.loads((p / "summary.json").read_text()) for p in paths)
        for name, s in ((f"hybridfl wall clock (FedBuff), {executor}", hyb), (f"Flower start() (FedAvg), {executor}",
                                                                              flw)):
            rates[name] = s["total-accepted"] / s["train-seconds"]
            rows.append(f"{name:<40} {s['total-accepted']:>8} {s['train-seconds']:>8.1f} {rates[name]:>10.3f}")
        lat = hyb["reply-to-dispatch-s"]
        rows.append(f"  reply -> next dispatch (hybridfl, {executor}, n={lat['count']}): median "
                    f"{lat['median'] * 1000:.1f} ms, p95 {lat['p95'] * 1000:.1f} ms (goal <= 50 ms); medians of its "
                    f"parts: hand-over to the strategy {lat['hand-over-median'] * 1000:.1f} ms, Flower's push "
                    f"{lat['push-median'] * 1000:.1f} ms")
    print(f"\nlocal deployment: {n} SuperNodes, {args.rounds} x {n} updates each (digits CNN, 1 local epoch)")
    print(f"{'loop, executor':<40} {'updates':>8} {'train s':>8} {'updates/s':>10}")
    print("\n".join(rows))
    base = rates[next(k for k in rates if k.startswith("Flower start() (FedAvg), flower"))] if any(
        k.startswith("Flower start() (FedAvg), flower") for k in rates) else None
    for name, rate in rates.items():
        if base and name.startswith("hybridfl"):
            print(f"updates/s {name} / Flower start() on Flower's executor: {rate / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
