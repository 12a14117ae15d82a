"""FedDUAL's server side (Sahoo et al., "FedDUAL: A Dual-Strategy with Adaptive Loss and Dynamic Aggregation
for Mitigating Data Heterogeneity in Federated Learning", §4.0.2, Eqs. 13–16, Algorithm 1).

The last few parameter arrays ("dynamic", S_dynamic) are aggregated by a Wasserstein barycenter of what the
clients sent, the others ("naive") by averaging (Alg. 1, line 22). The barycenter is the paper's iteration

    γ_k = exp(−W(p̄, p_k) / ε)                                                      (15)
    p̄ ← Σ_k λ_k γ_k p_k / Σ_k λ_k γ_k                                               (16)

from p̄ = the mean, with equal λ_k, where W is the 1-D Wasserstein-1 distance between the value
distributions of two flat vectors, mean(|sort(u) − sort(v)|) for equal lengths (the code calls
scipy's ``wasserstein_distance``; POT's ``wasserstein_1d`` is the same number). The result is a reweighted
average of the clients' vectors with weights λ̃_k ∝ λ_k γ_k.

What the barycenter is taken of (``dynamic-source``), the paper's "gradients ∇_k":

* ``delta`` (the paper's reading): the clients' updates Δ_k = θ_k − θ^τ. Synchronously θ^g + b̄ = Σ λ̃_k θ_k,
  a reweighted average of the client weights, and ε → ∞ is plain averaging.
* ``loss-gradient`` (the released code): the gradient of each client's summed cross-entropy over all its
  data at its trained model; the clients' trained dynamic weights are discarded and θ^g[j] ← θ^g[j] − b̄.

The naive arrays take θ + Σ_k w_k Δ_k with w_k = 1/K (``naive-weighting = uniform``: the paper's and the
code's mean) or by examples (FedAvg). Synchronously that is Alg. 1's mean of the client models; under
asynchrony, a step's updates are those that arrived in it (as FedAvg's), each applied as a delta from
the model it started from. ``dynamic-arrays = 0`` with ``naive-weighting = examples`` is FedAvg exactly.

``wb-stable`` computes λ̃ in the log domain (a softmax of −W/ε). The code's raw ``exp(−W/ε)`` underflows
to exactly 0 for every client once all W > ~745 ε (7.45e-3 at ε = 1e-5): the barycenter is then
0/(0 + 1e-10) = 0 and the array keeps its value; ``wb-stable = false`` reproduces that, and the step
reports it (``wb-underflow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from common.codecs import SPARSE, WireCodecs
from common.config import COUNT, POSITIVE, ConfigError, OneOf, Range, option
from common.datasets import ArrayDataset
from common.objectives import BatchLoss, LocalLoss, Received, objective
from common.training import on_model_device
from strategies.aggregation import example_weights, weighted_sum
from strategies.base import Unusable, Update
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg

BETA_MODES = ("epoch", "reference")


@dataclass(frozen=True)
class AdaptiveLossConfig:
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

    def __init__(self, received: Received, options: AdaptiveLossConfig) -> None:
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


@objective("feddual", AdaptiveLossConfig)
def feddual(received: Received, options: AdaptiveLossConfig) -> BatchLoss:
    """FedDUAL's adaptive loss (:class:`AdaptiveLoss`); the server side is ``strategies/feddual.py``."""
    return AdaptiveLoss(received, options)


# FedDUAL's code (dynamic-source = loss-gradient): the client sends the gradient of the summed cross-entropy over its
# whole training data, at its trained model, w.r.t. its last dynamic-arrays parameter arrays (flat), as the reply's
# extra array of this name.
LOSS_GRADIENT = "loss-gradient"


def loss_gradient(model: nn.Module, data: ArrayDataset, arrays: int, batch_size: int = 1024) -> torch.Tensor:
    """∇ Σ_i CE(model(x_i), y_i), the SUMMED cross-entropy over all of `data`, with respect to the model's last
    `arrays` trainable parameter arrays, flat, in eval mode (FedDUAL's code: the server steps its last layers
    along the barycenter of these gradients, taken at each client's trained model)."""
    params = [p for p in model.parameters() if p.requires_grad][-arrays:]
    x, y = on_model_device(model, data)
    model.eval()
    grads = [torch.zeros_like(p) for p in params]
    for idx in torch.arange(len(y)).split(batch_size):  # the sum is additive over batches
        ce = F.cross_entropy(model(x[idx]), y[idx], reduction="sum")
        for g, part in zip(grads, torch.autograd.grad(ce, params)):
            g += part
    return torch.cat([g.reshape(-1) for g in grads]).detach()


class FedDualClient(ClientSide):
    """Local training with the run's objective (``feddual``: the adaptive loss), then, with ``dynamic-source``
    ``loss-gradient``, the summed cross-entropy gradient of the trained model's last ``dynamic-arrays`` arrays."""

    keys = ("dynamic-source", "dynamic-arrays")

    def train(self, task: LocalTask) -> torch.Tensor:
        delta = super().train(task)
        if task.config["dynamic-source"] == LOSS_GRADIENT and (arrays := int(task.config["dynamic-arrays"])):
            task.reply[LOSS_GRADIENT] = loss_gradient(task.model, task.parts["train"], arrays)
        return delta


@dataclass(frozen=True)
class FedDualConfig:
    dynamic_arrays: int = option(2, Range(0), "trailing parameter arrays aggregated by the Wasserstein barycenter "
                                 "(the code: 2, the final layer's weight and bias); 0 = none")
    dynamic_source: str = option("delta", OneOf(("delta", "loss-gradient")),
                                 "the barycenter of the clients' updates (the paper's reading) or of their summed "
                                 "cross-entropy gradients at the trained model (the code)")
    wb_eps: float = option(1e-5, POSITIVE, "ε of the barycenter weights γ = exp(−W/ε) (Eq. 15; paper and code 1e-5)")
    wb_iters: int = option(150, COUNT, "barycenter iterations (paper 150, code 1000)")
    wb_stable: bool = option(True, None, "log-domain weights; false = the code's raw exp(−W/ε), which underflows to "
                             "no update when every W > ~745 ε")
    naive_weighting: str = option("uniform", OneOf(("uniform", "examples")),
                                  "the other arrays: the clients' unweighted mean (Alg. 1, the code) or by examples "
                                  "(FedAvg)")


def w1(u: torch.Tensor, v_sorted: torch.Tensor) -> torch.Tensor:
    """1-D Wasserstein-1 distances between the value distribution of `u` (n) and those of the rows of
    `v_sorted` (K × n, each row sorted): mean(|sort(u) − sort(v)|) (Eq. 14 with p = 1 on the real line)."""
    return (torch.sort(u).values - v_sorted).abs().mean(-1)


def wasserstein_barycenter(vectors: torch.Tensor, eps: float, iters: int,
                           stable: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The paper's barycenter iteration (Eqs. 15–16) over the rows of `vectors` (K × n) with equal λ_k = 1/K,
    started from their mean, in float64. Returns the barycenter (float32), the final weights λ̃ (K; zeros
    after an underflow) and whether every γ_k underflowed to 0 (raw mode only: the barycenter is then 0)."""
    v = vectors.double()
    lam = torch.full((len(v),), 1.0 / len(v), dtype=torch.float64)
    v_sorted = torch.sort(v, dim=1).values  # the client vectors never change: sort them once
    bary, weights, underflow = v.mean(0), lam, False
    for _ in range(iters):
        distance = w1(bary, v_sorted)
        if stable:
            weights = torch.softmax(lam.log() - distance / eps, 0)
            bary = weights @ v
        else:  # the code: λγ / (Σ λγ + 1e-10), where γ = exp(−W/ε) may be exactly 0 for every client
            g = lam * torch.exp(-distance / eps)
            total = g.sum()
            underflow = bool(total == 0)
            weights = g / total if total > 0 else torch.zeros_like(g)
            bary = (g @ v) / (total + 1e-10)
    return bary.float(), weights, underflow


class FedDual(FedAvg):
    """FedDUAL's dynamic aggregation (options: FedDualConfig). A round's updates are collected as FedAvg's are;
    its clients train with the ``feddual`` objective (:class:`AdaptiveLoss`) when the run's
    ``local-objective`` says so, so the paper's ablations (adaptive loss only, dynamic aggregation only) are
    the same two switches."""

    name = "feddual"
    Config = FedDualConfig
    client_side = FedDualClient

    @classmethod
    def codec_refusal(cls, config: FedDualConfig, codecs: WireCodecs) -> tuple[str, str] | None:
        """Eq. 15 weighs each client's update of the dynamic arrays by the distribution of its values; topk
        delivers a few of them and zeros for the rest (sent later through its error feedback): that distribution
        is not the client's, and W would measure its sparsity."""
        if codecs.update_codec in SPARSE and config.dynamic_arrays and config.dynamic_source == "delta":
            return ("update-codec", "a codec that keeps every value of an update (none, fp16, int8): FedDUAL's "
                    "barycenter (Eq. 15) weighs each client's update by the distribution of its values, and "
                    f"{codecs.update_codec} zeros all but a few of them; or dynamic-source = 'loss-gradient', or "
                    "dynamic-arrays = 0")
        return None

    def initialize(self, params: torch.Tensor, spec: Any, model: Any = None) -> None:
        super().initialize(params, spec, model)
        if self.config.dynamic_arrays > len(spec.sizes):
            raise ConfigError("dynamic-arrays", self.config.dynamic_arrays,
                              f"at most the model's {len(spec.sizes)} trainable parameter arrays")

    @property
    def _dynamic(self) -> list[slice]:
        """Where each dynamic array sits in the flat parameters (the trailing ones)."""
        sizes = self.spec.sizes[len(self.spec.sizes) - self.config.dynamic_arrays:]
        end, out = self.spec.numel, []
        for size in reversed(sizes):
            out.insert(0, slice(end - size, end))
            end -= size
        return out

    def check(self, update: Update) -> None:
        if self.config.dynamic_source != "loss-gradient" or not self.config.dynamic_arrays:
            return
        grad = update.arrays.get(LOSS_GRADIENT)
        size = sum(s.stop - s.start for s in self._dynamic)
        if grad is None or grad.shape != (size,):
            raise Unusable(f"'{LOSS_GRADIENT}' must be the {size} gradients of the dynamic arrays, got "
                           f"{None if grad is None else tuple(grad.shape)}")

    def step(self) -> dict[str, float]:
        updates = sorted(self.updates, key=lambda u: u.client)  # order-free float sums
        weights = (example_weights([u.num_examples for u in updates]) if self.config.naive_weighting == "examples"
                   else [1.0 / len(updates)] * len(updates))
        new = self.params + weighted_sum((u.delta for u in updates), weights, self.params)  # Alg. 1, line 22
        underflows, top, distances = 0, [], []
        offset = self.spec.numel - sum(s.stop - s.start for s in self._dynamic)  # where the gradients' layout starts
        for part in self._dynamic:
            if self.config.dynamic_source == "delta":
                vectors = torch.stack([u.delta[part] for u in updates])
            else:
                grad = slice(part.start - offset, part.stop - offset)
                vectors = torch.stack([u.arrays[LOSS_GRADIENT][grad] for u in updates])
            bary, lam, underflow = wasserstein_barycenter(vectors, self.config.wb_eps, self.config.wb_iters,
                                                          self.config.wb_stable)
            # Alg. 1, line 19: θ^g[j] ← θ^g[j] − ∇̄_j, with ∇_k = −Δ_k in delta mode
            new[part] = self.params[part] + bary if self.config.dynamic_source == "delta" else self.params[part] - bary
            underflows += underflow
            top.append(float(lam.max()))
            distances.append(float(w1(bary.double(), torch.sort(vectors.double(), 1).values).mean()))
        self.params = new
        self.version += 1
        self.updates, self.closed = [], False
        metrics = {}
        if self._dynamic:
            metrics = {"wb-underflow": underflows, "wb-max-weight": sum(top) / len(top),
                       "wb-w1": sum(distances) / len(distances)}
        betas = [u.metrics["feddual-beta"] for u in updates if "feddual-beta" in u.metrics]
        if betas:
            metrics["client-beta"] = sum(betas) / len(betas)
        return metrics
