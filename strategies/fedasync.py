"""FedAsync (Xie et al., "Asynchronous Federated Optimization", 2019).

Every arriving client model is mixed into the global model at once:

    ω ← (1 − α_t) · ω + α_t · ω_new,   α_t = α · s(t − τ),   s(t − τ) = (t − τ + 1)^(−a)

where ω_new = ω^τ + Δ is the client's model, rebuilt from the version τ it started from
(Feddle 004 §4: "polynomial" staleness with adaptive constant a). The strategy keeps the global
models that in-flight clients started from, and drops them once nobody needs them.
"""

from __future__ import annotations

from typing import Any

import torch

from strategies.base import AsyncStrategy, Payload, Update, VersionHistory
from strategies.fedbuff import polynomial_staleness


class FedAsync(AsyncStrategy):
    """Immediate staleness-weighted mixing of each arriving model.

    Args:
        mixing_alpha: α (paper grid {0.2, 0.4, 0.8}).
        staleness_exponent: a (paper grid {0.1, 0.5, 0.9}).
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    def __init__(self, mixing_alpha: float = 0.4, staleness_exponent: float = 0.5, *,
                 train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        super().__init__(train_config, clients_per_round, seed)
        self.mixing_alpha, self.staleness_exponent = mixing_alpha, staleness_exponent
        self.history = VersionHistory()
        self._pending: Update | None = None

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> FedAsync:
        return cls(cfg.mixing_alpha, cfg.staleness_exponent, **common)

    def configure(self, client: int, version: int) -> Payload:
        self.history.dispatched(client, version, self.params)
        return super().configure(client, version)

    def forget(self, client: int) -> None:
        self.history.done(client)

    def receive(self, update: Update) -> None:
        self._pending = update

    def ready(self) -> bool:
        return self._pending is not None

    def aggregate(self, server: Any = None) -> torch.Tensor:
        u, self._pending = self._pending, None
        base = self.history.base_of(u, self.version, self.params)
        alpha_t = self.mixing_alpha * polynomial_staleness(u.staleness(self.version), self.staleness_exponent)
        self.params = (1.0 - alpha_t) * self.params + alpha_t * (base + u.delta)
        self.version += 1
        self.history.done(u.client, u.base_version)
        return self.params

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mixing-alpha": self.mixing_alpha, "staleness-exponent": self.staleness_exponent}
