"""CA2FL (Wang et al., "Tackling the Data Heterogeneity in Asynchronous Federated Learning with
Cached Update Calibration", ICLR 2024).

The server caches each client's latest update h_i (zero before its first report) and their mean
h̄ = (1/N) Σ_i h_i over all N clients. Updates are buffered; for a buffer S of K updates

    v = h̄ + (1/K) Σ_{i ∈ S} (Δ_i − h_i^old),     ω ← ω + η · v

where h_i^old and h̄ are the caches as they were when the step began; after the step h_i ← Δ_i.
The calibration replaces each stale contribution by its change against the client's last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.params import ParamSpec
from strategies.base import Strategy, Update
from strategies.options import BUFFER_SIZE, SERVER_LR
from strategies.robust import NormBoundConfig, clip


@dataclass(frozen=True)
class CA2FLConfig(NormBoundConfig):
    buffer_size: int = BUFFER_SIZE.field()
    server_lr: float = SERVER_LR.field()


class CA2FL(Strategy):
    """Cached-update calibration on a FedBuff-style buffer (options: CA2FLConfig; N = ``num_clients``)."""

    name = "ca2fl"
    Config = CA2FLConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.num_clients < 1:
            raise ValueError("CA2FL averages its caches over all N clients: give num_clients >= 1")
        self.cache: dict[int, torch.Tensor] = {}  # h_i as at the start of the current step
        self.next_cache: dict[int, torch.Tensor] = {}  # h_i after this step
        self.cache_sum: torch.Tensor | None = None  # Σ_i h_i
        self.calibrated: torch.Tensor | None = None  # Σ_{i∈S} (Δ_i − h_i^old)
        self.count = 0

    def initialize(self, params: torch.Tensor, spec: ParamSpec, model: Any = None) -> None:
        super().initialize(params, spec, model)
        self.cache_sum = torch.zeros_like(params)
        self.calibrated = torch.zeros_like(params)

    def receive(self, update: Update) -> None:
        # clipped as it arrives: it is cached, and the cache's mean enters every later step
        delta = clip([update.delta], self.config, self.recent_norms)[0]
        old = self.cache.get(update.client)
        self.calibrated += delta if old is None else delta - old
        self.next_cache[update.client] = delta
        self.count += 1

    def ready(self) -> bool:
        return self.count >= self.config.buffer_size

    def step(self) -> dict[str, float]:
        h_bar = self.cache_sum / self.num_clients
        self.params = self.params + self.config.server_lr * (h_bar + self.calibrated / self.count)
        for client, delta in self.next_cache.items():
            old = self.cache.get(client)
            self.cache_sum += delta if old is None else delta - old
            self.cache[client] = delta
        self.next_cache, self.count = {}, 0
        self.calibrated.zero_()
        self.version += 1
        return {}
