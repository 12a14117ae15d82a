"""FedAvg+ (FedMerge's baseline "FedAvg followed by local fine-tuning"): FedAvg trains one global model;
at every personalised evaluation each client first fine-tunes it on its own training data for
``finetune-epochs`` epochs of its local recipe, then evaluates the result on its own held-out split.
The fine-tuned models stay on the clients; training rounds are plain FedAvg.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import COUNT, option
from common.protocol import VERSION
from common.training import EVAL_STREAM, derive_seed, train
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg

# The client side's key: epochs the client fine-tunes the received model on its own training data before it
# evaluates it.
FINETUNE_EPOCHS = "finetune-epochs"


class FedAvgPlusClient(ClientSide):
    """Before an evaluation, ``finetune-epochs`` of the local recipe (cross-entropy) on the client's training data,
    seeded by (run seed, client, version)."""

    keys = (FINETUNE_EPOCHS,)

    def prepare(self, task: LocalTask, evaluating: bool) -> None:
        if evaluating and (epochs := int(task.config[FINETUNE_EPOCHS])):
            recipe = dataclasses.replace(task.recipe, local_epochs=epochs)
            train(task.model, task.parts["train"], recipe, device=task.device,
                  seed=derive_seed(task.seed, EVAL_STREAM, task.partition, int(task.config[VERSION])))


@dataclass(frozen=True)
class FedAvgPlusConfig:
    finetune_epochs: int = option(1, COUNT, "epochs a client fine-tunes the global model before it evaluates it")


class FedAvgPlus(FedAvg):
    """FedAvg, evaluated after each client's local fine-tuning (options: FedAvgPlusConfig)."""

    name = "fedavg-plus"
    Config = FedAvgPlusConfig
    client_side = FedAvgPlusClient
