"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022).

Updates enter a buffer as they arrive, whatever model version they started from; when it holds
K of them the server takes one step (Alg. 1, line 11; Feddle 004 App. A, proof of Thm 1):

    ω ← ω + η_g · Σ_{i ∈ buffer} b_i · s(τ_i) · Δ_i

with b_i = 1/K (``weighting="uniform"``, the paper) or n_i / Σ n (``"examples"``), and the
optional staleness weight s(τ) = (1 + τ)^(−a) (``staleness_weight="polynomial"``; a = 0.5 is the
paper's 1/√(1+τ)), s = 1 otherwise. Like the paper, the sum is divided by K, not by Σ s(τ_i).
"""

from __future__ import annotations

from typing import Any

import torch

from strategies.base import AsyncStrategy, Update, example_weights, weighted_sum


def polynomial_staleness(tau: int, a: float) -> float:
    """s(τ) = (1 + τ)^(−a)."""
    return (1.0 + tau) ** (-a)


class FedBuff(AsyncStrategy):
    """Buffered asynchronous aggregation.

    Args:
        buffer_size: K, updates per server step (paper grid {10, 20, 50}).
        server_lr: η_g (paper grid {0.01, 0.1, 1}).
        staleness_weight: ``"none"`` or ``"polynomial"`` ((1 + τ)^(−a)).
        staleness_exponent: a of the polynomial weight.
        weighting: ``"uniform"`` (1/K, the paper) or ``"examples"`` (n_i / Σ n; with K = clients
            per step, η_g = 1 and no delay this is synchronous FedAvg).
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    def __init__(self, buffer_size: int = 10, server_lr: float = 1.0, staleness_weight: str = "none",
                 staleness_exponent: float = 0.5, weighting: str = "uniform", *,
                 train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        super().__init__(train_config, clients_per_round, seed)
        if staleness_weight not in ("none", "polynomial") or weighting not in ("uniform", "examples"):
            raise ValueError(f"staleness_weight={staleness_weight!r}, weighting={weighting!r}")
        self.buffer_size, self.server_lr = buffer_size, server_lr
        self.staleness_weight, self.staleness_exponent, self.weighting = staleness_weight, staleness_exponent, weighting
        self.buffer: list[tuple[Update, int]] = []  # (update, staleness when it arrived)

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> FedBuff:
        return cls(cfg.buffer_size, cfg.server_lr, cfg.staleness_weight, cfg.staleness_exponent, cfg.weighting,
                   **common)

    def receive(self, update: Update) -> None:
        self.buffer.append((update, update.staleness(self.version)))

    def ready(self) -> bool:
        return len(self.buffer) >= self.buffer_size

    def step(self, updates: list[tuple[Update, int]]) -> torch.Tensor:
        """η_g · Σ b_i s(τ_i) Δ_i for buffered (update, staleness) pairs; Feddle uses it as its fallback."""
        base = (example_weights([u for u, _ in updates]) if self.weighting == "examples"
                else [1.0 / len(updates)] * len(updates))
        if self.staleness_weight == "polynomial":
            base = [b * polynomial_staleness(tau, self.staleness_exponent) for b, (_, tau) in zip(base, updates)]
        return self.server_lr * weighted_sum((u.delta for u, _ in updates), base, self.params)

    def aggregate(self, server: Any = None) -> torch.Tensor:
        self.params = self.params + self.step(self.buffer)
        self.buffer = []
        self.version += 1
        return self.params

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "buffer-size": self.buffer_size, "server-lr": self.server_lr,
                "staleness-weight": self.staleness_weight, "staleness-exponent": self.staleness_exponent,
                "weighting": self.weighting}
