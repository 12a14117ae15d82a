"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017): the new global model is the example-weighted mean of the client models.

With updates Δ_j = ω_j − ω^k this is (Zhu et al. 2025, "Unlocking the Value of Decentralized Data: A Federated
Dual Learning Approach for Model Aggregation", arXiv 2503.20138v1, Eq. 2):

    ω^{k+1} = ω^k + Σ_j (|D_j| / Σ_i |D_i|) · Δ_j
"""

from __future__ import annotations

from typing import Any

from strategies.aggregation import fedavg_step
from strategies.base import Strategy, Update
from strategies.robust import RobustConfig


class FedAvg(Strategy):
    """FedAvg: when the runner closes a round, merge every update that arrived in it (options: the defences of
    strategies/robust.py, off by default).

    Under asynchrony (σ > 0) the round's updates are those that arrived in the step, whatever version
    they started from; a step with none leaves ω as it is.
    """

    name = "fedavg"
    Config = RobustConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.updates: list[Update] = []
        self.closed = False

    def receive(self, update: Update) -> None:
        self.updates.append(update)

    def close_round(self) -> None:
        self.closed = bool(self.updates)

    def ready(self) -> bool:
        return self.closed

    def step(self) -> dict[str, float]:
        self.params = fedavg_step(self.params, self.updates, self.config, self.recent_norms)
        self.version += 1
        self.updates, self.closed = [], False
        return {}
