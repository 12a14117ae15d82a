"""Local training, no federation (FedMerge's "Local" baseline): every client keeps training its own model.

Clients are stateless, so the server keeps each client's model θ_i and sends it back at the client's next
dispatch: θ_i ← θ_i^sent + Δθ_i. Nothing is shared; the models are compared with personalised evaluation
(each θ_i on its client's own held-out split). The server-split metrics are those of the common
initialisation, which no client changes.
"""

from __future__ import annotations

from typing import Any

import torch

from common.config import NoOptions
from strategies.base import Payload, Update
from strategies.fedavg import FedAvg


class Local(FedAvg):
    """Every client's own model, trained only on its own data. No options."""

    name = "local"
    Config = NoOptions  # nothing is averaged

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.local: dict[int, torch.Tensor] = {}  # θ_i of every client that trained

    def model_for(self, client: int) -> Payload:
        return Payload(self.local.get(client, self.params))

    def receive(self, update: Update) -> None:
        self.local[update.client] = update.start + update.delta
        super().receive(update)

    def step(self) -> dict[str, float]:
        self.version += 1
        self.updates, self.closed = [], False
        return {"clients-trained": float(len(self.local))}
