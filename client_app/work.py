"""The ClientApp's local work: the model and the node's data for a message, training and evaluation.

Kept apart from client_app/app.py because it needs torch: in deployment every message runs in a fresh process,
and the messages that do no local work (``query``) should not pay for importing it.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from torch import nn

from client_app.node_cache import cache_dir, client_parts
from common.data import ArrayDataset, DataSpec
from common.devices import resolve_device
from common.models import build_from_config, model_config
from common.objectives import Received, build_loss
from common.params import ParamSpec, extras_from_record, extras_to_record
from common.protocol import (
    ARRAYS,
    BASE_VERSION,
    CANDIDATE,
    CANDIDATES,
    CENTRAL_X,
    CENTRAL_Y,
    COMPONENT_DELTAS,
    COMPONENTS,
    CONFIG,
    EXTRAS,
    FINETUNE_EPOCHS,
    LOSS_GRADIENT,
    METRICS,
    MIXTURE,
    NUM_EXAMPLES,
    PARTITION_ID,
    TRAIN_SEED,
    VERSION,
)
from common.training import (
    EVAL_STREAM,
    LocalRecipe,
    accuracy_of,
    derive_seed,
    evaluate,
    evaluate_mixture,
    loss_gradient,
    train,
    train_mixture,
)


def _load(msg: Message, context: Context, pid: int, num_partitions: int, timings: dict[str, float]
          ) -> tuple[DataSpec, dict[str, ArrayDataset], nn.Module, ParamSpec]:
    """The run's data spec, this node's data parts, and the model with the message's parameters loaded;
    the seconds each took in `timings` (``data-s``, ``model-s``)."""
    started = time.time()
    config = msg.content[CONFIG]
    spec = DataSpec.from_config(config)
    if "data-root" in context.node_config:  # the node keeps its data where its operator put it
        spec = dataclasses.replace(spec, data_root=str(context.node_config["data-root"]))
    if num_partitions != spec.num_partitions:
        raise ValueError(f"node has num-partitions={num_partitions} but the run splits the data into "
                         f"{spec.num_partitions} partitions (num-clients)")
    parts = client_parts(spec, pid, context.run_id, cache_dir(context.node_config))
    loaded = time.time()
    own = parts["train"]
    model, initial, pspec = _model(tuple(sorted(model_config(config).items())), own.x.shape[1:], own.num_classes,
                                   spec.seed)
    model.to(node_device(context))
    with torch.no_grad():  # nothing from an earlier message carries over: buffers and frozen weights reset
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name, value in initial.items():
            tensors[name].copy_(value)
    pspec.load_into(model, pspec.from_record(msg.content[ARRAYS]))
    timings.update({"data-s": loaded - started, "model-s": time.time() - loaded})
    return spec, parts, model, pspec


def node_device(context: Context) -> torch.device:
    """The node's ``device`` setting (``auto``: its CUDA or MPS accelerator when present, else its CPU)."""
    return resolve_device(str(context.node_config.get("device", "auto")))


def received_extras(msg: Message, device: torch.device) -> dict[str, torch.Tensor]:
    """The message's extra arrays (a method's payload beside the model), on the model's device."""
    if EXTRAS not in msg.content.array_records:
        return {}
    return {k: v.to(device) for k, v in extras_from_record(msg.content[EXTRAS]).items()}


@functools.lru_cache(maxsize=2)
def _model(options: tuple, shape: tuple[int, ...], num_classes: int, seed: int) -> tuple[nn.Module, dict, ParamSpec]:
    """The model built once per process (simulation workers and the in-process engine reuse it), with
    its initial buffers and frozen weights. Built from the run's `seed` as on the server, so a user's model's frozen
    weights are the server's (the built-in models' come from their pretrained file or a fixed seed); every message
    then loads its own trainable parameters."""
    model = build_from_config(dict(options), shape, num_classes, seed=seed)
    initial = {n: t.detach().clone() for n, t in [*model.named_buffers(),
                                                   *((n, p) for n, p in model.named_parameters() if not p.requires_grad)]}
    return model, initial, ParamSpec.of(model)


def choose_candidate(model: nn.Module, pspec: ParamSpec, extras: dict[str, torch.Tensor], data: ArrayDataset,
                     seed: int) -> int:
    """With ``candidates`` in the payload (IFCA), load the model of lowest loss on `data` — the message's own
    (index 0) or one of the candidates (1, 2, …) — and return its index; without, keep the model (0)."""
    if CANDIDATES not in extras:
        return 0
    models = [pspec.flatten(model), *extras[CANDIDATES].reshape(-1, pspec.numel)]
    losses = []
    for params in models:
        pspec.load_into(model, params)
        losses.append(evaluate(model, data, seed=seed)["loss"])
    best = min(range(len(models)), key=losses.__getitem__)  # ties: the lowest index
    pspec.load_into(model, models[best])
    return best


def with_central_examples(data: ArrayDataset, extras: dict[str, torch.Tensor]) -> ArrayDataset:
    """The client's data plus the central examples of the payload (example transfer), for this round only."""
    if CENTRAL_X not in extras:
        return data
    x, y = extras[CENTRAL_X].cpu().numpy(), extras[CENTRAL_Y].round().long().cpu().numpy()
    if x.shape[1:] != data.x.shape[1:] or len(x) != len(y) or (len(y) and (y.min() < 0 or y.max() >= data.num_classes)):
        raise ValueError(f"central examples of shape {x.shape} with labels in [{y.min()}, {y.max()}] do not fit this "
                         f"client's data {data.x.shape[1:]} with {data.num_classes} classes")
    return ArrayDataset(np.concatenate([data.x, x]), np.concatenate([data.y, y]), data.num_classes)


def components_of(pspec: ParamSpec, start: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """FedEM's M components (M × P): the message's model, then the payload's ``components``."""
    return torch.cat([start[None], extras[COMPONENTS].reshape(-1, pspec.numel)])


def train_reply(msg: Message, context: Context, pid: int, num_partitions: int, latency_s: float,
                timings: dict[str, float]) -> Message:
    """Local training from the received global model; replies with the parameter delta. `timings` gets the
    seconds of loading (:func:`_load`) and of the work itself (``work-s``)."""
    config = msg.content[CONFIG]
    spec, parts, model, pspec = _load(msg, context, pid, num_partitions, timings)
    started = time.time()
    data = parts["train"]
    time.sleep(latency_s)  # a slow device, for demos and tests
    recipe = LocalRecipe.from_config(config)
    device = next(model.parameters()).device
    extras = received_extras(msg, device)
    chosen = choose_candidate(model, pspec, extras, data, spec.seed)
    start = pspec.flatten(model)
    received = Received(model, [p.detach().clone() for p in model.parameters() if p.requires_grad], extras,
                        accuracy=accuracy_of(model, data))
    if MIXTURE in extras:  # FedEM: every component, weighted by the E-step's responsibilities
        components = components_of(pspec, start, extras)
        trained, pi, metrics = train_mixture(model, pspec, components, extras[MIXTURE], data, recipe,
                                             int(config[TRAIN_SEED]))
        delta = trained[0] - start
        received.reply.update({COMPONENT_DELTAS: (trained[1:] - components[1:]).reshape(-1), MIXTURE: pi})
    else:
        loss = build_loss(recipe.objective, dict(config), received)
        metrics = train(model, with_central_examples(data, extras), recipe, seed=int(config[TRAIN_SEED]), loss=loss,
                        device=device)
        delta = pspec.flatten(model) - start
    if arrays := int(config.get(LOSS_GRADIENT, 0)):
        received.reply[LOSS_GRADIENT] = loss_gradient(model, data, arrays)
    reply = MetricRecord({NUM_EXAMPLES: len(data), PARTITION_ID: pid, BASE_VERSION: int(config[VERSION]), **metrics,
                          **received.metrics})
    if CANDIDATES in extras:
        reply[CANDIDATE] = chosen
    content = RecordDict({ARRAYS: pspec.to_record(delta), METRICS: reply})
    if received.reply:
        content[EXTRAS] = extras_to_record(received.reply)
    timings["work-s"] = time.time() - started
    return Message(content, reply_to=msg)


def evaluate_reply(msg: Message, context: Context, pid: int, num_partitions: int,
                   timings: dict[str, float]) -> Message:
    """Loss and accuracy of the received model on this node's own test split (``eval-*``) and validation split
    (``val-*``) when the run holds them out (``client-test-fraction``), else on its whole partition. The model
    is what the client would train: IFCA's best candidate, FedAvg+'s fine-tuned model (``finetune-epochs``),
    FedEM's mixture. `timings` as in :func:`train_reply`."""
    config = msg.content[CONFIG]
    spec, parts, model, pspec = _load(msg, context, pid, num_partitions, timings)
    started = time.time()
    extras = received_extras(msg, next(model.parameters()).device)
    own = parts["train"]  # the client's training data: IFCA's choice, FedAvg+'s fine-tuning
    choose_candidate(model, pspec, extras, own, spec.seed)
    if epochs := int(config.get(FINETUNE_EPOCHS, 0)):
        recipe = dataclasses.replace(LocalRecipe.from_config(config), epochs=epochs, objective="cross-entropy",
                                     objective_options=())
        train(model, own, recipe, seed=derive_seed(spec.seed, EVAL_STREAM, pid, int(config[VERSION])),
              device=next(model.parameters()).device)
    if MIXTURE in extras:
        components = components_of(pspec, pspec.flatten(model), extras)
        assess = lambda d: evaluate_mixture(model, pspec, components, extras[MIXTURE], d, spec.seed)
    else:
        assess = lambda d: evaluate(model, d, seed=spec.seed)
    held_out = spec.client_test_fraction > 0
    data = parts["test" if held_out else "train"]
    result = assess(data)
    metrics = MetricRecord({NUM_EXAMPLES: len(data), PARTITION_ID: pid,
                            "eval-loss": result["loss"], "eval-accuracy": result["accuracy"]})
    if held_out and spec.client_validation_fraction > 0:
        val = assess(parts["validation"])
        metrics["val-loss"], metrics["val-accuracy"] = val["loss"], val["accuracy"]
    timings["work-s"] = time.time() - started
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)
