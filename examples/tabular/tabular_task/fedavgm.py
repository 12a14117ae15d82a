"""A method of one's own on hybridfl's contract, in one's own package: FedAvg with server momentum (FedAvgM; Hsu, Qi
and Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification", 2019,
Alg. 1), whose clients clip the norm of their update (the clipping of DP-FedAvg, McMahan et al., ICLR 2018, without
the noise).

    Δ̄ = Σ_j (n_j / Σ_i n_i) · Δ_j        the round's example-weighted mean update (FedAvg's)
    v ← β · v + Δ̄                          the server's momentum buffer (Alg. 1, β = server-momentum)
    ω ← ω + v                              (server learning rate 1, the paper's setting)
    Δ_j ← Δ_j · min(1, C / ‖Δ_j‖₂)         each client, before it replies (C = clip-norm; 0: no clipping)

A run names it by import path, ``strategy = "tabular_task.fedavgm:FedAvgM"``, in a preset, on the command line or in
a Flower app's config; its keys (``server-momentum``, ``clip-norm``) are checked like hybridfl's own. Every node
imports this module by the same path to run :class:`ClippingClient`, so the package must be installed (or on the
``PYTHONPATH``) wherever the ClientApps run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.config import Range, option
from strategies.aggregation import fedavg_step
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg

CLIP_NORM = "clip-norm"  # the client side's key: every message carries it


class ClippingClient(ClientSide):
    """Local training with the run's recipe; the update is scaled to an L2 norm of at most ``clip-norm``, and its
    norm before clipping is reported (``delta-norm``)."""

    keys = (CLIP_NORM,)

    def train(self, task: LocalTask) -> torch.Tensor:
        delta = super().train(task)
        norm, bound = float(delta.norm()), float(task.config[CLIP_NORM])
        task.metrics["delta-norm"] = norm
        return delta * (bound / norm) if 0 < bound < norm else delta


@dataclass(frozen=True)
class FedAvgMConfig:
    server_momentum: float = option(0.9, Range(0, 1), "β, the server momentum of FedAvgM (Alg. 1)")
    clip_norm: float = option(0.0, Range(0), "C: each client scales its update to an L2 norm of at most C (0: off)")


class FedAvgM(FedAvg):
    """FedAvg's rounds (its updates collected as FedAvg collects them) with a momentum step on the server."""

    Config = FedAvgMConfig
    client_side = ClippingClient

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.momentum: torch.Tensor | None = None  # v: state, so a resumed run keeps it

    def step(self) -> dict[str, float]:
        mean_update = fedavg_step(torch.zeros_like(self.params), self.updates)  # Δ̄
        v = mean_update if self.momentum is None else self.config.server_momentum * self.momentum + mean_update
        self.params, self.momentum = self.params + v, v
        self.version += 1
        self.updates, self.closed = [], False
        return {"momentum-norm": float(v.norm())}
