"""FedAsync (Xie et al., "Asynchronous Federated Optimization", 2019).

Every arriving client model is mixed into the global model at once:

    ω ← (1 − α_t) · ω + α_t · ω_new,   α_t = α · s(t − τ),   s(t − τ) = (t − τ + 1)^(−a)

where ω_new = ω^τ + Δ is the client's model, rebuilt from the model it was sent (``update.start``;
Zhu et al. 2025, "Unlocking the Value of Decentralized Data: A Federated Dual Learning Approach for Model
Aggregation", arXiv 2503.20138v1, §4: "polynomial" staleness with adaptive constant a).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import Range, option
from strategies.aggregation import polynomial_staleness
from strategies.base import Strategy, Update
from strategies.options import STALENESS_EXPONENT
from strategies.robust import NormBoundConfig, clip


@dataclass(frozen=True)
class FedAsyncConfig(NormBoundConfig):
    mixing_alpha: float = option(0.4, Range(0, 1, low_open=True), "mixing weight α (grid 0.2, 0.4, 0.8)")
    staleness_exponent: float = STALENESS_EXPONENT.field()


class FedAsync(Strategy):
    """Immediate staleness-weighted mixing of each arriving model (options: FedAsyncConfig)."""

    name = "fedasync"
    Config = FedAsyncConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.pending: Update | None = None

    def receive(self, update: Update) -> None:
        self.pending = update

    def ready(self) -> bool:
        return self.pending is not None

    def step(self) -> dict[str, float]:
        u, self.pending = self.pending, None
        alpha_t = self.config.mixing_alpha * polynomial_staleness(u.staleness(self.version),
                                                                  self.config.staleness_exponent)
        delta = clip([u.delta], self.config, self.recent_norms)[0]  # one update a step: a norm bound, nothing to trim
        self.params = (1.0 - alpha_t) * self.params + alpha_t * (u.start + delta)
        self.version += 1
        return {"alpha-t": alpha_t}
