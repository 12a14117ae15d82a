"""Client objectives: the loss a client minimises in its local training, chosen by ``local-objective``.

An objective is a function registered by name, with the dataclass of its options (their keys join
the run configuration and travel in every train message). When a local run starts, the function
gets what the client received — the model as dispatched, the payload's extra arrays, its options —
and returns the batch loss ``loss(x, y, logits) -> Tensor`` that ``common.training.train``
minimises. A method whose clients do more than cross-entropy (FedProx's proximal term, FedDUAL's
adaptive KL, mixing's transferred gradient) is one strategy file plus one function here. A loss that
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

from common.config import NoOptions, OneOf, Range, make_options, option
from common.protocol import CENTRAL_GRADIENT

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


@objective("scaffold")
def scaffold(received: Received, options: NoOptions) -> BatchLoss:
    """SCAFFOLD's corrected local step (Karimireddy et al., ICML 2020, Alg. 1 line 10):
    y ← y − η_l (g_i(y) − c_i + c). The server sends c − c_i as the payload array ``correction``
    (``strategies/scaffold.py``), and the loss adds it to every gradient."""
    return added_to_every_gradient(received, "correction")


@objective("gradient-transfer")
def gradient_transfer(received: Received, options: NoOptions) -> BatchLoss:
    """Gradient transfer (Augenstein et al., mixing paper, Alg. 4): x ← CLIENTOPT(x, g + g̃) at every local
    step, g̃ = w · g_c the central gradient the server sends as ``central-gradient`` (``strategies/mixing.py``)."""
    return added_to_every_gradient(received, CENTRAL_GRADIENT)


BETA_MODES = ("epoch", "reference")


@dataclass(frozen=True)
class FedDualConfig:
    beta_mode: str = option("epoch", OneOf(BETA_MODES), "FedDUAL's β = σ(A_local − A_global): `epoch` measures "
                            "A_local on the client's data after every local epoch (the paper's reading); "
                            "`reference`: the code's β ≡ 0.5 and a KL term without gradient (loss = CE / 2)")


def flat_log_softmax(params: list[torch.Tensor]) -> torch.Tensor:
    """log softmax(flatten(weights)) over every weight of the model at once (FedDUAL, Eq. 6)."""
    return F.log_softmax(torch.cat([w.reshape(-1) for w in params]), 0)


class AdaptiveLoss(LocalLoss):
    """FedDUAL's adaptive local objective (Sahoo et al., FedDUAL, §4.0.1, Eqs. 6–10):

        p = softmax(flatten(w_local)),  q = softmax(flatten(w_global))              (6)
        f̃_k(w) = (1 − β) · CE_k(w) + β · D_KL(p ‖ q)                                (7, 8)
        β = σ(A_local − A_global)                                                     (9)

    A_global is the received model's accuracy on the client's training data before local training (the
    paper); A_local, which the paper does not time, is re-measured after every local epoch (``epoch``), so β
    is σ(0) = 0.5 in the first epoch. Accuracies are fractions, as in the code: β ∈ [σ(−1), σ(1)].
    ``reference`` is the released code: both accuracies are measured before training (β ≡ 0.5) and the KL
    term is a constant with no gradient, so the loss is CE / 2.
    """

    def __init__(self, received: Received, options: FedDualConfig) -> None:
        if received.accuracy is None:
            raise ValueError("FedDUAL's adaptive loss measures accuracies on the client's data: Received.accuracy "
                             "is unset")
        self.model, self.measure, self.metrics = received.model, received.accuracy, received.metrics
        self.params = [p for p in received.model.parameters() if p.requires_grad]
        self.reference = options.beta_mode == "reference"
        self.log_q = flat_log_softmax(received.start)  # the frozen global model; nothing extra is downloaded
        self.beta, self.betas = 0.5, [0.5]  # A_local = A_global before the first epoch: β = σ(0)
        self.metrics["feddual-beta"] = self.beta
        if not self.reference:
            self.a_global = self.accuracy()
            self.metrics.update({"feddual-a-global": self.a_global, "feddual-a-local": self.a_global})

    def accuracy(self) -> float:
        """The model's accuracy on the client's data now (eval mode); the model goes back to train mode."""
        acc = self.measure()
        self.model.train()
        return acc

    def kl(self) -> torch.Tensor:
        """D_KL(p ‖ q) = Σ_i p_i (log p_i − log q_i) (Eq. 7), differentiable in the local weights."""
        log_p = flat_log_softmax(self.params)
        return (log_p.exp() * (log_p - self.log_q)).sum()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits, y)
        if self.reference:
            return 0.5 * ce
        return (1.0 - self.beta) * ce + self.beta * self.kl()  # Eq. 8 (β a constant within the epoch)

    def epoch_end(self) -> None:
        if self.reference:
            return
        self.a_local = self.accuracy()
        self.beta = float(torch.sigmoid(torch.tensor(self.a_local - self.a_global)))  # Eq. 9
        self.betas.append(self.beta)
        # β of the epochs trained (the last re-measure only reports A_local)
        self.metrics.update({"feddual-a-local": self.a_local,
                             "feddual-beta": sum(self.betas[:-1]) / max(len(self.betas) - 1, 1)})


@objective("feddual", FedDualConfig)
def feddual(received: Received, options: FedDualConfig) -> BatchLoss:
    """FedDUAL's adaptive loss (:class:`AdaptiveLoss`); the server side is ``strategies/feddual.py``."""
    return AdaptiveLoss(received, options)
