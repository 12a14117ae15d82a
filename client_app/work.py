"""The ClientApp's local work: the model and the node's data for a message, then the method's client side
(strategies/client.py) trains or evaluates.

Kept apart from client_app/app.py because it needs torch: in deployment every message runs in a fresh process,
and the messages that do no local work (``query``) should not pay for importing it.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from torch import nn

import strategies  # noqa: F401 - registers every method's client side and client objectives
from client_app.declared import check_message
from client_app.node_cache import cache_dir, client_parts
from common.config import from_keys
from common.devices import resolve_device
from common.models import build_from_config, model_config
from common.params import ParamSpec, extras_from_record, extras_to_record
from common.protocol import ARRAYS, BASE_VERSION, CONFIG, EXTRAS, METRICS, NUM_EXAMPLES, PARTITION_ID, VERSION
from common.splits import DataSpec
from strategies import client_side
from strategies.client import LocalTask


def node_device(context: Context) -> torch.device:
    """The node's ``device`` setting (``auto``: its CUDA or MPS accelerator when present, else its CPU)."""
    return resolve_device(str(context.node_config.get("device", "auto")))


def load_task(msg: Message, context: Context, pid: int, num_partitions: int, timings: dict[str, float]) -> LocalTask:
    """The run's data spec, this node's data parts, and the model with the message's parameters loaded, on the
    node's device, with the payload's arrays; the seconds each took in `timings` (``data-s``, ``model-s``). A message
    that names code its run did not declare is refused first (client_app/declared.py)."""
    started = time.time()
    config = msg.content[CONFIG]
    check_message(config, context)  # before anything the message names is used: no undeclared code is imported
    spec = from_keys(DataSpec, config)
    if "data-root" in context.node_config:  # the node keeps its data where its operator put it
        spec = dataclasses.replace(spec, data_root=str(context.node_config["data-root"]))
    if num_partitions != spec.num_clients:
        raise ValueError(f"node has num-partitions={num_partitions} but the run splits the data into "
                         f"{spec.num_clients} partitions (num-clients)")
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
    device = next(model.parameters()).device
    arrays = {} if EXTRAS not in msg.content.array_records else {
        k: v.to(device) for k, v in extras_from_record(msg.content[EXTRAS]).items()}
    timings.update({"data-s": loaded - started, "model-s": time.time() - loaded})
    return LocalTask(model, pspec, parts, arrays, config, spec.seed, pid, context.state)


@functools.lru_cache(maxsize=2)
def _model(options: tuple, shape: tuple[int, ...], num_classes: int, seed: int) -> tuple[nn.Module, dict, ParamSpec]:
    """The model built once per process (simulation workers and the in-process engine reuse it), with
    its initial buffers and frozen weights. Built from the run's `seed` as on the server, so a user's model's frozen
    weights are the server's (the built-in models' come from their pretrained file or a fixed seed); every message
    then loads its own trainable parameters."""
    model = build_from_config(dict(options), shape, num_classes, seed=seed)
    frozen = ((n, p) for n, p in model.named_parameters() if not p.requires_grad)
    initial = {n: t.detach().clone() for n, t in [*model.named_buffers(), *frozen]}
    return model, initial, ParamSpec.of(model)


def train_reply(msg: Message, context: Context, pid: int, num_partitions: int, latency_s: float,
                timings: dict[str, float]) -> Message:
    """The method's local training from the received model; replies with the parameter delta, the metrics and
    the method's extra arrays. `timings` gets the seconds of loading (:func:`load_task`) and of the work
    (``work-s``). A node with a device profile (``compute-s-per-example``, ``overhead-s``: a real fleet's paced
    device, hybridfl/launch/real_fleet.py) replies no sooner than the profile says its message takes: ``overhead-s`` +
    training examples × local epochs × ``compute-s-per-example``, from the message's arrival (``paced-s``)."""
    arrived = time.time()
    task = load_task(msg, context, pid, num_partitions, timings)
    started = time.time()
    if latency_s:  # a slow device, for demos and tests (sleep(0) would still hand the GIL to another thread)
        time.sleep(latency_s)
    side = client_side(task.config)
    side.prepare(task, evaluating=False)
    reply = update_message(msg, task, side.train(task))
    timings["work-s"] = time.time() - started
    examples = len(task.parts["train"]) * int(task.config.get("local-epochs", 1))
    profile = float(context.node_config.get("overhead-s", 0.0)) + examples * float(
        context.node_config.get("compute-s-per-example", 0.0))
    if profile > 0:
        timings["paced-s"] = max(0.0, arrived + profile - time.time())
        time.sleep(timings["paced-s"])
    return reply


def update_message(msg: Message, task: LocalTask, delta: torch.Tensor) -> Message:
    """The reply to train message `msg`: the delta of `task`'s trainable parameters (flat), the examples, partition
    and base version with ``task.metrics``, and the method's extra arrays (``task.reply``)."""
    metrics = MetricRecord({NUM_EXAMPLES: len(task.parts["train"]), PARTITION_ID: task.partition,
                            BASE_VERSION: int(task.config[VERSION]), **task.metrics})
    content = RecordDict({ARRAYS: task.spec.to_record(delta), METRICS: metrics})
    if task.reply:
        content[EXTRAS] = extras_to_record(task.reply)
    return Message(content, reply_to=msg)


def evaluate_reply(msg: Message, context: Context, pid: int, num_partitions: int,
                   timings: dict[str, float]) -> Message:
    """Loss and accuracy of the model the method evaluates (the received one unless its client side prepares
    another) on this node's own test split (``eval-*``) and validation split (``val-*``) when the run holds them out
    (``client-test-fraction``), else on its whole partition. `timings` as in :func:`train_reply`."""
    task = load_task(msg, context, pid, num_partitions, timings)
    started = time.time()
    side = client_side(task.config)
    side.prepare(task, evaluating=True)
    spec = from_keys(DataSpec, task.config)
    held_out = spec.client_test_fraction > 0
    data = task.parts["test" if held_out else "train"]
    result = side.evaluate(task, data)
    metrics = MetricRecord({NUM_EXAMPLES: len(data), PARTITION_ID: pid,
                            "eval-loss": result["loss"], "eval-accuracy": result["accuracy"]})
    if held_out and spec.client_validation_fraction > 0:
        val = side.evaluate(task, task.parts["validation"])
        metrics["val-loss"], metrics["val-accuracy"] = val["loss"], val["accuracy"]
    timings["work-s"] = time.time() - started
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)
