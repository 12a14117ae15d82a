"""FedMerge (Chen, Zhou, Long, Jiang, Zhang, "FedMerge: Federated Model Merging for Personalization",
AAAI 2026, arXiv 2504.06768): d global models Θ_1..Θ_d and merging logits A (m × d) stay on the server;
client i gets only its merged model (Eq. 4, App. D's row softmax)

    θ_i = Σ_j w_ij Θ_j,   w_i = softmax(a_i),

trains it as in FedAvg and returns Δθ_i = θ_i^E − θ_i^0. The server pushes Δθ_i back through the merge
by the chain rule (App. D): with g_i = −Δθ_i standing in for ∂ℓ/∂θ_i,

    ∂L/∂a_ij = p_i w_ij ⟨head(Θ_j − θ_i), head(g_i)⟩       (the inner product over the classifier head, §3)
    ΔΘ_j     = Σ_i C_ij Δθ_i,   C_ij = p_i w_ij / Σ_k p_k w_kj   (the code's column-normalised Eq. 8)

``logit-step = "line-search"`` is the reference code's step on A: the gradient matrix is divided by its
L1 norm, scaled by p_i, and applied in quanta of 0.01 until the largest logit change exceeds
``merge-lr`` (at most 10001 quanta) — here in closed form. ``"gradient"`` is Eq. 11 in App. D's form,
a ← a − merge-lr · ∂L/∂a. ``model-step = "plain"`` is Eq. 8 as printed (ΔΘ_j = Σ_i p_i w_ij Δθ_i).
``merge-order = "logits-first"`` is the code's order (A from the old Θ, then Θ with the new weights);
``"models-first"`` is Algorithm 1's (Θ with the weights sent, then A from the new Θ).

``fixed-models = k`` is the paper's Table 2 ablation "Fixed (k/d)": each client merges k global models
drawn at random (seeded) with equal, frozen weights; only the Θ step runs.

Partial participation and asynchrony (the paper's code runs every client every round): p_i are the
example shares among the step's updates; only their rows of A move; a stale update's logit gradient
is taken at its dispatch — the weights and the heads of Θ it was merged from, which its payload keeps
on the server (``Payload.memo``). Unseen clients keep a_i = 0 and get the uniform merge, which is also
the model :meth:`central_models` evaluates on the server's test split. docs/methods.md has the choices.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.config import POSITIVE, ConfigError, OneOf, Range, option
from common.figures import Figure, Panel
from common.params import ParamSpec
from common.training import derive_seed
from strategies.aggregation import weighted_sum
from strategies.base import Payload, Update
from strategies.fedavg import FedAvg
from strategies.options import GLOBAL_MODELS

QUANTUM = 0.01  # the reference code's line-search step on A
MAX_QUANTA = 10001  # ... and its iteration cap


# d: the models a multi-model method keeps (FedMerge's global models, IFCA's clusters, FedEM's components)


@dataclass(frozen=True)
class FedMergeConfig:
    global_models: int = GLOBAL_MODELS.field()
    merge_lr: float = option(0.01, POSITIVE, "the logits' learning rate (line search: the largest logit change "
                                             "per step; paper and code 0.01)")
    logit_step: str = option("line-search", OneOf(("line-search", "gradient")),
                             "the step on A: the code's L1-normalised line search, or plain gradient (Eq. 11)")
    model_step: str = option("column", OneOf(("column", "plain")),
                             "the step on Θ: client deltas averaged per model (code) or Eq. 8's p_i w_ij sum")
    merge_order: str = option("logits-first", OneOf(("logits-first", "models-first")),
                              "logits then models (code) or models then logits (Algorithm 1)")
    head_arrays: int = option(2, Range(0), "the last parameter arrays the logit gradient's inner product spans "
                                           "(2: the classifier's weight and bias; 0: all)")
    fixed_models: int = option(0, Range(0), "0: learned merges; k: each client merges k random global models "
                                            "with equal weights, frozen (the paper's Table 2 ablation Fixed (k/d))")


def independent_inits(model: nn.Module | None, spec: ParamSpec, first: torch.Tensor, d: int, seed: int,
                      who: str) -> torch.Tensor:
    """Θ (d × P): `first`, then d − 1 fresh initialisations of `model`'s architecture (every module's own
    ``reset_parameters``, seeded). Identical inits would leave A's gradient at zero forever (spec §1.2).
    `who` (the method) is named when the model is missing."""
    if d > 1 and model is None:
        raise ValueError(f"{who} draws its {d} models from the architecture: initialize(..., model)")
    rows = [first.clone()]
    for j in range(1, d):
        fresh = copy.deepcopy(model).cpu()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, j))
            for module in fresh.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        rows.append(spec.flatten(fresh))
    return torch.stack(rows)


def logit_gradient(w: torch.Tensor, heads: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """∂ℓ_i/∂a_ij = w_ij ⟨Θ_j − θ_i, g_i⟩ for every j (App. D), with θ_i = Σ_j w_ij Θ_j: on the head slices,
    `heads` (d × h) the Θ_j and `g` (h) the client's gradient. The row sums to 0 (softmax is shift-free)."""
    return w * ((heads - w @ heads) @ g)


def line_search(P: torch.Tensor, lr: float) -> tuple[torch.Tensor, int]:
    """The code's quantised line search in closed form: A − QUANTUM·n·P with n the fewest quanta that move
    some logit by more than `lr` (capped at MAX_QUANTA): n = ⌊lr / (QUANTUM · max|P|)⌋ + 1."""
    top = float(P.abs().max())
    n = MAX_QUANTA if top == 0 else min(math.floor(lr / (QUANTUM * top)) + 1, MAX_QUANTA)
    return -QUANTUM * n * P, n


class FedMerge(FedAvg):
    """FedMerge: d global models merged per client with learned softmax weights (options: FedMergeConfig;
    m = ``num_clients`` rows of logits). A round's updates are collected as FedAvg's are."""

    name = "fedmerge"
    Config = FedMergeConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.num_clients < 1:
            raise ValueError("FedMerge keeps one row of merging logits per client: give num_clients >= 1")
        d, k = self.config.global_models, self.config.fixed_models
        if k > d:
            raise ConfigError("fixed-models", k, f"at most global-models = {d}")
        self.theta: torch.Tensor | None = None  # Θ, d × P
        self.logits = torch.zeros(self.num_clients, d)  # A, zeros → uniform w
        if k:  # Fixed (k/d): −inf outside k random models per client, so w_i = 1/k on them, 0 elsewhere
            for i in range(self.num_clients):
                chosen = torch.randperm(d, generator=torch.Generator().manual_seed(derive_seed(self.seed, 1, i)))[:k]
                self.logits[i] = float("-inf")
                self.logits[i, chosen] = 0.0

    def initialize(self, params: torch.Tensor, spec: ParamSpec, model: nn.Module | None = None) -> None:
        super().initialize(params, spec, model)
        self.theta = independent_inits(model, spec, params, self.config.global_models, self.seed, "FedMerge")
        self.params = self.theta.mean(0)

    @property
    def head(self) -> slice:
        k = self.config.head_arrays
        return slice(self.spec.numel - sum(self.spec.sizes[-k:]) if k else 0, self.spec.numel)

    def weights(self, client: int) -> torch.Tensor:
        return torch.softmax(self.logits[client], 0)

    def model_for(self, client: int) -> Payload:
        w = self.weights(client)
        return Payload(w @ self.theta, memo={"weights": w, "heads": self.theta[:, self.head].clone()})

    def central_models(self) -> dict[str, torch.Tensor]:
        """The uniform merge: what a client that never trained gets."""
        return {"global": self.params}

    @classmethod
    def figures(cls, rows: list[dict[str, Any]], client_rows: list[dict[str, Any]]) -> dict[str, Figure]:
        """``merge-weights.png``: softmax(A) at four evaluations (partition ids in order: clusters are id blocks)."""
        weights = [r for r in client_rows if "merge-weights" in r]
        if not weights:
            return {}
        picks = sorted({0, len(weights) // 3, 2 * len(weights) // 3, len(weights) - 1})
        return {"merge-weights.png": Figure("merging weights softmax(A)", [
            Panel("global model j", "client i", image=weights[i]["merge-weights"], title=f"round {weights[i]['round']}")
            for i in picks])}

    def client_report(self) -> dict[str, list]:
        """softmax(A): row i is client i's merging weights (the paper's Fig. 4 heatmaps)."""
        return {"merge-weights": torch.softmax(self.logits, 1).tolist()}

    # -- the server's step ---------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        updates = sorted(self.updates, key=lambda u: u.client)  # order-free float sums
        before = self.logits.clone()
        stats: dict[str, float] = {}
        if self.config.merge_order == "logits-first":
            stats = self.logit_step(updates, [u.sent.memo["heads"] for u in updates])
            self.model_step(updates, [self.weights(u.client) for u in updates])
        else:
            self.model_step(updates, [u.sent.memo["weights"] for u in updates])
            stats = self.logit_step(updates, [self.theta[:, self.head]] * len(updates))
        self.params = self.theta.mean(0)
        self.version += 1
        self.updates, self.closed = [], False
        w = torch.softmax(self.logits, 1)
        entropy = -(w * w.clamp_min(1e-30).log()).sum(1)
        moved = (self.logits - before).nan_to_num(0.0)  # −inf − −inf under Fixed (k/d)
        return {"logit-change-max": float(moved.abs().max()), "weight-max": float(w.max()),
                "weight-entropy-mean": float(entropy.mean()), **stats}

    def logit_step(self, updates: list[Update], heads: list[torch.Tensor]) -> dict[str, float]:
        """A ← A − step(P), P_ij = p_i ∂ℓ_i/∂a_ij, for the rows of this step's clients."""
        if self.config.fixed_models:
            return {}
        h = self.head
        n = torch.tensor([float(u.num_examples) for u in updates], dtype=torch.float64)
        p = (n / n.sum()).float()
        G = torch.stack([logit_gradient(u.sent.memo["weights"], hd, -u.delta[h])
                         for u, hd in zip(updates, heads)])
        rows = torch.tensor([u.client for u in updates])
        if self.config.logit_step == "gradient":
            self.logits.index_add_(0, rows, -self.config.merge_lr * p[:, None] * G)
            return {}
        total = float(G.abs().sum())
        if total == 0:  # d = 1, or no update moved the head: nothing to learn (the code would divide 0/0)
            return {"line-search-quanta": 0.0}
        change, quanta = line_search(p[:, None] * (G / total), self.config.merge_lr)
        self.logits.index_add_(0, rows, change)
        return {"line-search-quanta": float(quanta)}

    def model_step(self, updates: list[Update], weights: list[torch.Tensor]) -> None:
        """Θ_j ← Θ_j + Σ_i C_ij Δθ_i, weights in float64 (with d = 1 and columns normalised: FedAvg's bytes)."""
        n = torch.tensor([float(u.num_examples) for u in updates], dtype=torch.float64)
        nw = n[:, None] * torch.stack(weights).double()  # n_i w_ij ∝ p_i w_ij
        # a model no client of the step merges (Fixed (k/d)) gets no update
        C = nw / nw.sum(0).clamp_min(1e-300) if self.config.model_step == "column" else nw / n.sum()
        C = C.float()
        self.theta = torch.stack([theta_j + weighted_sum((u.delta for u in updates), C[:, j].tolist(), theta_j)
                                  for j, theta_j in enumerate(self.theta)])
