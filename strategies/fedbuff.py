"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022).

Updates enter a buffer as they arrive, whatever model version they started from; when it holds
K of them the server takes one step (Alg. 1, line 11; Zhu et al. 2025, "Unlocking the Value of Decentralized
Data: A Federated Dual Learning Approach for Model Aggregation", arXiv 2503.20138v1, App. A, proof of Thm 1):

    ω ← ω + η_g · Σ_{i ∈ buffer} b_i · s(τ_i) · Δ_i

with b_i = 1/K (``weighting="uniform"``, the paper) or n_i / Σ n (``"examples"``), and the
optional staleness weight s(τ) = (1 + τ)^(−a) (``staleness_weight="polynomial"``; a = 0.5 is the
paper's 1/√(1+τ)), s = 1 otherwise. Like the paper, the sum is divided by K, not by Σ s(τ_i).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.config import OneOf, Option
from strategies.aggregation import example_weights, polynomial_staleness, weighted_sum
from strategies.base import Strategy, Update
from strategies.options import BUFFER_SIZE, SERVER_LR, STALENESS_EXPONENT
from strategies.robust import RobustConfig

# Keys several buffered methods share (CA2FL, FedAsync, Feddle's fallback), defined once.
STALENESS_WEIGHT = Option("none", OneOf(("none", "polynomial")), "weight updates by (1+τ)^−a (`polynomial`) or not")
WEIGHTING = Option("uniform", OneOf(("uniform", "examples")), "buffer weights 1/K or by examples (with K = clients "
                   "per round, η_g = 1 and no delay: synchronous FedAvg)")


@dataclass(frozen=True)
class FedBuffConfig(RobustConfig):
    buffer_size: int = BUFFER_SIZE.field()
    server_lr: float = SERVER_LR.field()
    staleness_weight: str = STALENESS_WEIGHT.field()
    staleness_exponent: float = STALENESS_EXPONENT.field()
    weighting: str = WEIGHTING.field()


def buffer_weights(config: Any, examples: list[int], staleness: list[int]) -> list[float]:
    """b_i s(τ_i), the weight of each buffered update (its example count, its staleness on arrival) in
    FedBuff's step; Feddle's fallback c′ uses the same weights."""
    base = example_weights(examples) if config.weighting == "examples" else [1.0 / len(examples)] * len(examples)
    if config.staleness_weight == "polynomial":
        base = [b * polynomial_staleness(tau, config.staleness_exponent) for b, tau in zip(base, staleness)]
    return base


def buffered_step(config: Any, params: torch.Tensor, updates: list[tuple[Update, int]],
                  recent: list[float] | None = None) -> torch.Tensor:
    """η_g · Σ b_i s(τ_i) Δ_i for buffered (update, staleness) pairs, with the defences `config` asks for
    (strategies/robust.py; `recent`: the update norms of late)."""
    weights = buffer_weights(config, [u.num_examples for u, _ in updates], [tau for _, tau in updates])
    return config.server_lr * weighted_sum((u.delta for u, _ in updates), weights, params, config, recent)


class FedBuff(Strategy):
    """Buffered asynchronous aggregation: a step every ``buffer-size`` arrivals (options: FedBuffConfig)."""

    name = "fedbuff"
    Config = FedBuffConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.buffer: list[tuple[Update, int]] = []  # (update, staleness when it arrived)

    def receive(self, update: Update) -> None:
        self.buffer.append((update, update.staleness(self.version)))

    def ready(self) -> bool:
        return len(self.buffer) >= self.config.buffer_size

    def step(self) -> dict[str, float]:
        self.params = self.params + buffered_step(self.config, self.params, self.buffer, self.recent_norms)
        self.buffer = []
        self.version += 1
        return {}
