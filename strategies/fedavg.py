"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017): the new global model is the example-weighted mean of the client models.

With updates Δ_j = ω_j − ω^k this is (Feddle 004, Eq. 2):

    ω^{k+1} = ω^k + Σ_j (|D_j| / Σ_i |D_i|) · Δ_j
"""

from __future__ import annotations

from typing import Any

import torch

from strategies.base import HybridStrategy, Update, example_weights, weighted_sum


class FedAvg(HybridStrategy):
    """FedAvg: when the runner closes a round, merge every update that arrived in it.

    Args:
        train_config: local recipe sent to every client.
        clients_per_round: clients sampled per round when Flower's ``start`` drives the strategy.
        seed: seeds that sampling.
    """

    def __init__(self, *, train_config: dict[str, Any] | None = None, clients_per_round: int = 10,
                 seed: int = 0) -> None:
        super().__init__(train_config, clients_per_round, seed)
        self._updates: list[Update] = []
        self._closed = False

    def receive(self, update: Update) -> None:
        self._updates.append(update)

    def close_round(self) -> None:
        self._closed = bool(self._updates)  # a round with no update leaves ω as it is

    def ready(self) -> bool:
        return self._closed and bool(self._updates)

    def aggregate(self, server: Any = None) -> torch.Tensor:
        # Sorting by client makes the float sum independent of reply arrival order.
        updates = sorted(self._updates, key=lambda u: u.client)
        self.params = self.params + weighted_sum((u.delta for u in updates), example_weights(updates), self.params)
        self.version += 1
        self._updates, self._closed = [], False
        return self.params
