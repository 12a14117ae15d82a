"""CA2FL (Wang et al., "Tackling the Data Heterogeneity in Asynchronous Federated Learning with
Cached Update Calibration", ICLR 2024).

The server caches each client's latest update h_i (zero before its first report) and their mean
h̄ = (1/N) Σ_i h_i over all N clients. Updates are buffered; for a buffer S of K updates

    v = h̄ + (1/K) Σ_{i ∈ S} (Δ_i − h_i^old),     ω ← ω + η · v

where h_i^old and h̄ are the caches as they were when the step began; after the step h_i ← Δ_i.
The calibration replaces each stale contribution by its change against the client's last one.
"""

from __future__ import annotations

from typing import Any

import torch

from strategies.base import AsyncStrategy, Update


class CA2FL(AsyncStrategy):
    """Cached-update calibration on a FedBuff-style buffer.

    Args:
        num_clients: N, the clients whose caches make up h̄.
        buffer_size: K (paper grid {10, 20, 50}).
        server_lr: η (paper grid {0.01, 0.1, 1}).
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    def __init__(self, num_clients: int, buffer_size: int = 10, server_lr: float = 1.0, *,
                 train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        super().__init__(train_config, clients_per_round, seed)
        self.num_clients, self.buffer_size, self.server_lr = num_clients, buffer_size, server_lr
        self.cache: dict[int, torch.Tensor] = {}  # h_i as at the start of the current step
        self._next_cache: dict[int, torch.Tensor] = {}  # h_i after this step
        self._cache_sum: torch.Tensor | None = None  # Σ_i h_i
        self._calibrated: torch.Tensor | None = None  # Σ_{i∈S} (Δ_i − h_i^old)
        self._count = 0

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> CA2FL:
        return cls(cfg.num_clients, cfg.buffer_size, cfg.server_lr, **common)

    def initialize(self, params: torch.Tensor, spec) -> None:
        super().initialize(params, spec)
        self._cache_sum = torch.zeros_like(params)
        self._calibrated = torch.zeros_like(params)

    def receive(self, update: Update) -> None:
        old = self.cache.get(update.client)
        self._calibrated += update.delta if old is None else update.delta - old
        self._next_cache[update.client] = update.delta
        self._count += 1

    def ready(self) -> bool:
        return self._count >= self.buffer_size

    def aggregate(self, server: Any = None) -> torch.Tensor:
        h_bar = self._cache_sum / self.num_clients
        self.params = self.params + self.server_lr * (h_bar + self._calibrated / self._count)
        for client, delta in self._next_cache.items():
            old = self.cache.get(client)
            self._cache_sum += delta if old is None else delta - old
            self.cache[client] = delta
        self._next_cache, self._count = {}, 0
        self._calibrated.zero_()
        self.version += 1
        return self.params

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "buffer-size": self.buffer_size, "server-lr": self.server_lr,
                "num-clients": self.num_clients}
