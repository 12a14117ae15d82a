"""The one training loop and the one evaluation loop, shared by clients, the server and the benchmarks.

:func:`run_epochs` is the loop every trainer calls: the clients' local training (:func:`train`), the
server's training on its own data (:func:`train_on_server`: Center, Fed+FT, HFCL), FedDF's
distillation, Feddle's head fit and its coefficient search. It fixes one batching rule (a seeded
shuffle per epoch, mini-batches in that order, a lone trailing sample skipped) and one seed policy:
clients' runs are seeded by ``derive_seed(run seed, client, dispatch count)`` (the runtime's
``train-seed``), the server's work at model version v by :func:`server_seed` ``(run seed, v)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from common.config import COUNT, POSITIVE, OneOf, Range, option
from common.datasets import ArrayDataset
from common.objectives import OBJECTIVES, BatchLoss, LocalLoss
from common.params import ParamSpec


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, client, version...), stable across processes."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
    return int(state.view(np.uint64)[0] >> 1)


SERVER_STREAM = 2**32 - 1  # the server's seed stream: derive_seed(seed, SERVER_STREAM, version); clients use ids < it
EVAL_STREAM = 2**32 - 2  # the order evaluation batches are formed in


def server_seed(seed: int, version: int) -> int:
    """The seed of the server's own work at model `version` (distinct from every client's stream)."""
    return derive_seed(seed, SERVER_STREAM, version)


# The local optimizers, each setting stated once: torch.optim's for one client (:func:`make_optimizer`), and the same
# step for C clients at once (common/cohort_step.py's kernels). Adam's betas and eps are torch's defaults.
OPTIMIZERS = ("sgd", "adam")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class LocalRecipe:
    """The local recipe keys: how a client trains. Travel in every train message's config (with the client
    objective's own options, which :func:`common.objectives.build_loss` reads from there)."""

    local_epochs: int = option(1, COUNT, "local epochs per client update")
    batch_size: int = option(32, COUNT, "local mini-batch size")
    lr: float = option(0.05, POSITIVE, "local learning rate")
    optimizer: str = option("sgd", OneOf(OPTIMIZERS), "local optimizer")
    momentum: float = option(0.9, Range(0, 1), "SGD momentum (ignored by adam)")
    local_objective: str = option("cross-entropy", OneOf(lambda: OBJECTIVES),
                                  "the clients' loss: a registered client objective (common/objectives.py)")


def make_optimizer(recipe: LocalRecipe, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """`recipe`'s optimizer over `params`: SGD with momentum (no dampening, no Nesterov) or Adam."""
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(params, lr=recipe.lr, betas=ADAM_BETAS, eps=ADAM_EPS)
    raise ValueError(f"unknown optimizer {recipe.optimizer!r}; known: {', '.join(map(repr, OPTIMIZERS))}")


def run_epochs(optimizer: torch.optim.Optimizer, n: int, batch_size: int, epochs: int, seed: int,
               batch_loss: Callable[[torch.Tensor], torch.Tensor],
               epoch_end: Callable[[], None] | None = None, max_steps: int | None = None) -> float:
    """The one training loop: `epochs` passes over `n` samples, each in mini-batches of a fresh shuffle
    drawn from `seed`; per batch of indices ``idx`` (on the CPU): zero the gradients,
    ``batch_loss(idx).backward()``, ``optimizer.step()``; ``epoch_end()`` after each pass; with `max_steps`,
    as many passes as it takes to make that many steps, the last one cut short. A lone trailing sample is
    skipped (BatchNorm cannot train on a batch of one). Returns the mean batch loss per sample."""
    total, seen = 0.0, 0
    for batches in epoch_batches(n, batch_size, epochs, seed, max_steps):
        for idx in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(idx)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            seen += len(idx)
        if epoch_end is not None:
            epoch_end()
    return total / max(seen, 1)


def epoch_batches(n: int, batch_size: int, epochs: int, seed: int, max_steps: int | None = None
                  ) -> Iterator[list[torch.Tensor]]:
    """:func:`run_epochs`' batching rule, one list of index batches per pass (the cohort trainer follows it too)."""
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    if max_steps is not None:
        epochs = -(-max_steps // max(local_steps(n, batch_size, 1), 1))
    for _ in range(epochs):
        batches = []
        for idx in torch.randperm(n, generator=gen).split(batch_size):
            if len(idx) == 1 < n or steps == max_steps:
                continue
            steps += 1
            batches.append(idx)
        yield batches


def local_steps(n: int, batch_size: int, epochs: int) -> int:
    """How many optimizer steps :func:`run_epochs` takes over `n` samples (a lone trailing sample is skipped)."""
    batches = -(-n // batch_size)
    return epochs * (batches - (1 if n % batch_size == 1 and n > 1 else 0))


def train(model: nn.Module, data: ArrayDataset, recipe: LocalRecipe, seed: int, device: torch.device | None = None,
          loss: BatchLoss | None = None, max_steps: int | None = None) -> dict[str, float]:
    """Train `model` in place on `data` with `recipe` (or for `max_steps` optimizer steps instead of its
    epochs); `seed` fixes the shuffling; batches go to `device` (the model's device, e.g. the server's GPU;
    default: where the data is); `loss(x, y, logits)` is the objective (default: cross-entropy). Returns the
    mean cross-entropy and accuracy of the batches trained on (cross-entropy whatever the objective, so that
    every method's train-loss compares)."""
    if len(data) == 0:
        raise ValueError("cannot train on an empty dataset")
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    opt = make_optimizer(recipe, [p for p in model.parameters() if p.requires_grad])
    seen = {"ce": 0.0, "correct": 0, "samples": 0}

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        xb, yb = x[idx], y[idx]
        if device is not None:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        logits = model(xb)
        ce = F.cross_entropy(logits, yb)
        seen["ce"] += ce.item() * len(yb)
        seen["correct"] += int((logits.argmax(1) == yb).sum())
        seen["samples"] += len(yb)
        return ce if loss is None else loss(xb, yb, logits)

    model.train()
    run_epochs(opt, len(y), recipe.batch_size, recipe.local_epochs, seed, batch_loss,
               loss.epoch_end if isinstance(loss, LocalLoss) else None, max_steps)
    n = max(seen["samples"], 1)
    return {"train-loss": seen["ce"] / n, "train-accuracy": seen["correct"] / n}


def train_on_server(model: nn.Module, spec: ParamSpec, params: torch.Tensor, server: Any, recipe: LocalRecipe,
                    seed: int, max_steps: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Load `params` into `model`, train it on ``server.data`` (cross-entropy on the server's labels) with
    `recipe` (or for `max_steps` steps) and `seed` on ``server.device``.

    Returns the trained flat parameters (float32, on the CPU) and ``train()``'s metrics. `model` is left
    on the device holding the trained parameters; buffers that do not travel (BatchNorm running
    statistics) keep evolving across calls, as on a client.
    """
    device = torch.device(server.device)
    model.to(device)
    spec.load_into(model, params.to(device))
    stats = train(model, server.data, recipe, seed, device=device, max_steps=max_steps)
    return spec.flatten(model).cpu(), stats


def eval_order(n: int, seed: int) -> torch.Tensor:
    """The order evaluation batches are formed in: a seeded shuffle, so that a split stored class by
    class never gives a batch of one class (with batch statistics, the batch's label mix would leak
    into the predictions)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, EVAL_STREAM)))


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch_size: int = 1024, seed: int = 0) -> torch.Tensor:
    """`model`'s logits for every row of `x`, in `x`'s order, computed in eval mode over batches of a
    seeded shuffle (:func:`eval_order`)."""
    model.eval()
    order = eval_order(len(x), seed)
    out: torch.Tensor | None = None
    for idx in order.split(batch_size):
        logits = model(x[idx.to(x.device)])
        if out is None:
            out = logits.new_empty((len(x), *logits.shape[1:]))
        out[idx.to(out.device)] = logits
    if out is None:
        raise ValueError("cannot predict on an empty input")
    return out


def accuracy_of(model: nn.Module, data: ArrayDataset) -> Callable[[], float]:
    """A function that measures `model`'s accuracy on `data` when called (an objective's ``Received.accuracy``)."""
    return lambda: evaluate(model, data)["accuracy"]


def on_model_device(model: nn.Module, data: ArrayDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """`data`'s (x, y) as tensors on the device of `model`'s parameters (a client's accelerator, the server's GPU)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.from_numpy(data.x).to(device), torch.from_numpy(data.y).to(device)


@torch.no_grad()
def evaluate(model: nn.Module, data: ArrayDataset, batch_size: int = 1024, seed: int = 0) -> dict[str, float]:
    """Mean cross-entropy and accuracy of `model` on `data` (batches in :func:`eval_order`)."""
    if len(data) == 0:
        return {"loss": 0.0, "accuracy": 0.0}
    x, y = on_model_device(model, data)
    logits = predict(model, x, batch_size, seed)
    return {"loss": float(F.cross_entropy(logits, y, reduction="sum")) / len(y),
            "accuracy": int((logits.argmax(1) == y).sum()) / len(y)}
