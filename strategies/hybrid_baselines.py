"""The hybrid baselines with in-domain server data (Feddle papers, §4 of docs/specs): Center, Fed+FT, HFCL.

All three train the global model on the server's labelled data 𝒟_S with the clients' own loop
(``strategies.server_training.train_on_server``) and close on ``close_round`` like FedAvg:

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

import time
from typing import Any

import torch
from torch import nn

from strategies.base import Update
from strategies.fedavg import FedAvg
from strategies.server_training import recipe_from, require_in_domain, server_seed, train_on_server

SERVER_CLIENT = -1  # the client id HFCL gives the server's own update (sorts first in FedAvg's sum)


class _ServerTrained(FedAvg):
    """FedAvg plus the model, the server-training call and its metrics, shared by the three baselines."""

    name = "server training"

    def __init__(self, *, train_config: dict[str, Any] | None = None, clients_per_round: int = 10,
                 seed: int = 0) -> None:
        super().__init__(train_config=train_config, clients_per_round=clients_per_round, seed=seed)
        self.model: nn.Module | None = None
        self.last: dict[str, float] = {}

    def attach(self, model: nn.Module) -> None:
        self.model = model

    def check(self, server: Any) -> None:
        require_in_domain(server, self.name)
        if self.model is None:
            raise RuntimeError(f"{self.name} needs attach(model) before it can train on the server's data")

    def server_train(self, params: torch.Tensor, server: Any, version: int, epochs: int | None = None,
                     lr: float | None = None) -> torch.Tensor:
        """`params` trained on the server data, seeded by the run seed and `version` (the one the step starts from)."""
        started = time.perf_counter()
        trained, stats = train_on_server(self.model, self.spec, params, server,
                                         recipe_from(self.train_config, epochs, lr),
                                         server_seed(self.seed, version))
        self.last = {"server-train-loss": stats["train-loss"], "server-train-accuracy": stats["train-accuracy"],
                     "server-samples": float(len(server)), "server-seconds": time.perf_counter() - started}
        return trained

    def metrics(self) -> dict[str, float]:
        return dict(self.last)


class _ServerSchedule(_ServerTrained):
    """A baseline with its own server training schedule: lr_s = ``server-train-lr``, E_s = ``server-train-epochs``."""

    def __init__(self, server_train_lr: float = 1e-3, server_train_epochs: int = 1, *,
                 train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        super().__init__(train_config=train_config, clients_per_round=clients_per_round, seed=seed)
        self.server_train_lr, self.server_train_epochs = server_train_lr, server_train_epochs

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> _ServerSchedule:
        return cls(cfg.server_train_lr, cfg.server_train_epochs, **common)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "server-train-lr": self.server_train_lr,
                "server-train-epochs": self.server_train_epochs}


class Center(_ServerSchedule):
    """Trains only on the server's data: each step, E_s epochs at lr_s from ω; client updates are
    received, counted and dropped.

    Args:
        server_train_lr: lr_s (papers' grid 1e-5, 1e-4, 1e-3).
        server_train_epochs: E_s, epochs per step (papers' grid 10, 20, 50 in total; here per step).
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    name = "Center"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ignored = 0  # client updates received (and not used) since the start
        self._step_ignored = 0

    def receive(self, update: Update) -> None:
        self.ignored += 1
        self._step_ignored += 1

    def close_round(self) -> None:
        self._closed = True  # the server's training does not wait for clients: one step per round

    def ready(self) -> bool:
        return self._closed

    def aggregate(self, server: Any = None) -> torch.Tensor:
        self.check(server)
        self.params = self.server_train(self.params, server, self.version, self.server_train_epochs,
                                        self.server_train_lr)
        self.last["ignored-updates"] = float(self._step_ignored)
        self.version += 1
        self._closed, self._step_ignored = False, 0
        return self.params


class FedFT(_ServerSchedule):
    """Fed+FT: FedAvg's aggregate of the step's updates, then E_s epochs of fine-tuning at lr_s on the
    server's data.

    Args:
        server_train_lr: lr_s (papers' grid 1e-5, 1e-4, 1e-3).
        server_train_epochs: E_s (papers' grid 1, 10, 20).
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    name = "Fed+FT"


    def aggregate(self, server: Any = None) -> torch.Tensor:
        self.check(server)
        count, version = len(self._updates), self.version
        merged = super().aggregate(server)  # FedAvg: ω + Σ n_j/Σn Δ_j, version + 1
        self.params = self.server_train(merged, server, version, self.server_train_epochs, self.server_train_lr)
        self.last["updates"] = float(count)
        return self.params


class HFCL(_ServerTrained):
    """HFCL: the server trains like one more client (the clients' recipe) from ω on its data, and its
    update Δ_S joins the step's client updates in FedAvg's mean with weight |𝒟_S|.

    Args:
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`; no extra hyperparameter.
    """

    name = "HFCL"

    def aggregate(self, server: Any = None) -> torch.Tensor:
        self.check(server)
        trained = self.server_train(self.params, server, self.version)
        self._updates.append(Update(SERVER_CLIENT, self.version, trained - self.params, len(server)))
        self.last["updates"] = float(len(self._updates) - 1)
        return super().aggregate(server)
