"""Client objectives: the loss a client minimises in its local training, chosen by ``local-objective``.

An objective is a function registered by name, with the dataclass of its options (their keys join
the run configuration and travel in every train message). When a local run starts, the function
gets what the client received — the model as dispatched, the payload's extra arrays, its options —
and returns the batch loss ``loss(x, y, logits) -> Tensor`` that ``common.training.train``
minimises. Here: cross-entropy and FedProx's proximal term; a method's own objective (SCAFFOLD's correction,
FedDUAL's adaptive KL, mixing's transferred gradient) is registered in its strategy's file. A loss that
changes over the local run (FedDUAL's β, re-measured after every epoch) is a :class:`LocalLoss`:
``train`` calls its ``epoch_end()`` after each local epoch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
    accuracy: Callable[[], float] | None = None  # the model's accuracy on the client's training data, measured now
    metrics: dict[str, float] = field(default_factory=dict)  # what the objective reports (joins the reply's metrics)

    def flat_to_params(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat vector in the layout of the trainable parameters (a payload array), one tensor per parameter."""
        return [chunk.reshape(p.shape) for chunk, p in zip(torch.split(flat, [p.numel() for p in self.start]),
                                                           self.start)]


class LocalLoss(ABC):
    """A batch loss with state over one local run: ``train`` calls it per batch, as ``loss(x, y, logits)``,
    and calls :meth:`epoch_end` after every local epoch."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The batch's loss."""

    def epoch_end(self) -> None:
        """One local epoch is over (the model is in train mode and must be left so)."""


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


def added_to_every_gradient(received: Received, array: str) -> BatchLoss:
    """Cross-entropy plus the linear term ⟨w, v⟩, which adds exactly v, the payload array `array` (flat, in the
    trainable parameters' layout), to every local gradient."""
    params = [p for p in received.model.parameters() if p.requires_grad]
    v = received.flat_to_params(received.arrays[array])

    def loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y) + sum((w * c).sum() for w, c in zip(params, v))

    return loss
