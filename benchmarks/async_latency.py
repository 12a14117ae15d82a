"""Server-side latency of the asynchronous runtime on a local deployment, next to Flower's own loop.

    python -m benchmarks.async_latency [--supernodes 3] [--rounds 6]

On ONE local deployment (a flower-superlink and N flower-supernodes on loopback, the same
processes for both jobs) it runs, one after the other, the same training work — N clients,
`rounds` x N local updates of the CNN on digits, one local epoch each:

* hybridfl: FedBuff (K = N) on the runtime's wall clock, concurrency N. Printed: the server-side
  latency from pulling a reply to pushing the next dispatch (median, p95; goal <= 0.1 s) and
  accepted updates per second of training time.
* Flower: FedAvg driven by Flower's own ``Strategy.start()`` (``loop="flower"``): synchronous rounds
  through ``grid.send_and_receive``, federated evaluation off. Printed: updates per second.

Both jobs evaluate on the server's test split after every step/round. Numbers go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from scripts.deploy_local import deploy_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supernodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    n = args.supernodes
    with tempfile.TemporaryDirectory() as tmp:
        common = {"dataset": "digits", "num-clients": n, "clients-per-round": n, "num-rounds": args.rounds,
                  "local-epochs": 1, "output-dir": str(Path(tmp) / "out")}
        runs = [{**common, "run-name": "hybridfl", "strategy": "fedbuff", "buffer-size": n, "clock": "wall",
                 "concurrency": n},
                {**common, "run-name": "flower", "strategy": "fedavg", "loop": "flower"}]
        paths, _ = deploy_runs(runs, Path(tmp) / "flwr-home")
        hyb, flw = (json.loads((p / "summary.json").read_text()) for p in paths)
    lat = hyb["reply-to-dispatch-s"]
    rate = {name: s["total-accepted"] / s["train-seconds"] for name, s in (("hybridfl", hyb), ("flower", flw))}
    print(f"\nlocal deployment: {n} SuperNodes, {args.rounds} x {n} updates each (digits CNN, 1 local epoch)")
    print(f"{'loop':<28} {'updates':>8} {'train s':>8} {'updates/s':>10}")
    for name, s in (("hybridfl wall clock (FedBuff)", hyb), ("Flower start() (FedAvg)", flw)):
        print(f"{name:<28} {s['total-accepted']:>8} {s['train-seconds']:>8.1f} "
              f"{s['total-accepted'] / s['train-seconds']:>10.3f}")
    print(f"updates/s ratio hybridfl / Flower: {rate['hybridfl'] / rate['flower']:.2f}")
    print(f"reply -> next dispatch (hybridfl, n={lat['count']}): median {lat['median'] * 1000:.1f} ms, "
          f"p95 {lat['p95'] * 1000:.1f} ms (goal <= 100 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
