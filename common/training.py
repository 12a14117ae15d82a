"""The one train loop and the one eval loop, shared by clients, the server and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from common.data import ArrayDataset


@dataclass(frozen=True)
class LocalRecipe:
    """How a client (or the server) trains: the hyperparameters that travel in a train message."""

    epochs: int
    batch_size: int
    lr: float
    optimizer: str = "sgd"
    momentum: float = 0.9

    def to_config(self) -> dict[str, int | float | str]:
        return {"local-epochs": self.epochs, "batch-size": self.batch_size, "lr": self.lr,
                "optimizer": self.optimizer, "momentum": self.momentum}

    @staticmethod
    def from_config(config: dict) -> LocalRecipe:
        return LocalRecipe(int(config["local-epochs"]), int(config["batch-size"]), float(config["lr"]),
                           str(config["optimizer"]), float(config["momentum"]))


def make_optimizer(recipe: LocalRecipe, params) -> torch.optim.Optimizer:
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(params, lr=recipe.lr)
    raise ValueError(f"unknown optimizer {recipe.optimizer!r}; known: 'sgd', 'adam'")


def train(model: nn.Module, data: ArrayDataset, recipe: LocalRecipe, seed: int,
          device: torch.device | None = None) -> dict[str, float]:
    """Train `model` in place on `data`; `seed` fixes the shuffling; batches go to `device` (the model's
    device, e.g. the server's GPU; default: where the data is). Returns mean loss and accuracy."""
    if len(data) == 0:
        raise ValueError("cannot train on an empty dataset")
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(recipe, [p for p in model.parameters() if p.requires_grad])
    model.train()
    total_loss, correct, seen = 0.0, 0, 0
    for _ in range(recipe.epochs):
        for idx in torch.randperm(len(y), generator=gen).split(recipe.batch_size):
            if len(idx) == 1 < len(y):
                continue  # a lone trailing sample: BatchNorm cannot train on a batch of one
            xb, yb = x[idx], y[idx]
            if device is not None:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            loss.backward()
            opt.step()
            total_loss += loss.item() * len(yb)
            correct += int((logits.argmax(1) == yb).sum())
            seen += len(yb)
    return {"train-loss": total_loss / seen, "train-accuracy": correct / seen}


@torch.no_grad()
def evaluate(model: nn.Module, data: ArrayDataset, batch_size: int = 1024) -> dict[str, float]:
    """Mean cross-entropy and accuracy of `model` on `data`."""
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        xb = torch.from_numpy(data.x[start : start + batch_size])
        yb = torch.from_numpy(data.y[start : start + batch_size])
        logits = model(xb)
        total_loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    n = max(len(data), 1)
    return {"loss": total_loss / n, "accuracy": correct / n}


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, client, version...), stable across processes."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)
