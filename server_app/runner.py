"""Runners: they own timing and the network (a Flower ``Grid``); strategies own the math.

``NodeDirectory`` learns which client (partition) each node holds, so sampling, seeds and
aggregation order depend on stable client ids, not on the random node ids of a run.
``SyncRunner`` runs rounds with a barrier: sample, dispatch, collect until every reply is in
or the round times out, hand the good updates to the strategy, close the round, aggregate.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from common.params import ParamSpec
from common.protocol import ARRAYS, CONFIG, METRICS, PARTITION_ID, TRAIN_SEED, VERSION
from common.training import derive_seed
from strategies.base import HybridStrategy, RejectedReply, Update, parse_reply, weighted_mean

POLL_INTERVAL_S = 0.05


def collect(grid: Grid, message_ids: Iterable[str], timeout: float, poll: float = POLL_INTERVAL_S) -> list[Message]:
    """Replies to `message_ids` that arrive within `timeout` seconds (polling every `poll` s)."""
    pending = set(message_ids)
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending:
        got = list(grid.pull_messages(list(pending)))
        replies.extend(got)
        pending -= {m.metadata.reply_to_message_id for m in got}
        if not pending or time.monotonic() >= deadline:
            break
        if not got:
            time.sleep(poll)
    return replies


class NodeDirectory:
    """Which node holds which client partition, learned by a ``query`` message to each new node."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.node_of: dict[int, int] = {}  # client (partition id) -> node id

    @property
    def clients(self) -> list[int]:
        return sorted(self.node_of)

    def wait_for(self, count: int, timeout: float) -> None:
        """Block until `count` clients are known; raise a clear error after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        asked: dict[str, int] = {}  # query message id -> node id
        while len(self.node_of) < count:
            known = set(self.node_of.values()) | set(asked.values())
            new = [n for n in sorted(self.grid.get_node_ids()) if n not in known]
            if new:
                msgs = [Message(RecordDict({CONFIG: ConfigRecord({})}), dst_node_id=n, message_type=MessageType.QUERY)
                        for n in new]
                asked.update(zip(self.grid.push_messages(msgs), new))
            for reply in collect(self.grid, list(asked), timeout=0.0):
                node = asked.pop(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    log(WARNING, "node %d did not describe itself: %s", node, reply.error.reason)
                    continue
                client = int(reply.content[METRICS][PARTITION_ID])
                if client in self.node_of and self.node_of[client] != node:
                    log(WARNING, "nodes %d and %d both hold partition %d; using %d", self.node_of[client], node,
                        client, self.node_of[client])
                    continue
                self.node_of[client] = node
            if len(self.node_of) >= count:
                break
            if time.monotonic() >= deadline:
                raise RuntimeError(f"only {len(self.node_of)} of {count} clients connected within {timeout:.0f}s "
                                   f"(partitions {self.clients}); start more SuperNodes or raise wait-nodes-s")
            time.sleep(POLL_INTERVAL_S)
        log(INFO, "%d clients connected: partition -> node %s", len(self.node_of), self.node_of)


@dataclass
class Dispatcher:
    """Builds train/evaluate messages from a strategy's payload, tagged with the model version.

    `run_config` holds what every message carries (data spec, model name); each train message
    gets a seed derived from (run seed, client, how many times that client was dispatched).
    """

    spec: ParamSpec
    run_config: dict[str, Any]
    seed: int
    _dispatches: dict[int, int] = field(default_factory=dict)

    def message(self, node: int, client: int, params, config: dict[str, Any], version: int,
                message_type: str = MessageType.TRAIN) -> Message:
        config = {**self.run_config, **config, VERSION: version}
        if message_type == MessageType.TRAIN:
            count = self._dispatches.get(client, 0)
            self._dispatches[client] = count + 1
            config[TRAIN_SEED] = derive_seed(self.seed, client, count)
        content = RecordDict({ARRAYS: self.spec.to_record(params), CONFIG: ConfigRecord(config)})
        return Message(content, dst_node_id=node, message_type=message_type, group_id=str(version))


@dataclass
class RoundLog:
    """What happened in one round, as written to metrics.jsonl."""

    round: int
    version: int
    sampled: int
    accepted: int = 0
    failures: int = 0  # error replies: exception on the device, node unavailable
    rejected: int = 0  # replies that arrived but could not be used (shape, NaN, missing keys)
    timeouts: int = 0  # no reply before round-timeout-s
    train: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("train", "test")}
        out.update({f"train-{k.removeprefix('train-')}": v for k, v in self.train.items()})
        out.update({f"test-{k}": v for k, v in self.test.items()})
        return out


class SyncRunner:
    """Synchronous rounds over a Grid.

    Args:
        grid: Flower grid (simulation, deployment, or the in-process engine).
        strategy: an initialised :class:`HybridStrategy`.
        directory: node <-> client map (already filled with `wait_for`).
        dispatcher: builds the messages.
        clients_per_round: clients sampled per round (from the known clients, seeded).
        round_timeout: seconds a round waits for replies.
        seed: seeds client sampling.
        server_data: passed to ``strategy.aggregate`` (the server's central data, or None).
    """

    def __init__(self, grid: Grid, strategy: HybridStrategy, directory: NodeDirectory, dispatcher: Dispatcher,
                 clients_per_round: int, round_timeout: float, seed: int, server_data: Any = None) -> None:
        self.grid, self.strategy, self.directory, self.dispatcher = grid, strategy, directory, dispatcher
        self.clients_per_round, self.round_timeout, self.server_data = clients_per_round, round_timeout, server_data
        self._rng = random.Random(seed)

    def run_round(self, rnd: int) -> RoundLog:
        t0 = time.perf_counter()
        clients = sorted(self._rng.sample(self.directory.clients, min(self.clients_per_round,
                                                                      len(self.directory.clients))))
        version = self.strategy.version
        msgs = []
        for c in clients:
            payload = self.strategy.configure(c, version)
            msgs.append(self.dispatcher.message(self.directory.node_of[c], c, payload.params, payload.config, version))
        ids = list(self.grid.push_messages(msgs))
        replies = collect(self.grid, ids, self.round_timeout)
        log_ = RoundLog(rnd, version, len(clients), timeouts=len(ids) - len(replies))
        accepted: list[Update] = []
        for msg in replies:
            try:
                update = parse_reply(msg, self.dispatcher.spec)
            except RejectedReply as err:
                if msg.has_error():
                    log_.failures += 1
                else:
                    log_.rejected += 1
                log(WARNING, "round %d: reply from node %d rejected: %s", rnd, msg.metadata.src_node_id, err)
                continue
            self.strategy.receive(update)
            accepted.append(update)
        self.strategy.close_round()
        if self.strategy.ready():
            self.strategy.aggregate(self.server_data)
        log_.accepted, log_.version = len(accepted), self.strategy.version
        log_.train = weighted_mean((u.num_examples, u.metrics) for u in accepted)
        log_.seconds = time.perf_counter() - t0
        if log_.timeouts:
            log(WARNING, "round %d: %d replies did not arrive within %.0fs", rnd, log_.timeouts, self.round_timeout)
        return log_

    def run(self, num_rounds: int, on_round: Callable[[RoundLog], None]) -> None:
        """Run `num_rounds` rounds, calling `on_round` after each (evaluation, logging)."""
        for rnd in range(1, num_rounds + 1):
            on_round(self.run_round(rnd))


def federated_evaluate(grid: Grid, directory: NodeDirectory, dispatcher: Dispatcher, params, version: int,
                       timeout: float) -> dict[str, float]:
    """Evaluate `params` on every known client's partition; example-weighted means (+ replies count)."""
    msgs = [dispatcher.message(node, client, params, {}, version, MessageType.EVALUATE)
            for client, node in sorted(directory.node_of.items())]
    replies = [m for m in collect(grid, grid.push_messages(msgs), timeout) if not m.has_error()]
    result = weighted_mean((float(m.content[METRICS]["num-examples"]),
                            {k: float(m.content[METRICS][k]) for k in ("eval-loss", "eval-accuracy")})
                           for m in replies)
    return {**result, "replies": len(replies), "sampled": len(msgs)}
