"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021; a FedMerge baseline): M shared components θ_1..θ_M; client t models its
data as Σ_m π_tm p_m(y | x) with its own mixture weights π_t. A dispatched client receives every
component and its π_t, runs the E-step, the M-step for π_t and a local update of every component
weighted by the responsibilities (``common.training.train_mixture``), and returns all M deltas and the
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

from common.params import ParamSpec
from common.protocol import COMPONENT_DELTAS, COMPONENTS, MIXTURE
from strategies.aggregation import example_weights, weighted_sum
from strategies.base import Payload, Unusable, Update
from strategies.fedavg import FedAvg
from strategies.fedmerge import GLOBAL_MODELS, independent_inits


@dataclass(frozen=True)
class FedEMConfig:
    global_models: int = GLOBAL_MODELS.field()  # M, the components


class FedEM(FedAvg):
    """Mixture of M shared components with per-client weights (options: FedEMConfig; ``num_clients`` rows
    of π)."""

    name = "fedem"
    Config = FedEMConfig

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

    def step(self, server: Any = None) -> dict[str, float]:
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
