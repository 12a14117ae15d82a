"""FedDF — ensemble distillation for model fusion (Lin et al., "Ensemble Distillation for Robust
Model Fusion in Federated Learning", NeurIPS 2020), as the Feddle papers run it (-ID and -OOD).

At the close of every server step, with the updates U of that step:

    ω_avg = ω + Σ_{j∈U} (n_j / Σ n_i) · Δ_j                       (FedAvg on the current ω)
    ω_j   = ω^{τ_j} + Δ_j                                         (each teacher, rebuilt from the
                                                                    version τ_j it started from)
    z̄(x)  = 1/|U| Σ_j f(x; ω_j)                                   (the ensemble's averaged logits)
    ω    ← argmin_θ  T² · KL( softmax(z̄(x)/T) ‖ softmax(f(x; θ)/T) ),  θ starting at ω_avg

on the *inputs* of the server's data (labels unused): the in-domain central split (FedDF-ID) or
another dataset (FedDF-OOD; the model's input adapter feeds it, the logits stay over the clients'
label space). Adam, `epochs` passes in mini-batches. Stale updates are teachers too ("all reported
client models", Feddle App. D), so, like FedAsync, the strategy keeps the global models that
in-flight clients started from and drops them once nobody needs them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from strategies.base import AsyncStrategy, Update, VersionHistory, example_weights, weighted_sum


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · KL(softmax(t/T) ‖ softmax(s/T)), averaged over the batch."""
    t = temperature
    return F.kl_div(F.log_softmax(student_logits / t, dim=1), F.log_softmax(teacher_logits / t, dim=1),
                    reduction="batchmean", log_target=True) * (t * t)


class FedDF(AsyncStrategy):
    """FedAvg, then distillation of the step's client ensemble into it on the server's data.

    Args:
        lr: Adam learning rate of the distillation (papers' grid 1e-5, 1e-4, 1e-3).
        epochs: passes over the server data per step (grid 1, 10, 20); 0 = plain FedAvg.
        batch_size: mini-batch of the distillation.
        temperature: T of the softened distributions.
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    def __init__(self, lr: float = 1e-3, epochs: int = 1, batch_size: int = 64, temperature: float = 1.0, *,
                 train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        super().__init__(train_config, clients_per_round, seed)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.lr, self.epochs, self.batch_size, self.temperature = lr, epochs, batch_size, temperature
        self.history = VersionHistory()
        self._updates: list[Update] = []  # this step's updates
        self._teachers: list[tuple[int, torch.Tensor]] = []  # (client, ω^{τ_j} + Δ_j), rebuilt on arrival
        self._closed = False
        self.model: nn.Module | None = None
        self.last: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> FedDF:
        return cls(cfg.server_train_lr, cfg.server_train_epochs, temperature=cfg.distill_temperature, **common)

    def attach(self, model: nn.Module) -> None:
        """The model architecture the distillation trains (its trainable parameters are ω's layout)."""
        self.model = model

    # -- versions the in-flight clients started from ----------------------------------------------
    def configure(self, client: int, version: int):
        self.history.dispatched(client, version, self.params)
        return super().configure(client, version)

    def forget(self, client: int) -> None:
        self.history.done(client)

    # -- the step ---------------------------------------------------------------------------------
    def receive(self, update: Update) -> None:
        # The teacher is rebuilt at once: its client may be dispatched again (from a newer ω) before the step closes.
        base = self.history.base_of(update, self.version, self.params)
        self._teachers.append((update.client, base + update.delta))
        self._updates.append(update)
        self.history.done(update.client, update.base_version)

    def close_round(self) -> None:
        self._closed = bool(self._updates)

    def ready(self) -> bool:
        return self._closed and bool(self._updates)

    def aggregate(self, server: Any = None) -> torch.Tensor:
        started = time.perf_counter()
        updates = sorted(self._updates, key=lambda u: u.client)  # order-free float sums, as FedAvg
        teachers = [t for _, t in sorted(self._teachers, key=lambda ct: ct[0])]
        averaged = self.params + weighted_sum((u.delta for u in updates), example_weights(updates), self.params)
        stats: dict[str, float] = {"teachers": float(len(teachers))}
        if server is not None and self.epochs > 0 and len(server) > 0:
            if self.model is None:
                raise RuntimeError("FedDF needs attach(model) before it can distil on server data")
            averaged, more = self.distill(averaged, teachers, server)
            stats.update(more)
        self.params = averaged
        self.version += 1
        self._updates, self._teachers, self._closed = [], [], False
        self.last = {**stats, "distill-seconds": time.perf_counter() - started}
        return self.params

    # -- distillation -----------------------------------------------------------------------------
    @torch.no_grad()
    def ensemble_logits(self, teachers: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """z̄(x): the teachers' logits averaged, computed once per step in mini-batches."""
        model, total = self.model, None
        model.eval()
        for flat in teachers:
            self.spec.load_into(model, flat.to(x.device))
            logits = torch.cat([model(xb) for xb in x.split(self.batch_size)])
            total = logits if total is None else total + logits
        return total / len(teachers)

    @torch.no_grad()
    def kl_to(self, target: torch.Tensor, x: torch.Tensor) -> float:
        """The distillation loss of the model as loaded, over all of `x`."""
        self.model.eval()
        loss = sum(float(distill_loss(self.model(xb), tb, self.temperature)) * len(xb)
                   for xb, tb in zip(x.split(self.batch_size), target.split(self.batch_size)))
        return loss / len(x)

    def distill(self, start: torch.Tensor, teachers: list[torch.Tensor],
                server: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Adam from `start` on the KL to the ensemble over the server inputs; returns (ω on CPU, stats)."""
        device = server.device
        model, spec = self.model.to(device), self.spec
        x, _ = server.tensors()  # labels unused: ID and OOD data alike only feed the model
        target = self.ensemble_logits(teachers, x)
        spec.load_into(model, start.to(device))
        before = self.kl_to(target, x)
        params = dict(model.named_parameters())
        trainable = [params[n] for n in spec.names]
        opt = torch.optim.Adam(trainable, lr=self.lr)
        gen = torch.Generator().manual_seed(self.seed + self.version)
        model.eval()  # no dropout; BatchNorm as the model's batch-norm mode says (docs/methods.md)
        for _ in range(self.epochs):
            for idx in torch.randperm(len(x), generator=gen).split(self.batch_size):
                idx = idx.to(device)
                opt.zero_grad(set_to_none=True)
                distill_loss(model(x[idx]), target[idx], self.temperature).backward()
                opt.step()
        after = self.kl_to(target, x)
        return spec.flatten(model).cpu(), {"distill-loss-before": before, "distill-loss-after": after}

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "server-train-lr": self.lr, "server-train-epochs": self.epochs,
                "distill-batch-size": self.batch_size, "distill-temperature": self.temperature}
