"""What each data-mixing variant costs beyond FedAvg, per round, side by side: the server's work, one client's
work, and the extra bytes each dispatch carries (the mixing paper §4: parallel training costs the server J steps
and no bytes; example transfer costs example size × examples down; gradient transfer one model-sized gradient
down and one central gradient on the server).

Server: one round of the mixing-fmnist protocol, 10-class setting, at the tuned presets (the CNN at width 16,
10 clients, 3000 central samples): every ``model_for``, every ``receive``, the ``step``. Client: one local run
(1 epoch of SGD, batch 32) on ``--client-size`` samples, with what its dispatch carries. The data are random
tensors of Fashion-MNIST's shape (costs do not depend on the pixels), so no dataset is needed. Medians of
``--repeats``, the variants alternating; one torch thread.

    python -m benchmarks.mixing_cost [--repeats 5] [--client-size 420]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.feddual_cost import medians
from common.config import make_options, part_of
from common.datasets import ArrayDataset
from common.models import build_from_config
from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.server_data import ServerData
from common.training import LocalRecipe, train
from server_app.config import load_config
from strategies import build_strategy
from strategies.base import Payload, Strategy, Update
from strategies.mixing import with_central_examples

VARIANTS = {"no mixing (FedAvg)": "nomix", "parallel training": "parallel", "example transfer": "example",
            "gradient transfer": "gradient"}


def fmnist_like(n: int, classes: tuple[int, ...], seed: int) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.random((n, 1, 28, 28), dtype=np.float32), rng.choice(classes, n), 10)


def built(method: str, seed: int = 0) -> tuple[Any, nn.Module, ParamSpec, Strategy]:
    """(config, model, spec, strategy) of `method`'s 10-class preset, initialised, with its central data."""
    cfg = load_config({"preset": f"mixing-fmnist/{method}-classes10", "device": "cpu"})
    model = build_from_config(cfg.to_dict(), (1, 28, 28), 10, seed=seed)
    spec = ParamSpec.of(model)
    strategy = build_strategy(cfg.strategy, cfg.options, seed=seed, num_clients=cfg.num_clients,
                              recipe=part_of(LocalRecipe, cfg))
    strategy.initialize(spec.flatten(model), spec, model)
    strategy.attach(ServerData(fmnist_like(cfg.central_size, (7, 8, 9), seed), True, torch.device("cpu")))
    return cfg, model, spec, strategy


def server_round(method: str, seed: int = 0) -> tuple[float, Payload]:
    """Seconds of one server round and the payload of its first dispatch."""
    cfg, _, spec, strategy = built(method, seed)
    g = torch.Generator().manual_seed(seed)
    deltas = [1e-3 * torch.randn(spec.numel, generator=g) for _ in range(cfg.clients_per_round)]
    started = time.perf_counter()
    payloads = [strategy.model_for(c) for c in range(cfg.clients_per_round)]
    for c, (payload, delta) in enumerate(zip(payloads, deltas)):
        strategy.receive(Update(c, 0, delta, 420, sent=payload))
    strategy.close_round()
    strategy.step()
    return time.perf_counter() - started, payloads[0]


def client_run(method: str, n: int, seed: int = 0) -> float:
    """Seconds of one client's local run under `method`, on what its dispatch carries (as the ClientApp does)."""
    cfg, model, spec, strategy = built(method, seed)
    payload = strategy.model_for(0)
    config = {**cfg.to_dict(), **strategy.client_options()}  # what every message to its clients carries
    recipe = make_options(LocalRecipe, config)
    data = fmnist_like(n, tuple(range(7)), seed + 1)
    started = time.perf_counter()
    spec.load_into(model, payload.params)
    received = Received(model, [p.detach().clone() for p in model.parameters() if p.requires_grad], payload.arrays)
    loss = build_loss(strategy.client_side.objective or recipe.local_objective, config, received)
    train(model, with_central_examples(data, payload.arrays), recipe, seed, loss=loss)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--client-size", type=int, default=420, help="samples of the timed client (the 10-class "
                    "setting's clients hold 420 on average)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = medians({k: (lambda m=m: server_round(m)[0]) for k, m in VARIANTS.items()}, args.repeats)
    client = medians({k: (lambda m=m: client_run(m, args.client_size)) for k, m in VARIANTS.items()}, args.repeats)
    first = next(iter(VARIANTS))
    payloads = {k: built(m)[3].model_for(0) for k, m in VARIANTS.items()}  # what one dispatch carries
    print("| variant | server round (s) | × FedAvg | client run (s) | × FedAvg's | extra down per dispatch |\n"
          "|---|---:|---:|---:|---:|---:|")
    for k, payload in payloads.items():
        extra, model_bytes = payload.extra_nbytes, payload.nbytes - payload.extra_nbytes
        print(f"| {k} | {server[k]:.4f} | {server[k] / server[first]:.1f} | {client[k]:.3f} | "
              f"{client[k] / client[first]:.2f} | {extra / 1e3:.1f} KB ({extra / model_bytes:.2f} × the model) |")


if __name__ == "__main__":
    main()
