"""Cohort training: the train messages in flight in the in-process engine, trained as one batched computation.

A round of a simulation hands ~10 small local runs to the clients; one after another, a GPU spends them launching one
client's small kernels after another (BENCHMARKS, "Cohort training"). When a pull needs a train reply, the engine
hands this module that message with every other train message in flight (each update is a function of its message
alone: its model version, the client's data and seed), and the clients that run the same model train together: their
trainable parameters are stacked into one (C, P) tensor, and every local step is one ``torch.func.vmap`` over
``functional_call`` of the shared model (common/cohort_step.py) — each client on its own batch (its own seeded
shuffle, :func:`common.training.epoch_batches`), with its own optimizer state. Clients with fewer samples or steps
are masked: padded rows carry no loss, and a client whose run is over keeps its parameters and optimizer state
(Adam's bias correction counts its own steps). The result is each client's update as :func:`common.training.train`
computes it, up to float rounding (a batched convolution sums in another order; tests/test_cohort.py states the
tolerance).

It serves the standard local recipe only: the default client side (:class:`strategies.client.ClientSide` itself, as
FedAvg, FedBuff, FedAsync, CA2FL, Feddle, FedMerge and the hybrid baselines use it) with the cross-entropy objective,
SGD or Adam, every other key of the local recipe at its default (:data:`REPRODUCED`), and a model whose training-mode
forward is a function of its parameters and input alone (no BatchNorm running statistics, no active dropout). A
method with a client side or an objective of its own (Ditto, FedDUAL, SCAFFOLD, FedProx, IFCA, FedEM, FedAvg+, the
transfers), a slowed node (``latency-s``), a message whose model or update travels encoded (``model-codec``,
``update-codec``: the ClientApp's mod decodes and encodes it) and any message whose batched run fails run as before,
one message at a time, through the ClientApp (a failure is logged once per kind and run). The in-process engine frees
the cohort's steps at the end of each run (:func:`common.cohort_step.release`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from flwr.app import Context, Message, MessageType
from torch import nn

from client_app.app import node_partition
from client_app.wire_codec import encoded
from client_app.work import load_task, update_message
from common.cohort_step import fell_back, step_for
from common.config import specs_of
from common.training import OPTIMIZERS, LocalRecipe, epoch_batches
from strategies import client_side
from strategies.client import ClientSide, LocalTask

# What the batched step reproduces of the local recipe, by key: the values it serves (None: any). Every other key
# of LocalRecipe, one added later included, is served only at its default: a recipe it cannot reproduce runs one
# message at a time rather than differently
REPRODUCED = {"local-epochs": None, "batch-size": None, "lr": None, "momentum": None, "optimizer": OPTIMIZERS,
              "local-objective": ("cross-entropy",)}


def served(task: LocalTask) -> bool:
    """Whether `task` runs the standard local recipe on a model the batched computation reproduces (a node with no
    training data is left to the ClientApp, whose error reply says so)."""
    if type(client_side(task.config)) is not ClientSide or len(task.parts["train"]) == 0:
        return False
    for key, spec in specs_of(LocalRecipe).items():
        allowed = REPRODUCED.get(key, (spec.default,))
        if allowed is not None and getattr(task.recipe, spec.name) not in allowed:
            return False
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                   or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
                   or (isinstance(getattr(m, "dropout", None), float) and m.dropout > 0)  # attention's own
                   for m in task.model.modules())


@dataclass
class Member:
    """One client of a cohort: its message, its task and its start (flat, on the model's device)."""

    msg: Message
    task: LocalTask
    start: torch.Tensor


def train_cohort(messages: Sequence[Message], contexts: Mapping[int, Context]) -> dict[str, Message]:
    """Replies to the train messages among `messages` that cohort training serves, by message id; the others (and
    any whose batched run fails) are left to the ClientApp."""
    groups: dict[tuple, list[Member]] = {}
    for msg in messages:
        context = contexts.get(msg.metadata.dst_node_id)
        if (msg.metadata.message_type != MessageType.TRAIN or context is None
                or float(context.node_config.get("latency-s", 0.0)) or encoded(msg)):
            continue
        try:
            task = load_task(msg, context, *node_partition(context), {})
        except Exception:  # noqa: BLE001 - the ClientApp will run it and reply with the error
            continue
        if served(task):
            # load_task reuses one model per configuration: the start is copied before the next message loads
            groups.setdefault((id(task.model), task.recipe), []).append(Member(msg, task, task.spec.flatten(
                task.model).to(task.device)))
    replies = {}
    for members in groups.values():
        try:
            deltas, metrics = train_together(members)
        except Exception as err:  # noqa: BLE001 - one at a time instead, where a failure stays the client's own
            fell_back("a cohort's batched training failed", err, f"its {len(members)} clients train one at a time")
            continue
        for member, delta, stats in zip(members, deltas, metrics):
            member.task.metrics.update(stats)
            replies[member.msg.metadata.message_id] = update_message(member.msg, member.task, delta.cpu())
    return replies


def train_together(members: Sequence[Member]) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The local runs of `members` (one model, one recipe) as one batched computation: each one's delta (C, P)
    and training metrics, as :func:`common.training.train` computes them."""
    task = members[0].task
    recipe, device = task.recipe, task.device
    C, B = len(members), recipe.batch_size
    # every client's batches, as run_epochs draws them, padded to the longest run and the batch size
    batches = [[idx for epoch in epoch_batches(len(m.task.parts["train"]), B, recipe.local_epochs,
                                               m.task.train_seed) for idx in epoch] for m in members]
    T = max(len(b) for b in batches)
    index = torch.zeros(C, T, B, dtype=torch.long)
    valid = torch.zeros(C, T, B, dtype=torch.bool)
    for c, runs in enumerate(batches):
        for t, idx in enumerate(runs):
            index[c, t, :len(idx)], valid[c, t, :len(idx)] = idx, True
    n_max = max(len(m.task.parts["train"]) for m in members)
    dtype = members[0].start.dtype  # the model's (float32 on the wire; the tests also train in float64)
    x = torch.zeros(C, n_max, *task.parts["train"].x.shape[1:], dtype=dtype)
    y = torch.zeros(C, n_max, dtype=torch.long)
    for c, m in enumerate(members):
        part = m.task.parts["train"]
        x[c, :len(part)], y[c, :len(part)] = torch.from_numpy(part.x), torch.from_numpy(part.y)
    x, y, index, valid = (t.to(device) for t in (x, y, index, valid))
    rows = torch.arange(C, device=device)[:, None, None]
    xs, ys, masks = x[rows, index], y[rows, index], valid.to(dtype)  # (C, T, B, ...): every step's batch
    active = valid.any(dim=2)  # (C, T): the client takes step t
    starts = torch.stack([m.start for m in members])
    step = step_for(task.model, task.spec, recipe, device, C, tuple(xs.shape[3:]), dtype)
    step.reset(starts)
    for t in range(T):
        step(xs[:, t], ys[:, t], masks[:, t], active[:, t])
    metrics = [{"train-loss": loss / max(n, 1), "train-accuracy": hit / max(n, 1)}
               for loss, hit, n in zip(step.ce_sum.tolist(), step.hits.tolist(), valid.sum(dim=(1, 2)).tolist())]
    return step.w - starts, metrics
