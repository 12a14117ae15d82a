"""Server cost of one Feddle step against one Fed+FT step with the same passes over the server data.

Feddle's papers (004 Table 6 / §5.4) put a Feddle server step at about +15% GFLOPs over fine-tuning,
the price of the projection of Eq. 17 (∂ℓ/∂c_m = ⟨∂ℓ/∂ω′, ā_m⟩ for M anchors per mini-batch) and
the merge ω + Σ c_m ā_m. Both strategies are built from the run config (``build_strategy``), fed the
same M random client updates, and their ``step`` is measured side by side: FLOPs with
``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions, forward and backward) and
seconds (median of ``--repeats``, alternating). Feddle runs with ``search-diagnostics = false`` (the
search alone) and with it on (two more forward passes over the server data for its loss-before/after
metrics, which report rather than search).

Two shapes: the protocol's CNN (Animal-MNIST 1×28×28, 1000 server samples, atlas 20) and the papers'
cost-study shape scaled to CPU (ViT + LoRA rank 4: vit-small at 32×32, 256 samples, atlas 100).

    python -m benchmarks.feddle_cost [--epochs 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from common.config import part_of
from common.models import build_from_config
from common.params import ParamSpec
from common.server_data import ServerData
from common.splits import ArrayDataset
from common.training import LocalRecipe
from server_app.config import load_config
from strategies import build_strategy
from strategies.base import Update

SHAPES: dict[str, dict[str, Any]] = {
    "cnn (protocol), M=20, 1000 samples": dict(model="cnn", channels=1, size=28, n=1000, atlas=20,
                                               overrides={"cnn-width": 16}),
    "vit-small + LoRA r=4, M=100, 256 samples": dict(model="vit-small", channels=3, size=32, n=256, atlas=100,
                                                     overrides={"lora-rank": 4}),
}


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # label: (strategy, config overrides)
    "feddle": ("feddle", {"search-diagnostics": False}),
    "feddle+diagnostics": ("feddle", {"search-diagnostics": True}),
    "fedft": ("fedft", {}),
}


def build(variant: str, shape: dict[str, Any], epochs: int, seed: int = 0):
    """A VARIANTS strategy at the state of a step: initialised, its model attached, M updates received."""
    name, overrides = VARIANTS[variant]
    cfg = load_config({"strategy": name, "model": shape["model"], "atlas-size": shape["atlas"],
                       "server-epochs": epochs, "server-train-epochs": epochs, "search-batch-size": 32,
                       "batch-size": 32, "clients-per-round": shape["atlas"], "num-clients": shape["atlas"],
                       **shape["overrides"], **overrides})
    model = build_from_config(cfg.to_dict(), (shape["channels"], shape["size"], shape["size"]), 10, seed=seed)
    spec = ParamSpec.of(model)
    strategy = build_strategy(cfg.strategy, cfg.options, seed=cfg.seed, recipe=part_of(LocalRecipe, cfg))
    strategy.initialize(spec.flatten(model), spec, model)
    g = torch.Generator().manual_seed(seed)
    for m in range(shape["atlas"]):
        strategy.receive(Update(m, 0, 1e-3 * torch.randn(spec.numel, generator=g), 50, sent=strategy.model_for(m)))
    strategy.close_round()
    return strategy, spec


def server_data(shape: dict[str, Any], seed: int = 0) -> ServerData:
    rng = np.random.default_rng(seed)
    x = rng.random((shape["n"], shape["channels"], shape["size"], shape["size"]), dtype=np.float32)
    return ServerData(ArrayDataset(x, rng.integers(0, 10, shape["n"]), 10), True, torch.device("cpu"))


def flops_of(fn) -> tuple[int, float]:
    with FlopCounterMode(display=False) as counter:
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
    return counter.get_total_flops(), seconds


def measure(label: str, shape: dict[str, Any], epochs: int, repeats: int) -> dict[str, float]:
    server = server_data(shape)
    flops: dict[str, int] = {}
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:  # alternate, so drift hits all alike
            strategy, spec = build(variant, shape, epochs)
            strategy.attach(server)
            flops[variant], s = flops_of(strategy.step)
            seconds[variant].append(s)
    median = {v: statistics.median(t) for v, t in seconds.items()}
    row = {"params": spec.numel, **{f"{v}-gflops": f / 1e9 for v, f in flops.items()},
           "ratio-flops": flops["feddle"] / flops["fedft"], "ratio-seconds": median["feddle"] / median["fedft"],
           "ratio-flops-diagnostics": flops["feddle+diagnostics"] / flops["fedft"],
           "ratio-seconds-diagnostics": median["feddle+diagnostics"] / median["fedft"]}
    print(f"{label}: trainable params {row['params']:,}; Feddle {row['feddle-gflops']:.2f} GFLOPs, "
          f"Fed+FT {row['fedft-gflops']:.2f} GFLOPs -> Feddle/Fed+FT = {row['ratio-flops']:.3f} FLOPs, "
          f"{row['ratio-seconds']:.3f} seconds (median of {repeats}); with search-diagnostics: "
          f"{row['ratio-flops-diagnostics']:.3f} FLOPs, {row['ratio-seconds-diagnostics']:.3f} seconds", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=1, help="passes over the server data (E_g = E_s)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    for label, shape in SHAPES.items():
        measure(label, shape, args.epochs, args.repeats)


if __name__ == "__main__":
    main()
