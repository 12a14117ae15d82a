"""Server cost of one FedMerge round against one FedAvg round, and what each client downloads, for d global models.

FedMerge's server builds m merged models (Eq. 4: m·d·P multiply-adds), computes m·d head inner products and
updates d models from m deltas (m·d·P again): O(m·d·P) per round, as IFCA's and FedEM's d per-model
averages (paper §3.4). Its clients download one model whatever d; IFCA's and FedEM's download d. Both
strategies are built from the fedmerge-fmnist protocol (the CNN at width 8, 50 clients, all in a round),
fed the same m random updates, and a whole server round is timed side by side: every client's
``model_for``, every ``receive``, the ``step``; median of ``--repeats``, alternating.

    python -m benchmarks.fedmerge_cost [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.models import build_from_config
from common.params import ParamSpec
from server_app.config import load_config
from strategies import build_strategy
from strategies.base import Update

D = (1, 5, 10, 15)


def server_round(name: str, d: int, seed: int = 0) -> tuple[float, int]:
    """Seconds of one server round (payloads for all m clients, their updates, the step) and the bytes one
    client downloads."""
    cfg = load_config({"preset": f"fedmerge-fmnist/{name}-cluster", "global-models": d})
    model = build_from_config(cfg.to_dict(), (1, 28, 28), 10, seed=seed)
    spec = ParamSpec.of(model)
    strategy = build_strategy(cfg.strategy, cfg.options, seed=seed, num_clients=cfg.num_clients)
    strategy.initialize(spec.flatten(model), spec, model)
    g = torch.Generator().manual_seed(seed)
    deltas = [1e-3 * torch.randn(spec.numel, generator=g) for _ in range(cfg.num_clients)]
    started = time.perf_counter()
    payloads = [strategy.model_for(c) for c in range(cfg.num_clients)]
    for c, (payload, delta) in enumerate(zip(payloads, deltas)):
        strategy.receive(Update(c, 0, delta, 100 + c, sent=payload))
    strategy.close_round()
    strategy.step()
    return time.perf_counter() - started, payloads[0].nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| d | FedAvg round (s) | FedMerge round (s) | FedMerge / FedAvg | download per client: FedMerge | IFCA |")
    print("|---|---:|---:|---:|---:|---:|")
    for d in D:
        times: dict[str, list[float]] = {"fedavg": [], "fedmerge": []}
        down: dict[str, int] = {}
        for _ in range(args.repeats):
            for name in times:  # alternate, so drift hits both alike
                seconds, down[name] = server_round(name, d)
                times[name].append(seconds)
        down["ifca"] = server_round("ifca", d)[1]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {d} | {med['fedavg']:.3f} | {med['fedmerge']:.3f} | {med['fedmerge'] / med['fedavg']:.1f} | "
              f"{down['fedmerge'] / 1e6:.2f} MB | {down['ifca'] / 1e6:.2f} MB |", flush=True)


if __name__ == "__main__":
    main()
