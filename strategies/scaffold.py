"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020), Algorithm 1 with option II, its control variates kept on the server (clients are stateless).

The server holds the model x, its control variate c and every client's c_i (zero until it first reports).
A client gets x and c − c_i (the payload array ``correction``) and runs K local steps of the corrected
gradient (client objective ``scaffold``, line 10):

    y_i ← y_i − η_l (g_i(y_i) − c_i + c)

and returns Δy_i = y_i − x. Option II's new control variate (line 12) needs nothing else:

    c_i⁺ = c_i − c + (x − y_i) / (K η_l) = −(c − c_i) − Δy_i / (K η_l)

with the c − c_i it was sent (``update.sent``; under asynchrony c may have moved since) and K from its
example count and the clients' recipe. At the end of a round over the updates S (lines 16–17):

    x ← x + η_g / |S| · Σ_{i∈S} Δy_i,      c ← c + 1/N · Σ_{i∈S} (c_i⁺ − c_i)

The paper's local optimiser is plain SGD (``optimizer = "sgd"``, ``momentum = 0``); with momentum or Adam
the correction is still added to every gradient, but option II's estimate is no longer the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.config import NoOptions
from common.objectives import BatchLoss, Received, added_to_every_gradient, objective
from common.params import ParamSpec
from common.training import local_steps
from strategies.base import Payload
from strategies.client import ClientSide
from strategies.fedavg import FedAvg
from strategies.options import SERVER_LR


@objective("scaffold")
def scaffold(received: Received, options: NoOptions) -> BatchLoss:
    """SCAFFOLD's corrected local step (Alg. 1 line 10): y ← y − η_l (g_i(y) − c_i + c). The server sends c − c_i
    as the payload array ``correction``, and the loss adds it to every gradient."""
    return added_to_every_gradient(received, "correction")


class ScaffoldClient(ClientSide):
    """Local training with SCAFFOLD's corrected step, whatever the run's ``local-objective``."""

    objective = "scaffold"


@dataclass(frozen=True)
class ScaffoldConfig:
    server_lr: float = SERVER_LR.field()  # η_g: the key FedBuff, CA2FL and Feddle use for it


class Scaffold(FedAvg):
    """SCAFFOLD with server-side control variates (options: ScaffoldConfig; N = ``num_clients``). A round's
    updates are collected as FedAvg's are; the step is SCAFFOLD's."""

    name = "scaffold"
    Config = ScaffoldConfig
    client_side = ScaffoldClient

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.num_clients < 1 or self.recipe is None:
            raise ValueError("SCAFFOLD needs num_clients (N) and the clients' recipe (η_l and K)")
        self.c: torch.Tensor | None = None  # the server's control variate
        self.c_i: dict[int, torch.Tensor] = {}  # each client's control variate

    def initialize(self, params: torch.Tensor, spec: ParamSpec, model: Any = None) -> None:
        super().initialize(params, spec, model)
        self.c = torch.zeros_like(params)

    def model_for(self, client: int) -> Payload:
        c_i = self.c_i.get(client)
        correction = self.c - c_i if c_i is not None else self.c
        return Payload(self.params, {"correction": correction})

    def step(self) -> dict[str, float]:
        updates = sorted(self.updates, key=lambda u: u.client)  # order-free float sums
        delta_x, delta_c = torch.zeros_like(self.params), torch.zeros_like(self.c)
        for u in updates:
            k = local_steps(u.num_examples, self.recipe.batch_size, self.recipe.local_epochs)
            c_plus = -u.sent.arrays["correction"] - u.delta / (k * self.recipe.lr)  # option II
            delta_c += c_plus - self.c_i.get(u.client, torch.zeros_like(self.c))
            delta_x += u.delta
            self.c_i[u.client] = c_plus
        self.params = self.params + self.config.server_lr / len(updates) * delta_x
        self.c = self.c + delta_c / self.num_clients
        self.version += 1
        self.updates, self.closed = [], False
        return {"control-norm": float(self.c.norm())}
