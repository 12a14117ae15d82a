"""The client side of a method: what a node does with a train or an evaluate message.

The ClientApp (client_app/work.py) loads the node's data and the received model, then hands a
:class:`LocalTask` to the method's :class:`ClientSide`: the ``client_side`` class attribute of the strategy the
message names (``strategy``: one channel, so a node runs what the server's strategy declares). The default is
the clients of FedAvg and most methods: train the received model with the run's local recipe and client objective
(common/objectives.py), reply with the delta; evaluate the received model. A method that does more subclasses
:class:`ClientSide` in its own file, next to its strategy, and overrides what differs:

    prepare(task, evaluating)   make task.model the model to train or evaluate (IFCA: the best candidate;
                                FedAvg+: fine-tuned; Ditto: the personal model)
    train(task) -> delta        train it; extra arrays to send back go in task.reply, metrics in task.metrics
    evaluate(task, data)        loss and accuracy on one held-out split (FedEM: the mixture's)

A client may keep state across messages in ``task.state`` (Flower's ``Context.state``: per node and run, in every
runtime; Ditto keeps its personal model there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import RecordDict
from torch import nn

from common.config import from_keys
from common.datasets import ArrayDataset
from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.protocol import TRAIN_SEED
from common.training import LocalRecipe, accuracy_of, evaluate, train


@dataclass
class LocalTask:
    """What a node holds for one message."""

    model: nn.Module  # the received model, loaded, on the node's device: trained or evaluated in place
    spec: ParamSpec  # the layout of its trainable parameters (the wire's flat vector)
    parts: Mapping[str, ArrayDataset]  # the node's "train" part, and its "validation" and "test" when held out
    arrays: dict[str, torch.Tensor]  # the payload's extra arrays, on the model's device
    config: Mapping[str, Any]  # the message config: data spec, model, local recipe, the method's keys
    seed: int  # the run's seed
    partition: int  # the node's partition id (its client id)
    state: RecordDict  # the node's Context.state: kept across the node's messages of the run
    reply: dict[str, torch.Tensor] = field(default_factory=dict)  # extra arrays sent back with the update
    metrics: dict[str, float] = field(default_factory=dict)  # join the train reply's metrics

    @property
    def recipe(self) -> LocalRecipe:
        """The run's local recipe (its ``local-objective`` gives way to the client side's ``objective``)."""
        return from_keys(LocalRecipe, self.config)

    @property
    def train_seed(self) -> int:
        return int(self.config[TRAIN_SEED])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def received(self, data: ArrayDataset) -> Received:
        """What the client objective gets: the model with detached copies of its parameters as they are now, the
        payload's arrays, and its accuracy on `data` measured when asked."""
        return Received(self.model, [p.detach().clone() for p in self.model.parameters() if p.requires_grad],
                        self.arrays, accuracy=accuracy_of(self.model, data))


class ClientSide:
    """Local training with the run's recipe and client objective; evaluation of the received model.

    A method's client side is declared here, in one place: the class (what a node runs), :attr:`objective` (the
    loss it trains with, when the method fixes it) and :attr:`keys` (its strategy's options it reads). Every
    message carries the run's client keys (data, model, recipe, objective options) and these; nothing a strategy
    sends per client can change them."""

    # The client objective this method's clients train with (common/objectives.py), or None for the run's
    # ``local-objective`` (cross-entropy, FedProx's proximal term, ...): SCAFFOLD's clients need its correction
    objective: ClassVar[str | None] = None
    # The strategy's own option keys the client side reads from ``task.config`` (Ditto's λ): every message carries
    # their values (:meth:`strategies.base.Strategy.client_options`)
    keys: ClassVar[tuple[str, ...]] = ()
    # Keeps state in the node's Context.state: it lives as long as the node does (a SuperNode restart begins it
    # afresh); the in-process engine's nodes keep it with the run's checkpoints (server_app/node_state.py)
    stateful: ClassVar[bool] = False

    def prepare(self, task: LocalTask, evaluating: bool) -> None:
        """Make ``task.model`` the model to train (``evaluating`` false) or to evaluate; default: as received."""

    def training_data(self, task: LocalTask) -> ArrayDataset:
        """What the local run trains on: the node's training part."""
        return task.parts["train"]

    def train(self, task: LocalTask) -> torch.Tensor:
        """Train ``task.model`` with the recipe and the client objective; the delta of its trainable parameters
        (flat). Training metrics, then the objective's, go to ``task.metrics``; the objective's arrays to
        ``task.reply``."""
        start = task.spec.flatten(task.model)
        received = task.received(task.parts["train"])
        loss = build_loss(self.objective or task.recipe.local_objective, dict(task.config), received)
        task.metrics.update(train(task.model, self.training_data(task), task.recipe, seed=task.train_seed, loss=loss,
                                  device=task.device))
        task.metrics.update(received.metrics)
        task.reply.update(received.reply)
        return task.spec.flatten(task.model) - start

    def evaluate(self, task: LocalTask, data: ArrayDataset) -> dict[str, float]:
        """``loss`` and ``accuracy`` of ``task.model`` on `data`."""
        return evaluate(task.model, data, seed=task.seed)

