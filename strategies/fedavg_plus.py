"""FedAvg+ (FedMerge's baseline "FedAvg followed by local fine-tuning"): FedAvg trains one global model;
at every personalised evaluation each client first fine-tunes it on its own training data for
``finetune-epochs`` epochs of its local recipe, then evaluates the result on its own held-out split.
The fine-tuned models stay on the clients; training rounds are plain FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import COUNT, option
from common.protocol import FINETUNE_EPOCHS
from strategies.base import Payload
from strategies.fedavg import FedAvg


@dataclass(frozen=True)
class FedAvgPlusConfig:
    finetune_epochs: int = option(1, COUNT, "epochs a client fine-tunes the global model before it evaluates it")


class FedAvgPlus(FedAvg):
    """FedAvg, evaluated after each client's local fine-tuning (options: FedAvgPlusConfig)."""

    name = "fedavg-plus"
    Config = FedAvgPlusConfig

    def model_for(self, client: int) -> Payload:
        return Payload(self.params, config={FINETUNE_EPOCHS: self.config.finetune_epochs})
