"""What refusing a non-finite step costs: the runner's copy of the strategy's state after each good step
(server_app/runtime.py ``_strategy_step``) against the step itself, side by side in one run.

    python -m benchmarks.step_guard [--params 0] [--clients 100] [--repeats 5]

For each method, updates of the Fashion-MNIST CNN's size (``--params 0``: the ``cnn`` model of the feddle-fmnist
presets, built here) are received until the strategy is ready, then ``step()`` and ``state_dict()`` are timed
(median of ``--repeats``), with the state's size. Feddle searches nothing here (``server-epochs`` 0: its step is
FedBuff's over the atlas); a search's cost is BENCHMARKS "Server cost". Prints a table of milliseconds and the
ratio copy / step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from strategies import build_strategy
from strategies.base import Update

ROUND = 10  # updates a round
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {}, "fedbuff": {"buffer-size": 10}, "fedasync": {}, "ca2fl": {"buffer-size": 10},
    "feddle": {"buffer-size": 10, "atlas-size": 20, "server-epochs": 0},
}


def cnn_size() -> int:
    """Trainable parameters of the feddle-fmnist presets' CNN on 28 x 28 grey images."""
    from common.models import build_from_config
    from common.params import ParamSpec
    from server_app.config import load_config

    cfg = load_config({"preset": "feddle-fmnist/fedbuff-dir0.1-n20"}).to_dict()
    return ParamSpec.of(build_from_config(cfg, (1, 28, 28), 10, seed=0)).numel


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in `state` (nested dicts, lists, tuples, Updates)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, Update):
        return state_bytes(state.delta)
    return 0


def measure(name: str, options: dict[str, Any], size: int, clients: int, repeats: int) -> dict[str, float]:
    """Median ms of `name`'s step and of its state's copy, once every client has sent an update (caches full)."""
    from common.params import ParamSpec

    strategy = build_strategy(name, options, num_clients=clients)
    strategy.initialize(torch.zeros(size), ParamSpec(("params",), ((size,),)))
    gen = torch.Generator().manual_seed(0)
    steps: list[float] = []
    copies: list[float] = []
    state: dict[str, Any] = {}

    def timed_step() -> None:
        nonlocal state
        started = time.perf_counter()
        strategy.step()
        stepped = time.perf_counter()
        state = strategy.state_dict()
        if received >= clients:  # every client's update in the caches (CA2FL) before a step counts
            steps.append(stepped - started)
            copies.append(time.perf_counter() - stepped)

    received = 0
    while len(steps) < repeats:  # rounds of ROUND updates, handed over as the runtime does
        for _ in range(ROUND):
            update = Update(received % clients, strategy.version, 0.01 * torch.randn(size, generator=gen), 10)
            update.sent = strategy.model_for(update.client)
            strategy.receive(update)
            received += 1
            if strategy.ready():
                timed_step()
        strategy.close_round()
        if strategy.ready():
            timed_step()
    return {"step-ms": 1e3 * statistics.median(steps), "copy-ms": 1e3 * statistics.median(copies),
            "state-mb": state_bytes(state) / 2**20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=0, help="flat parameters (0: the Fashion-MNIST CNN's)")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = args.params or cnn_size()
    print(f"{size} parameters ({4 * size / 2**20:.1f} MB a model), {args.clients} clients, one torch thread")
    print("| method | step (ms) | state copy (ms) | copy / step | state (MB) |\n|---|---|---|---|---|")
    for name, options in METHODS.items():
        m = measure(name, options, size, args.clients, args.repeats)
        print(f"| {name} | {m['step-ms']:.1f} | {m['copy-ms']:.1f} | {m['copy-ms'] / m['step-ms']:.2f} | "
              f"{m['state-mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
