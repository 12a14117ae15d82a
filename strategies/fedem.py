"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021; a FedMerge baseline): M shared components θ_1..θ_M; client t models its
data as Σ_m π_tm p_m(y | x) with its own mixture weights π_t. A dispatched client receives every
component and its π_t, runs the E-step, the M-step for π_t and a local update of every component
weighted by the responsibilities (:func:`train_mixture`, :class:`FedEMClient`), and returns all M deltas and the
new π_t. The server averages each component over the step's clients (Alg. 1, line 10):

    θ_m ← θ_m + Σ_t (n_t / Σ n) Δθ_{m,t}

Clients are stateless, so the server keeps every π_t (uniform until the client's first update) and
sends it with the components; a personalised evaluation is the client's mixture prediction. All M
models travel both ways (the message's model is θ_1, the other M − 1 are extra arrays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from common.datasets import ArrayDataset
from common.params import ParamSpec
from common.training import LocalRecipe, derive_seed, make_optimizer, on_model_device, predict, run_epochs
from strategies.aggregation import example_weights, weighted_sum
from strategies.base import Payload, Unusable, Update
from strategies.client import ClientSide, LocalTask
from strategies.fedavg import FedAvg
from strategies.fedmerge import independent_inits
from strategies.options import GLOBAL_MODELS

# The payload's extra arrays: the other components (θ_2..θ_M, flat) and the client's mixture weights π; the
# reply's: the deltas of the other components and the new π.
COMPONENTS, MIXTURE, COMPONENT_DELTAS = "components", "mixture", "component-deltas"



def _per_sample_losses(model: nn.Module, spec: ParamSpec, components: torch.Tensor, x: torch.Tensor,
                       y: torch.Tensor, seed: int) -> torch.Tensor:
    """ℓ(h_θm(x_i), y_i) for every component m and sample i (M × n), in eval mode."""
    rows = []
    for theta_m in components:
        spec.load_into(model, theta_m)
        rows.append(F.cross_entropy(predict(model, x, seed=seed), y, reduction="none"))
    return torch.stack(rows)


def train_mixture(model: nn.Module, spec: ParamSpec, components: torch.Tensor, pi: torch.Tensor,
                  data: ArrayDataset, recipe: LocalRecipe, seed: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                dict[str, float]]:
    """FedEM's local update (Alg. 1, lines 5–8): the E-step q(z_i = m) ∝ π_m exp(−ℓ(h_θm(x_i), y_i)) with the
    received components, the M-step π_m = (1/n) Σ_i q(z_i = m), then each component trained for the recipe's
    epochs on Σ_i q(z_i = m) ℓ(h_θm(x_i), y_i) (batch means). Returns the trained components (M × P), the new π
    and the mixture's negative log-likelihood on the data before training (``train-loss``)."""
    x, y = on_model_device(model, data)
    losses = _per_sample_losses(model, spec, components, x, y, seed)
    log_joint = pi.log()[:, None] - losses  # π_m = 0: log 0 = −inf, q = 0
    q = torch.softmax(log_joint, 0)  # E-step
    trained = []
    for m, theta_m in enumerate(components):
        spec.load_into(model, theta_m)
        model.train()
        opt = make_optimizer(recipe, [p for p in model.parameters() if p.requires_grad])
        run_epochs(opt, len(y), recipe.batch_size, recipe.local_epochs, derive_seed(seed, m),
                   lambda idx: (q[m, idx] * F.cross_entropy(model(x[idx]), y[idx], reduction="none")).mean())
        trained.append(spec.flatten(model))
    nll = float(-torch.logsumexp(log_joint, 0).mean())
    return torch.stack(trained), q.mean(1), {"train-loss": nll}  # M-step: π = mean responsibility


@torch.no_grad()
def evaluate_mixture(model: nn.Module, spec: ParamSpec, components: torch.Tensor, pi: torch.Tensor,
                     data: ArrayDataset, seed: int = 0) -> dict[str, float]:
    """Loss −log Σ_m π_m p_m(y | x) and accuracy of the mixture's prediction argmax_y Σ_m π_m p_m(y | x)."""
    if len(data) == 0:
        return {"loss": 0.0, "accuracy": 0.0}
    x, y = on_model_device(model, data)
    probs = torch.zeros(())
    for pi_m, theta_m in zip(pi, components):
        spec.load_into(model, theta_m)
        probs = probs + pi_m * torch.softmax(predict(model, x, seed=seed), 1)
    return {"loss": float(-probs.gather(1, y[:, None]).clamp_min(1e-30).log().mean()),
            "accuracy": int((probs.argmax(1) == y).sum()) / len(y)}


class FedEMClient(ClientSide):
    """The E-step, the M-step for π and a local update of every component (:func:`train_mixture`); evaluation of
    the client's mixture (:func:`evaluate_mixture`)."""

    def components(self, task: LocalTask) -> torch.Tensor:
        """The M components (M × P): the message's model, then the payload's ``components``."""
        return torch.cat([task.spec.flatten(task.model)[None], task.arrays[COMPONENTS].reshape(-1, task.spec.numel)])

    def prepare(self, task: LocalTask, evaluating: bool) -> None:
        self.theta = self.components(task)  # before anything loads another component into the model

    def train(self, task: LocalTask) -> torch.Tensor:
        trained, pi, metrics = train_mixture(task.model, task.spec, self.theta, task.arrays[MIXTURE],
                                             task.parts["train"], task.recipe, task.train_seed)
        task.metrics.update(metrics)
        task.reply.update({COMPONENT_DELTAS: (trained[1:] - self.theta[1:]).reshape(-1), MIXTURE: pi})
        return trained[0] - self.theta[0]

    def evaluate(self, task: LocalTask, data: ArrayDataset) -> dict[str, float]:
        return evaluate_mixture(task.model, task.spec, self.theta, task.arrays[MIXTURE], data, task.seed)


@dataclass(frozen=True)
class FedEMConfig:
    global_models: int = GLOBAL_MODELS.field()  # M, the components


class FedEM(FedAvg):
    """Mixture of M shared components with per-client weights (options: FedEMConfig; ``num_clients`` rows
    of π)."""

    name = "fedem"
    Config = FedEMConfig
    client_side = FedEMClient

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.num_clients < 1:
            raise ValueError("FedEM keeps every client's mixture weights: give num_clients >= 1")
        M = self.config.global_models
        self.theta: torch.Tensor | None = None  # θ_1..θ_M, M × P
        self.pi = torch.full((self.num_clients, M), 1.0 / M)  # π_t, uniform at the start

    def initialize(self, params: torch.Tensor, spec: ParamSpec, model: nn.Module | None = None) -> None:
        super().initialize(params, spec, model)
        self.theta = independent_inits(model, spec, params, self.config.global_models, self.seed, "FedEM")

    def model_for(self, client: int) -> Payload:
        return Payload(self.theta[0], {COMPONENTS: self.theta[1:].reshape(-1), MIXTURE: self.pi[client]})

    def check(self, update: Update) -> None:
        M, P = self.theta.shape
        pi, deltas = update.arrays.get(MIXTURE), update.arrays.get(COMPONENT_DELTAS)
        if pi is None or deltas is None:
            raise Unusable(f"a FedEM reply carries '{MIXTURE}' and '{COMPONENT_DELTAS}'")
        if pi.shape != (M,) or (pi < 0).any() or abs(float(pi.sum()) - 1) > 1e-3:
            raise Unusable(f"'{MIXTURE}' is not {M} weights summing to 1")
        if deltas.numel() != (M - 1) * P:
            raise Unusable(f"'{COMPONENT_DELTAS}' has {deltas.numel()} values, expected (M − 1) · P = {(M - 1) * P}")

    def step(self) -> dict[str, float]:
        updates = sorted(self.updates, key=lambda u: u.client)  # order-free float sums
        M, P = self.theta.shape
        weights = example_weights([u.num_examples for u in updates])
        deltas = [torch.cat([u.delta[None], u.arrays[COMPONENT_DELTAS].reshape(M - 1, P)]) for u in updates]
        self.theta = torch.stack([self.theta[m] + weighted_sum((d[m] for d in deltas), weights, self.theta[m])
                                  for m in range(M)])
        for u in updates:
            self.pi[u.client] = u.arrays[MIXTURE]
        self.params = self.theta[0]
        self.version += 1
        self.updates, self.closed = [], False
        return {"mixture-max-mean": float(self.pi.max(1).values.mean())}

    def client_report(self) -> dict[str, list]:
        """Each client's mixture weights π_t."""
        return {"mixture": self.pi.tolist()}
