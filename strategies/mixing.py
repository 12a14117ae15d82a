"""Data mixing: federated training that mixes in the server's central data (Augenstein, Hard, Partridge,
Mathews, "Jointly Learning from Decentralized (Federated) and Centralized Data to Mitigate Distribution
Shift", NeurIPS 2021 DistShift workshop, App. A). Each is generalised FedAvg (Alg. 1) with added steps:

    Δ = Σ_i p_i Δ_i / Σ_i p_i                  p_i = the client's example count
    x^(t+1) = SERVEROPT(x^(t), −Δ, η_s)         sgd: x + η_s Δ;  adam: FedAdam (Reddi et al., ICLR 2021)

* :class:`ParallelTraining` (Alg. 2): the server trains J steps on its central data from x^(t)
  (CENTRALOPT) and merges: x^(t+1) = x^(t) + η_m (α Δ_c + (1 − α) Δ_f), Δ_c = x_c − x^(t),
  Δ_f = SERVEROPT's step. No extra payload.
* :class:`ExampleTransfer` (Alg. 3): every dispatched client also gets a batch of central examples, drawn
  for it, and trains on its data and them together (this round only).
* :class:`GradientTransfer` (Alg. 4): every dispatched client also gets g_c, the central loss's gradient at
  the model it is sent (one central batch per model version), and adds w · g_c to every local gradient.

Under asynchrony a stale client answers what it was sent: the example batch or the central gradient of its
own dispatch travel with its payload. SERVEROPT's state (FedAdam's moments) sees only the federated Δ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from common.config import COUNT, POSITIVE, NoOptions, OneOf, Option, Range, option
from common.datasets import ArrayDataset
from common.objectives import BatchLoss, Received, added_to_every_gradient, objective
from common.training import derive_seed, server_seed, train_on_server
from strategies.aggregation import example_weights, weighted_sum
from strategies.base import Payload
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg
from strategies.options import SERVER_LR

SERVER_OPTIMIZER = Option("sgd", OneOf(("sgd", "adam")), "SERVEROPT of generalised FedAvg: `sgd` (x + η_s Δ; η_s = 1 "
                          "is FedAvg) or `adam` (FedAdam: β1 0.9, β2 0.99, τ 1e-3)")
FEDADAM = (0.9, 0.99, 1e-3)  # β1, β2, τ (Reddi et al., "Adaptive Federated Optimization", ICLR 2021)


@dataclass(frozen=True)
class ServerOptConfig:
    server_optimizer: str = SERVER_OPTIMIZER.field()
    server_lr: float = SERVER_LR.field()


class GeneralizedFedAvg(FedAvg):
    """FedAvg with a server optimizer (Alg. 1): the step's example-weighted mean update Δ is the negative
    pseudo-gradient of SERVEROPT. With ``sgd`` and ``server-lr`` 1 it is FedAvg byte for byte. The base of the
    three mixing strategies."""

    name = "fedopt"
    Config = ServerOptConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.moments: tuple[torch.Tensor, torch.Tensor] | None = None  # FedAdam's m and v

    def federated_step(self) -> torch.Tensor:
        """Δ_f, SERVEROPT's step from this step's updates (x_f = x + Δ_f)."""
        updates = sorted(self.updates, key=lambda u: u.client)  # order-free float sums
        delta = weighted_sum((u.delta for u in updates), example_weights([u.num_examples for u in updates]),
                             self.params)
        if self.config.server_optimizer == "sgd":
            return self.config.server_lr * delta
        beta1, beta2, tau = FEDADAM
        m, v = self.moments or (torch.zeros_like(delta), torch.zeros_like(delta))
        m = beta1 * m + (1 - beta1) * delta
        v = beta2 * v + (1 - beta2) * delta * delta
        self.moments = (m, v)
        return self.config.server_lr * m / (v.sqrt() + tau)

    def step(self) -> dict[str, float]:
        self.params = self.params + self.federated_step()
        return self.advance()

    def advance(self) -> dict[str, float]:
        count = len(self.updates)
        self.version += 1
        self.updates, self.closed = [], False
        return {"updates": float(count)}

    def central_batch(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`size` central examples (x, y) drawn without replacement (all of them if fewer), seeded; on the CPU."""
        x, y = self.server.data.x, self.server.data.y
        pick = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:size].numpy()
        return torch.from_numpy(x[pick]), torch.from_numpy(y[pick])


@dataclass(frozen=True)
class ParallelConfig(ServerOptConfig):
    central_steps: int = option(10, COUNT, "J: the server's training steps on its central data per step (batches of "
                                "the clients' size and optimizer)")
    central_lr: float = option(1e-3, POSITIVE, "η_c, CENTRALOPT's learning rate (the clients' optimizer; restarted "
                               "every step, as x_c restarts from the global model)")
    central_weight: float = option(0.5, Range(0, 1), "α, the central delta's weight in the merge (0: FedAvg's step; "
                                   "1: central training only)")
    central_merge_lr: float = option(1.0, POSITIVE, "η_m, MERGEOPT's (SGD) learning rate")


class ParallelTraining(GeneralizedFedAvg):
    """Generalised FedAvg in parallel with central training (Alg. 2; options: ParallelConfig)."""

    name = "parallel-training"
    Config = ParallelConfig
    server_data = "in-domain"

    def step(self) -> dict[str, float]:
        if self.model is None or self.recipe is None:
            raise RuntimeError("ParallelTraining trains on the server: initialize it with the model and the "
                               "clients' recipe")
        delta_f = self.federated_step()
        recipe = dataclasses.replace(self.recipe, lr=self.config.central_lr)
        x_c, stats = train_on_server(self.model, self.spec, self.params, self.server, recipe,
                                     server_seed(self.seed, self.version), max_steps=self.config.central_steps)
        alpha = self.config.central_weight
        mixed = alpha * (x_c - self.params) + (1 - alpha) * delta_f  # Δ^(t) = α Δ_c + (1 − α) Δ_f
        self.params = self.params + self.config.central_merge_lr * mixed  # MERGEOPT (SGD, η_m)
        return {**self.advance(), "central-train-loss": stats["train-loss"]}


# Payload arrays: a dispatch's central examples (images and labels, as floats) that the client trains on with its
# own data this round (example transfer), and the central gradient it adds to every local step (gradient transfer).
CENTRAL_X, CENTRAL_Y, CENTRAL_GRADIENT = "central-x", "central-y", "central-gradient"


def with_central_examples(data: ArrayDataset, arrays: dict[str, torch.Tensor]) -> ArrayDataset:
    """The client's data plus the central examples of the payload, for this round only."""
    if CENTRAL_X not in arrays:
        return data
    x, y = arrays[CENTRAL_X].cpu().numpy(), arrays[CENTRAL_Y].round().long().cpu().numpy()
    if x.shape[1:] != data.x.shape[1:] or len(x) != len(y) or (len(y) and (y.min() < 0 or y.max() >= data.num_classes)):
        raise ValueError(f"central examples of shape {x.shape} with labels in [{y.min()}, {y.max()}] do not fit this "
                         f"client's data {data.x.shape[1:]} with {data.num_classes} classes")
    return ArrayDataset(np.concatenate([data.x, x]), np.concatenate([data.y, y]), data.num_classes)


class ExampleTransferClient(ClientSide):
    """Trains on its own data and the payload's central examples together."""

    def training_data(self, task: LocalTask) -> ArrayDataset:
        return with_central_examples(task.parts["train"], task.arrays)


@objective("gradient-transfer")
def gradient_transfer(received: Received, options: NoOptions) -> BatchLoss:
    """Gradient transfer (Alg. 4): x ← CLIENTOPT(x, g + g̃) at every local step, g̃ = w · g_c the central gradient
    the server sends as ``central-gradient``."""
    return added_to_every_gradient(received, CENTRAL_GRADIENT)


class GradientTransferClient(ClientSide):
    """Local training with the transferred gradient added to every step (the ``gradient-transfer`` objective)."""

    objective = "gradient-transfer"


@dataclass(frozen=True)
class ExampleConfig(ServerOptConfig):
    transfer_examples: int = option(32, Range(0), "central examples sent with every dispatch (|B|; 0 = FedAvg)")


class ExampleTransfer(GeneralizedFedAvg):
    """Generalised FedAvg with example transfer (Alg. 3; options: ExampleConfig): each dispatch carries its own
    batch of central examples (``central-x``, ``central-y``), drawn for (version, client); the client trains
    on its data and them."""

    name = "example-transfer"
    Config = ExampleConfig
    client_side = ExampleTransferClient
    server_data = "in-domain"

    def model_for(self, client: int) -> Payload:
        if not self.config.transfer_examples:
            return Payload(self.params)
        x, y = self.central_batch(self.config.transfer_examples, derive_seed(self.seed, self.version, client))
        return Payload(self.params, {CENTRAL_X: x, CENTRAL_Y: y.float()})


@dataclass(frozen=True)
class GradientConfig(ServerOptConfig):
    transfer_batch: int = option(64, COUNT, "central examples the transferred gradient is computed on (one batch "
                                 "per model version)")
    gradient_weight: float = option(1.0, Range(0), "w: the client adds w · g_c to every local gradient (the paper: "
                                    "1; 0 = FedAvg)")


class GradientTransfer(GeneralizedFedAvg):
    """Generalised FedAvg with gradient transfer (Alg. 4; options: GradientConfig): g_c = ∇ of the mean
    cross-entropy on one central batch at x^(t), computed once per version on the server's device and sent
    with every dispatch as ``central-gradient`` (w · g_c); the clients' ``gradient-transfer`` objective adds it
    to every local step."""

    name = "gradient-transfer"
    Config = GradientConfig
    client_side = GradientTransferClient
    server_data = "in-domain"

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.gradient: tuple[int, torch.Tensor] | None = None  # (version, w · g_c at that version)

    def central_gradient(self) -> torch.Tensor:
        """w · g_c at the current model, computed once per version."""
        if self.gradient is None or self.gradient[0] != self.version:
            if self.model is None:
                raise RuntimeError("GradientTransfer computes a gradient on the server: initialize it with the model")
            x, y = self.central_batch(self.config.transfer_batch, server_seed(self.seed, self.version))
            device = torch.device(self.server.device)
            self.model.to(device)
            self.spec.load_into(self.model, self.params.to(device))
            self.model.eval()  # the gradient at x^(t) as it is; no BatchNorm statistics move
            params = [p for p in self.model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(F.cross_entropy(self.model(x.to(device)), y.to(device)), params)
            g_c = torch.cat([g.reshape(-1) for g in grads]).cpu()
            self.gradient = (self.version, self.config.gradient_weight * g_c)
        return self.gradient[1]

    def model_for(self, client: int) -> Payload:
        return Payload(self.params, {CENTRAL_GRADIENT: self.central_gradient()})
