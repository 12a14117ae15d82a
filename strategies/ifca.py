"""IFCA (Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated Learning",
NeurIPS 2020; a FedMerge baseline): k cluster models θ_1..θ_k. Each dispatched client receives all k,
estimates its cluster as the model of lowest loss on its own training data (Alg. 1, line 6:
ĵ = argmin_j F_i(θ_j)), trains that model and says which it was. The server averages, per cluster,
the updates of the clients that chose it (the paper's model-averaging option, example-weighted as
FedAvg):

    θ_j ← θ_j + Σ_{i ∈ S_j} (n_i / Σ_{i' ∈ S_j} n_i') Δθ_i

A cluster no client chose keeps its model. The k models start from independent initialisations, as
FedMerge's global models do. Evaluation is personalised the same way: a client evaluates the model it
would choose. The payload carries θ_1 as the message's model and θ_2..θ_k as ``candidates``: k models
travel each way down, one up (``model_for``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.datasets import ArrayDataset
from common.params import ParamSpec
from common.training import evaluate
from strategies.aggregation import fedavg_step
from strategies.base import Payload, Unusable, Update
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg
from strategies.fedmerge import independent_inits
from strategies.options import GLOBAL_MODELS

# A payload's extra array: the cluster models after the message's own (θ_2..θ_k, flat); the reply's metric: the
# index of the model the client chose (0 = the message's).
CANDIDATES, CANDIDATE = "candidates", "candidate"


def choose_candidate(model: nn.Module, spec: ParamSpec, candidates: torch.Tensor | None, data: ArrayDataset,
                     seed: int) -> int:
    """Load the model of lowest loss on `data` — the message's own (index 0) or one of the `candidates` (1, 2, …) —
    into `model` and return its index (Alg. 1, line 6); ties: the lowest index."""
    if candidates is None:
        return 0
    models = [spec.flatten(model), *candidates.reshape(-1, spec.numel)]
    losses = []
    for params in models:
        spec.load_into(model, params)
        losses.append(evaluate(model, data, seed=seed)["loss"])
    best = min(range(len(models)), key=losses.__getitem__)
    spec.load_into(model, models[best])
    return best


class IFCAClient(ClientSide):
    """The client trains, or evaluates, the cluster model that fits its training data best, and names it."""

    def prepare(self, task: LocalTask, evaluating: bool) -> None:
        self.chosen = choose_candidate(task.model, task.spec, task.arrays.get(CANDIDATES), task.parts["train"],
                                       task.seed)

    def train(self, task: LocalTask) -> torch.Tensor:
        delta = super().train(task)
        if CANDIDATES in task.arrays:
            task.metrics[CANDIDATE] = self.chosen
        return delta


@dataclass(frozen=True)
class IFCAConfig:
    global_models: int = GLOBAL_MODELS.field()  # k, the cluster models


class IFCA(FedAvg):
    """Clustered FL: k models, each client trains the one that fits its data best (options: IFCAConfig)."""

    name = "ifca"
    Config = IFCAConfig
    client_side = IFCAClient

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.theta: torch.Tensor | None = None  # θ_1..θ_k, k × P
        self.chosen: dict[int, int] = {}  # each client's latest cluster estimate, for the record

    def initialize(self, params: torch.Tensor, spec: ParamSpec, model: nn.Module | None = None) -> None:
        super().initialize(params, spec, model)
        self.theta = independent_inits(model, spec, params, self.config.global_models, self.seed, "IFCA")

    def model_for(self, client: int) -> Payload:
        return Payload(self.theta[0], {CANDIDATES: self.theta[1:]} if len(self.theta) > 1 else {})

    def check(self, update: Update) -> None:
        j = update.metrics.get(CANDIDATE, 0.0)
        if j != int(j) or not 0 <= j < len(self.theta):
            raise Unusable(f"'{CANDIDATE}' = {j} is not a cluster index in [0, {len(self.theta)})")

    def step(self) -> dict[str, float]:
        by_cluster: dict[int, list[Update]] = {}
        for u in self.updates:
            j = int(u.metrics.get(CANDIDATE, 0))
            by_cluster.setdefault(j, []).append(u)
            self.chosen[u.client] = j
        self.theta = torch.stack([fedavg_step(theta_j, by_cluster[j]) if j in by_cluster else theta_j
                                  for j, theta_j in enumerate(self.theta)])
        self.params = self.theta[0]
        self.version += 1
        self.updates, self.closed = [], False
        return {"clusters-chosen": float(len(by_cluster))}

    def client_report(self) -> dict[str, list]:
        """Each client's latest cluster choice (−1: not yet trained)."""
        return {"cluster": [self.chosen.get(c, -1) for c in range(self.num_clients)]}
