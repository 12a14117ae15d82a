"""The one place where the server trains the global model on its own data: flat ω in, flat ω′ out.

Used by the hybrid baselines (Center, Fed+FT, HFCL in ``strategies.hybrid_baselines``); any
strategy that owns a model (``attach``) and a :class:`~common.params.ParamSpec` can call it.
Training is :func:`common.training.train`, the clients' own loop, so "the server trains like a
client" is the same code; it runs on ``server.device`` and the result comes back to the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from common.params import ParamSpec
from common.training import LocalRecipe, derive_seed, train

SERVER_STREAM = 2**32 - 1  # the server's seed stream: derive_seed(seed, SERVER_STREAM, version); clients use ids < it


def server_seed(seed: int, version: int) -> int:
    """The shuffling seed of the server's training at `version` (distinct from every client's stream)."""
    return derive_seed(seed, SERVER_STREAM, version)


def require_in_domain(server: Any, method: str) -> None:
    """Raise a clear error unless `server` is in-domain server data (the baselines need its labels)."""
    if server is None:
        raise RuntimeError(f"{method} trains on the server's data, but this run has none: set central-size > 0 "
                           "(the in-domain central split) and leave server-dataset empty")
    if not server.in_domain:
        raise ValueError(f"{method} needs in-domain server data (the clients' label space), but the server holds "
                         "out-of-domain data (server-dataset is set); leave server-dataset empty")
    if len(server) == 0:
        raise ValueError(f"{method}: the server's data is empty (central-size = 0?)")


def recipe_from(train_config: dict[str, Any], epochs: int | None = None, lr: float | None = None) -> LocalRecipe:
    """The clients' recipe (batch size, optimizer, momentum), with `epochs` / `lr` replaced when given."""
    try:
        recipe = LocalRecipe.from_config(train_config)
    except KeyError as err:
        raise ValueError(f"server training needs the local recipe in train_config; missing {err}") from err
    changes = {k: v for k, v in (("epochs", epochs), ("lr", lr)) if v is not None}
    return dataclasses.replace(recipe, **changes)


def train_on_server(model: nn.Module, spec: ParamSpec, params: torch.Tensor, server: Any, recipe: LocalRecipe,
                    seed: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Load `params` into `model`, train it on ``server.data`` with `recipe` and `seed` on ``server.device``.

    Returns the trained flat parameters (float32, on the CPU) and ``train()``'s metrics (train-loss,
    train-accuracy). `model` is left on the device holding the trained parameters; buffers that do
    not travel (BatchNorm running statistics) keep evolving across calls, as on a client.
    """
    device = torch.device(server.device)
    model.to(device)
    spec.load_into(model, params.to(device))
    stats = train(model, server.data, recipe, seed, device=device)
    return spec.flatten(model).cpu(), stats
