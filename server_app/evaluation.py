"""Evaluation by the clients: every connected client evaluates the model the strategy has for it, and the
server sums the replies up, example-weighted (federated) or per client (personalised).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import MessageType
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.protocol import NUM_EXAMPLES
from flower_internals.replies import push
from server_app.wire import MAX_COUNT, Dispatcher, NodeDirectory, RejectedReply, collect, parse_metrics, reply_number
from strategies.base import Strategy


def weighted_mean(values: Iterable[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Example-weighted mean of metric dicts: ``[(weight, {name: value})]`` -> ``{name: mean}``."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for w, metrics in values:
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + w * v
            weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


# Evaluation messages in the air at once. Each carries a whole model, so a broadcast to every client at once
# held one model per client (6.6 GB for 1000 clients of a 6.6 MB CNN); in waves memory is O(wave).
EVAL_WAVE = 64
PROGRESS_EVERY_S = 30.0  # a long evaluation (50 000 clients: minutes) says how far it is


def client_evaluate(grid: Grid, directory: NodeDirectory, dispatcher: Dispatcher, strategy: Strategy,
                    timeout: float, wave: int = EVAL_WAVE,
                    max_examples: Callable[[int], int] = lambda client: MAX_COUNT,
                    ) -> tuple[dict[int, dict[str, float]], int]:
    """Every connected client evaluates the model the strategy has for it (``model_for``): its metrics
    (``num-examples``, ``eval-*``, with held-out splits ``val-*``) by client, and how many were asked. The
    messages go out `wave` at a time, each wave collected before the next is built. Error replies and clients
    that do not answer within `timeout` of their wave are left out, and so is a reply that breaks the contract
    (:func:`check_evaluation`; at most `max_examples(client)` examples), with a warning."""
    connected = directory.poll()
    targets = [(client, node) for client, node in sorted(directory.node_of.items()) if node in connected]
    results: dict[int, dict[str, float]] = {}
    said = time.monotonic()
    for start in range(0, len(targets), wave):
        wave_targets = targets[start:start + wave]
        ids = push(grid, lambda: [dispatcher.message(node, strategy.model_for(client), strategy.version,
                                                     MessageType.EVALUATE) for client, node in wave_targets])
        asked = dict(zip(ids, (client for client, _ in wave_targets)))
        for reply in collect(directory.replies, list(asked), timeout, directory.pace):
            try:
                client, metrics = parse_metrics(reply)
                target = asked[reply.metadata.reply_to_message_id]
                if client != target:
                    raise RejectedReply(f"the evaluation asked of client {target} says it is client {client}")
                check_evaluation(metrics, max_examples(client))
            except RejectedReply as err:
                if not reply.has_error():  # an error reply is a device's failure: left out without a warning
                    log(WARNING, "an evaluation reply is left out: %s", err)
                continue
            results[client] = metrics
        if time.monotonic() - said >= PROGRESS_EVERY_S:
            said = time.monotonic()
            log(INFO, "client evaluation: %d of %d clients asked, %d replied", start + len(wave_targets), len(targets),
                len(results))
    return results, len(targets)


def check_evaluation(metrics: dict[str, float], max_examples: int) -> None:
    """Raise :class:`RejectedReply` unless `metrics` (an evaluate reply's, checked finite by ``parse_metrics``) hold
    ``num-examples`` in [0, `max_examples`], ``eval-loss`` ≥ 0 and ``eval-accuracy`` in [0, 1], and ``val-*`` alike
    when present: what the summaries read."""
    for key in (NUM_EXAMPLES, "eval-loss", "eval-accuracy"):
        if key not in metrics:
            raise RejectedReply(f"an evaluation reply lacks '{key}'")
    reply_number(metrics, NUM_EXAMPLES, 0, max_examples, integral=True)
    for key in ("eval-loss", "val-loss"):
        if key in metrics:
            reply_number(metrics, key, 0)
    for key in ("eval-accuracy", "val-accuracy"):
        if key in metrics:
            reply_number(metrics, key, 0, 1)


def federated_evaluate(grid: Grid, directory: NodeDirectory, dispatcher: Dispatcher, strategy: Strategy,
                       timeout: float, max_examples: Callable[[int], int] = lambda client: MAX_COUNT,
                       ) -> dict[str, float]:
    """:func:`client_evaluate`, as example-weighted means, plus how many replied."""
    per_client, asked = client_evaluate(grid, directory, dispatcher, strategy, timeout, max_examples=max_examples)
    result = weighted_mean((m[NUM_EXAMPLES], {k: v for k, v in m.items() if k != NUM_EXAMPLES})
                           for _, m in sorted(per_client.items()))
    return {**result, "replies": len(per_client), "sampled": asked}


def personal_summary(per_client: dict[int, dict[str, float]]) -> dict[str, float]:
    """Personalised evaluation as the FedMerge paper reports it: the unweighted mean over clients of each
    client's accuracy on its own test split, with the distribution (min, quartiles) and the mean losses."""
    acc = np.array([m["eval-accuracy"] for _, m in sorted(per_client.items())])
    if not len(acc):
        return {"clients": 0}
    out = {"accuracy": float(acc.mean()), "accuracy-min": float(acc.min()),
           **{f"accuracy-{name}": float(np.quantile(acc, q)) for name, q in (("q25", 0.25), ("median", 0.5),
                                                                           ("q75", 0.75))},
           "loss": float(np.mean([m["eval-loss"] for m in per_client.values()])), "clients": len(acc)}
    if all("val-loss" in m for m in per_client.values()):
        out["val-loss"] = float(np.mean([m["val-loss"] for m in per_client.values()]))
        out["val-accuracy"] = float(np.mean([m["val-accuracy"] for m in per_client.values()]))
    return out
