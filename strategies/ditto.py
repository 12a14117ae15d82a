"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021,
Alg. 1): a global model w trained by FedAvg, and on every client a personal model v_k it keeps, trained on

    h_k(v_k; w) = F_k(v_k) + λ/2 ‖v_k − w^t‖²                                   (Eq. 2)

    for s local iterations:  v_k ← v_k − η (∇F_k(v_k) + λ (v_k − w^t))          (Alg. 1, lines 7–8)

next to the global model's local update from the same w^t, which it sends (lines 5–6, 9). v_k never leaves the
client: it lives in the node's ``Context.state`` across rounds. A personalised evaluation evaluates v_k (the
received w^t on a client that has not trained yet). The personal run uses the local recipe (epochs, batch size,
optimizer, η) and the proximal objective with μ = λ; v_k starts from the first global model the client receives
(the paper's v_k^0 = w^0 on clients the first round reaches; docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import Range, option
from common.objectives import Received, build_loss
from common.training import derive_seed, train
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg

LAMBDA = "ditto-lambda"  # λ, the client side's key
PERSONAL = "ditto-personal"  # the node's Context.state record holding v_k


@dataclass(frozen=True)
class DittoConfig:
    ditto_lambda: float = option(0.1, Range(0), "λ pulling each personal model toward the global one (Eq. 2; "
                                 "the paper tunes it in {0.05, 0.1, 0.2, 0.5, 1, 2}); 0 = local training alone")


class DittoClient(ClientSide):
    """The global model's local update, sent; then the personal model's, kept in the node's state."""

    stateful = True
    keys = (LAMBDA,)

    def personal(self, task: LocalTask) -> torch.Tensor | None:
        """v_k from the node's state, on the model's device; None before the client's first training."""
        if PERSONAL not in task.state:
            return None
        return task.spec.from_record(task.state[PERSONAL]).to(task.device)

    def prepare(self, task: LocalTask, evaluating: bool) -> None:
        if evaluating and (v := self.personal(task)) is not None:
            task.spec.load_into(task.model, v)

    def train(self, task: LocalTask) -> torch.Tensor:
        w_t = task.spec.flatten(task.model)
        anchor = [p.detach().clone() for p in task.model.parameters() if p.requires_grad]  # w^t, the pull's anchor
        delta = super().train(task)  # w_k^t: FedAvg's local update from w^t (lines 5–6)
        received = Received(task.model, anchor)
        task.spec.load_into(task.model, v if (v := self.personal(task)) is not None else w_t)
        loss = build_loss("proximal", {"proximal-mu": float(task.config[LAMBDA])}, received)
        stats = train(task.model, task.parts["train"], task.recipe, seed=derive_seed(task.train_seed, 1), loss=loss,
                      device=task.device)
        task.state[PERSONAL] = task.spec.to_record(task.spec.flatten(task.model))
        task.metrics.update({"personal-train-loss": stats["train-loss"]})
        return delta


class Ditto(FedAvg):
    """FedAvg of the clients' global-model updates; every client also trains and keeps its own personal model
    (options: DittoConfig)."""

    name = "ditto"
    Config = DittoConfig
    client_side = DittoClient
