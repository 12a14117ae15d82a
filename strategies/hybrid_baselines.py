"""The hybrid baselines with in-domain server data (Feddle papers, §4 of docs/specs): Center, Fed+FT, HFCL.

All three train the global model on the server's labelled data 𝒟_S with the one training loop
(``common.training.train_on_server``, the clients' loop on the server's device) and close on
``close_round`` like FedAvg:

    Center   ω^{k+1} = train(ω^k; 𝒟_S, E_s epochs, lr_s)                  client updates are ignored
    Fed+FT   ω^{k+1} = train(ω^k + Σ_j n_j/Σn · Δ_j; 𝒟_S, E_s, lr_s)       FedAvg, then fine-tuning
    HFCL     ω^{k+1} = ω^k + Σ_{j ∪ S} n_j/(Σn + |𝒟_S|) · Δ_j,  Δ_S = train(ω^k; 𝒟_S, client recipe) − ω^k

E_s = ``server-train-epochs`` and lr_s = ``server-train-lr``; batch size, optimizer and momentum
are the clients'. HFCL (Elbir et al., "Hybrid federated and centralized learning", EUSIPCO 2021)
has no hyperparameter of its own: the server is one more client with the clients' recipe.
Under asynchrony "the step's updates" are those that arrived since the last aggregation,
whatever version they started from (no staleness weighting), as for FedAvg.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from common.training import server_seed, train_on_server
from strategies.aggregation import fedavg_step
from strategies.base import Update
from strategies.fedavg import FedAvg
from strategies.options import SERVER_TRAIN_EPOCHS, SERVER_TRAIN_LR
from strategies.robust import RobustConfig

SERVER_CLIENT = -1  # the client id HFCL gives the server's own update (sorts first in FedAvg's sum)

# The server's own training schedule, shared with FedDF (where it schedules the distillation).


@dataclass(frozen=True)
class ServerScheduleConfig:
    server_train_lr: float = SERVER_TRAIN_LR.field()
    server_train_epochs: int = SERVER_TRAIN_EPOCHS.field()


class _ServerTrained(FedAvg):
    """FedAvg plus training on the server's labelled data, shared by the three baselines."""

    server_data = "in-domain"

    def server_train(self, params: torch.Tensor, server: Any, version: int, epochs: int | None = None,
                     lr: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """`params` trained on the server data with the clients' recipe (`epochs`, `lr` replaced when
        given), seeded by the run seed and `version` (the one the step starts from)."""
        if self.model is None or self.recipe is None:
            raise RuntimeError(f"{type(self).__name__} trains on the server: initialize it with the model and "
                               "give it the clients' recipe")
        started = time.perf_counter()
        changes = {k: v for k, v in (("local_epochs", epochs), ("lr", lr)) if v is not None}
        trained, stats = train_on_server(self.model, self.spec, params, server,
                                         dataclasses.replace(self.recipe, **changes), server_seed(self.seed, version))
        return trained, {"server-train-loss": stats["train-loss"], "server-train-accuracy": stats["train-accuracy"],
                         "server-samples": float(len(server)), "server-seconds": time.perf_counter() - started}


class Center(_ServerTrained):
    """Trains only on the server's data: each step, E_s epochs at lr_s from ω; client updates are
    received, counted and dropped (options: ServerScheduleConfig)."""

    name = "center"
    Config = ServerScheduleConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.ignored = 0  # client updates received (and not used) in this step

    def receive(self, update: Update) -> None:
        self.ignored += 1

    def close_round(self) -> None:
        self.closed = True  # the server's training does not wait for clients: one step per round

    def step(self) -> dict[str, float]:
        self.params, stats = self.server_train(self.params, self.server, self.version, self.config.server_train_epochs,
                                               self.config.server_train_lr)
        self.version += 1
        metrics = {**stats, "ignored-updates": float(self.ignored)}
        self.closed, self.ignored = False, 0
        return metrics


@dataclass(frozen=True)
class FedFTConfig(ServerScheduleConfig, RobustConfig):
    """Fed+FT's server schedule, and FedAvg's defences for its aggregate (strategies/robust.py)."""


class FedFT(_ServerTrained):
    """Fed+FT: FedAvg's aggregate of the step's updates, then E_s epochs of fine-tuning at lr_s on the
    server's data (options: FedFTConfig)."""

    name = "fedft"
    Config = FedFTConfig

    def step(self) -> dict[str, float]:
        merged, count = fedavg_step(self.params, self.updates, self.config, self.recent_norms), len(self.updates)
        self.params, stats = self.server_train(merged, self.server, self.version, self.config.server_train_epochs,
                                               self.config.server_train_lr)
        self.version += 1
        self.updates, self.closed = [], False
        return {**stats, "updates": float(count)}


class HFCL(_ServerTrained):
    """HFCL: the server trains like one more client (the clients' recipe) from ω on its data, and its
    update Δ_S joins the step's client updates in FedAvg's mean with weight |𝒟_S| (options: FedAvg's defences,
    strategies/robust.py, the server's update among the rest)."""

    name = "hfcl"

    def step(self) -> dict[str, float]:
        trained, stats = self.server_train(self.params, self.server, self.version)
        server_update = Update(SERVER_CLIENT, self.version, trained - self.params, len(self.server))
        count = len(self.updates)
        self.params = fedavg_step(self.params, [*self.updates, server_update], self.config, self.recent_norms)
        self.version += 1
        self.updates, self.closed = [], False
        return {**stats, "updates": float(count)}
