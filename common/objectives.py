"""Client objectives: the loss a client minimises in its local training, chosen by ``local-objective``.

An objective is a function registered by name, with the dataclass of its options (their keys join
the run configuration and travel in every train message). When a local run starts, the function
gets what the client received — the model as dispatched, the payload's extra arrays, its options —
and returns the batch loss ``loss(x, y, logits) -> Tensor`` that ``common.training.train``
minimises. A method whose clients do more than cross-entropy (FedProx's proximal term, FedDUAL's
adaptive KL, mixing's transferred gradient) is one strategy file plus one function here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from common.config import NoOptions, Range, make_options, option

BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Received:
    """What a client holds when its local run starts."""

    model: nn.Module  # with the dispatched parameters loaded; it is the model being trained
    start: list[torch.Tensor]  # detached copies of its trainable parameters as received (w^t)
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)  # the payload's extra arrays
    reply: dict[str, torch.Tensor] = field(default_factory=dict)  # what the objective sends back (the reply's extras)

    def flat_to_params(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat vector in the layout of the trainable parameters (a payload array), one tensor per parameter."""
        return [chunk.reshape(p.shape) for chunk, p in zip(torch.split(flat, [p.numel() for p in self.start]),
                                                           self.start)]


@dataclass(frozen=True)
class Objective:
    name: str
    build: Callable[[Received, Any], BatchLoss]
    Config: type


OBJECTIVES: dict[str, Objective] = {}


def objective(name: str, config: type = NoOptions) -> Callable:
    """Register ``fn(received, options) -> loss(x, y, logits)`` as the client objective `name`."""

    def register(fn: Callable[[Received, Any], BatchLoss]) -> Callable[[Received, Any], BatchLoss]:
        if name in OBJECTIVES:
            raise ValueError(f"client objective {name!r} is registered twice")
        OBJECTIVES[name] = Objective(name, fn, config)
        return fn

    return register


def build_loss(name: str, values: dict[str, Any], received: Received) -> BatchLoss:
    """The batch loss of objective `name`, its options read from `values` (a train message's config)."""
    if name not in OBJECTIVES:
        raise KeyError(f"unknown client objective {name!r}; known: {sorted(OBJECTIVES)}")
    entry = OBJECTIVES[name]
    return entry.build(received, make_options(entry.Config, values))


@objective("cross-entropy")
def cross_entropy(received: Received, options: NoOptions) -> BatchLoss:
    """Plain cross-entropy on the client's labels (FedAvg's local objective)."""
    return lambda x, y, logits: F.cross_entropy(logits, y)


@dataclass(frozen=True)
class ProximalConfig:
    proximal_mu: float = option(0.01, Range(0), "μ of the term μ/2 ‖w − w_received‖² (FedProx; "
                                "FedMerge's code uses 0.01)")


@objective("proximal", ProximalConfig)
def proximal(received: Received, options: ProximalConfig) -> BatchLoss:
    """FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, Eq. 2):

        h(w) = F_k(w) + μ/2 ‖w − w^t‖²,   w^t = the model the client received.
    """
    params = [p for p in received.model.parameters() if p.requires_grad]
    mu = options.proximal_mu

    def loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        drift = sum(((w - w_t) ** 2).sum() for w, w_t in zip(params, received.start))
        return F.cross_entropy(logits, y) + 0.5 * mu * drift

    return loss


@objective("scaffold")
def scaffold(received: Received, options: NoOptions) -> BatchLoss:
    """SCAFFOLD's corrected local step (Karimireddy et al., ICML 2020, Alg. 1 line 10):
    y ← y − η_l (g_i(y) − c_i + c). The linear term ⟨w, c − c_i⟩ adds exactly c − c_i to every gradient;
    the server sends c − c_i as the payload array ``correction`` (``strategies/scaffold.py``)."""
    params = [p for p in received.model.parameters() if p.requires_grad]
    correction = received.flat_to_params(received.arrays["correction"])

    def loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y) + sum((w * c).sum() for w, c in zip(params, correction))

    return loss
