"""FedDF — ensemble distillation for model fusion (Lin et al., "Ensemble Distillation for Robust
Model Fusion in Federated Learning", NeurIPS 2020), as the Feddle papers run it (-ID and -OOD).

At the close of every round, with the updates U of that round:

    ω_avg = ω + Σ_{j∈U} (n_j / Σ n_i) · Δ_j                       (FedAvg on the current ω)
    ω_j   = ω^{τ_j} + Δ_j                                         (each teacher, rebuilt from the
                                                                    model ω^{τ_j} it was sent)
    z̄(x)  = 1/|U| Σ_j f(x; ω_j)                                   (the ensemble's averaged logits)
    ω    ← argmin_θ  T² · KL( softmax(z̄(x)/T) ‖ softmax(f(x; θ)/T) ),  θ starting at ω_avg

on the *inputs* of the server's data (labels unused): the in-domain central split (FedDF-ID) or
another dataset (FedDF-OOD; the model's input adapter feeds it, the logits stay over the clients'
label space). Adam, ``server-train-epochs`` passes in mini-batches. Stale updates are teachers too
("all reported client models", Feddle App. D).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from common.config import COUNT, POSITIVE, option
from common.training import predict, run_epochs, server_seed
from strategies.aggregation import fedavg_step
from strategies.fedavg import FedAvg
from strategies.options import SERVER_TRAIN_EPOCHS, SERVER_TRAIN_LR


@dataclass(frozen=True)
class FedDFConfig:
    server_train_lr: float = SERVER_TRAIN_LR.field()
    server_train_epochs: int = SERVER_TRAIN_EPOCHS.field()
    distill_temperature: float = option(1.0, POSITIVE, "softmax temperature T of the distillation")
    distill_batch_size: int = option(64, COUNT, "mini-batch of the distillation and of the teachers' logits")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · KL(softmax(t/T) ‖ softmax(s/T)), averaged over the batch."""
    t = temperature
    return F.kl_div(F.log_softmax(student_logits / t, dim=1), F.log_softmax(teacher_logits / t, dim=1),
                    reduction="batchmean", log_target=True) * (t * t)


class FedDF(FedAvg):
    """FedAvg, then distillation of the step's client ensemble into it on the server's data, in or out of
    domain (options: FedDFConfig)."""

    name = "feddf"
    Config = FedDFConfig
    server_data = "any"

    def step(self) -> dict[str, float]:
        if self.model is None:
            raise RuntimeError("FedDF needs the model (initialize(..., model)) to distil on server data")
        started = time.perf_counter()
        updates = sorted(self.updates, key=lambda u: u.client)  # order-free float sums, as FedAvg
        teachers = [u.start + u.delta for u in updates]
        self.params, stats = self.distill(fedavg_step(self.params, updates), teachers, self.server)
        self.version += 1
        self.updates, self.closed = [], False
        return {"teachers": float(len(teachers)), **stats, "distill-seconds": time.perf_counter() - started}

    def logits(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """f(x; flat) over all of `x` (eval mode, batches in the seeded evaluation order)."""
        self.spec.load_into(self.model, flat.to(x.device))
        return predict(self.model, x, self.config.distill_batch_size, self.seed)

    def distill(self, start: torch.Tensor, teachers: list[torch.Tensor],
                server: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Adam from `start` on the KL to the ensemble over the server inputs; returns (ω on CPU, stats)."""
        device, temperature = server.device, self.config.distill_temperature
        model, spec = self.model.to(device), self.spec
        x, _ = server.tensors()  # labels unused: ID and OOD data alike only feed the model
        target = sum(self.logits(t, x) for t in teachers) / len(teachers)  # z̄(x)
        before = float(distill_loss(self.logits(start, x), target, temperature))
        params = dict(model.named_parameters())
        opt = torch.optim.Adam([params[n] for n in spec.names], lr=self.config.server_train_lr)
        model.eval()  # no dropout; BatchNorm as the model's batch-norm mode says (docs/methods.md)
        run_epochs(opt, len(x), self.config.distill_batch_size, self.config.server_train_epochs,
                   server_seed(self.seed, self.version),
                   lambda idx: distill_loss(model(x[idx.to(device)]), target[idx.to(device)], temperature))
        trained = spec.flatten(model)
        after = float(distill_loss(self.logits(trained, x), target, temperature))
        return trained.cpu(), {"distill-loss-before": before, "distill-loss-after": after}
