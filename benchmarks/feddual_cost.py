"""FedDUAL's cost per round against FedAvg's, server and client side by side (the paper's Table 3: on FMNIST its
server time is 39× FedAvg's, 1.95 s against 0.05 s, and its client time 2.62 s against 2.14 s).

Server: one round of the feddual-fmnist protocol (LeNet, 10 clients' updates) — every ``model_for``, every
``receive``, the ``step`` — for FedAvg, FedDUAL as the paper reads (barycenter of the updates, 150 iterations)
and as its code runs (barycenter of the loss gradients, 1000 raw iterations). The barycenter's distances are
the closed form mean(|sort(u) − sort(v)|) with the client vectors sorted once; the same distances through
POT's ``ot.wasserstein_1d`` (what a straightforward port calls every iteration) are timed beside them.
Client: one local run (3 epochs of Adam, batch 32) on a client of ``--client-size`` Fashion-MNIST-shaped
samples as each method's clients do it: plain cross-entropy (FedAvg), the adaptive loss with its accuracy
passes (the paper), CE/2 and the extra loss-gradient pass (the code). Medians of ``--repeats``, the variants
alternating; one torch thread.

    python -m benchmarks.feddual_cost [--repeats 5] [--client-size 600]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from common.config import part_of
from common.datasets import ArrayDataset
from common.models import build_from_config
from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.training import LocalRecipe, accuracy_of, train
from server_app.config import load_config
from strategies import build_strategy
from strategies.base import Update
from strategies.feddual import LOSS_GRADIENT, loss_gradient, w1

SERVER = {"FedAvg": "fedavg-code", "FedDUAL (paper)": "feddual-code", "FedDUAL (code)": "feddual-reference-code"}


def server_round(preset: str, seed: int = 0) -> float:
    cfg = load_config({"preset": f"feddual-fmnist/{preset}"})
    model = build_from_config(cfg.to_dict(), (1, 28, 28), 10, seed=seed)
    spec = ParamSpec.of(model)
    strategy = build_strategy(cfg.strategy, cfg.options, seed=seed, num_clients=cfg.num_clients)
    strategy.initialize(spec.flatten(model), spec, model)
    g = torch.Generator().manual_seed(seed)
    dynamic = sum(spec.sizes[-2:])
    updates = [(1e-2 * torch.randn(spec.numel, generator=g), {LOSS_GRADIENT: torch.randn(dynamic, generator=g)})
               for _ in range(cfg.clients_per_round)]
    started = time.perf_counter()
    for c, (delta, arrays) in enumerate(updates):
        strategy.receive(Update(c, 0, delta, 100 + c, arrays=arrays, sent=strategy.model_for(c)))
    strategy.close_round()
    strategy.step()
    return time.perf_counter() - started


def distances(iters: int, k: int = 10, n: int = 850) -> dict[str, float]:
    """Seconds for `iters` rounds of K distances to a moving barycenter: closed form vs POT."""
    import ot

    v = torch.randn(k, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    bary = v.mean(0)
    started = time.perf_counter()
    v_sorted = torch.sort(v, 1).values
    for _ in range(iters):
        w1(bary, v_sorted)
    closed = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(iters):
        ot.wasserstein_1d(bary[:, None].expand(-1, k), v.T, p=1)
    return {"closed form": closed, "POT": time.perf_counter() - started}


def client_run(preset: str, n: int, seed: int = 0) -> float:
    """Seconds of one client's local work under `preset`: training with its objective, and the loss gradient
    when its server asks for one."""
    cfg = load_config({"preset": f"feddual-fmnist/{preset}"})
    model = build_from_config(cfg.to_dict(), (1, 28, 28), 10, seed=seed)
    rng = np.random.default_rng(seed)
    data = ArrayDataset(rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n), 10)
    recipe = part_of(LocalRecipe, cfg)
    started = time.perf_counter()
    received = Received(model, [p.detach().clone() for p in model.parameters()], accuracy=accuracy_of(model, data))
    train(model, data, recipe, seed, loss=build_loss(recipe.local_objective, cfg.to_dict(), received))
    if cfg.options.get("dynamic-source") == "loss-gradient" and cfg.strategy == "feddual":
        loss_gradient(model, data, cfg.options["dynamic-arrays"])
    return time.perf_counter() - started


def medians(variants: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up: the first call pays for lazy initialisation
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():  # alternate, so drift hits every variant alike
            times[name].append(fn())
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--client-size", type=int, default=600, help="samples of the timed client (FMNIST code "
                    "partition: mean ~610, median ~34)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = medians({k: (lambda p=p: server_round(p)) for k, p in SERVER.items()}, args.repeats)
    print("| server round (10 updates, LeNet) | seconds | × FedAvg |\n|---|---:|---:|")
    for k, v in server.items():
        print(f"| {k} | {v:.4f} | {v / server['FedAvg']:.1f} |")
    dist = medians({k: (lambda k=k: distances(150)[k]) for k in ("closed form", "POT")}, args.repeats)
    print(f"\n150 iterations of 10 distances (n = 850): closed form {dist['closed form']:.4f} s, POT "
          f"{dist['POT']:.4f} s ({dist['POT'] / dist['closed form']:.0f}×)")
    client = medians({k: (lambda p=p: client_run(p, args.client_size)) for k, p in SERVER.items()}, args.repeats)
    print(f"\n| client run ({args.client_size} samples, 3 epochs) | seconds | × FedAvg's |\n|---|---:|---:|")
    for k, v in client.items():
        print(f"| {k} | {v:.3f} | {v / client['FedAvg']:.2f} |")


if __name__ == "__main__":
    main()
