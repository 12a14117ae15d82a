"""Every hybridfl strategy as a Flower ``Strategy``: ``FlowerStrategy(FedBuff()).start(grid, arrays, ...)``.

The wrapper is a driver of the same :class:`~server_app.runtime.Runner` the hybridfl runtime uses —
its client sampling, train seeds, payloads, reply checks, counters and events — under Flower's own
``start()`` round loop: ``configure_train`` samples ``clients_per_round`` clients and sends each its
``model_for`` payload; ``aggregate_train`` hands the replies over in dispatch order (a bad one is
rejected and counted), closes the round and lets the strategy step (with the server's data) when it
is ready. Flower's rounds end with a barrier, so this is the virtual clock with σ = 0: a synchronous
method gives the same models and metrics under both loops (tested).

``start(..., clock="virtual" | "wall", delay_sigma=..., concurrency=...)`` runs the hybridfl runtime
behind the same call instead, for asynchronous training from a Flower user's ServerApp.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import Strategy as FlowerBase

from common.params import ParamSpec
from common.protocol import METRICS, NUM_EXAMPLES, PARTITION_ID
from server_app.messaging import federated_evaluate, weighted_mean
from server_app.runtime import Flight, Runner, StepLog
from strategies.base import Strategy, Update


class FlowerStrategy(FlowerBase):
    """A hybridfl strategy under Flower's ``Strategy`` interface.

    Args:
        strategy: the hybridfl strategy (initialised from ``start``'s arrays unless `runner` is given).
        clients_per_round: clients sampled per round.
        evaluate_clients: clients asked to evaluate after each round (0: no per-round federated evaluation).
        seed: seeds sampling and the clients' train seeds.
        server_data: the server's own data, for the methods that use it.
        runner: a runner already wired to the grid (the ServerApp's); otherwise ``start`` builds one.
        on_step: called with each round's :class:`StepLog` (the ServerApp evaluates, records, checkpoints).
        first_step: the step number of round 1 (a resumed run goes on from its checkpoint's step).
    """

    def __init__(self, strategy: Strategy, *, clients_per_round: int = 10, evaluate_clients: int = 0, seed: int = 0,
                 server_data: Any = None, runner: Runner | None = None,
                 on_step: Callable[[StepLog], None] | None = None, first_step: int = 1) -> None:
        self.strategy, self.runner, self.on_step, self.first_step = strategy, runner, on_step, first_step
        self.clients_per_round, self.evaluate_clients = clients_per_round, evaluate_clients
        self.seed, self.server_data = seed, server_data
        self._rng = random.Random(seed)  # evaluation sampling only
        self._round: tuple[StepLog, list[Update], float, list[tuple[Message, Flight]]] | None = None

    def _runner(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord | None, **runtime: Any) -> Runner:
        if self.runner is None:
            spec = ParamSpec.of_record(arrays)
            self.strategy.initialize(spec.from_record(arrays), spec)
            self.runner = Runner(grid, self.strategy, dict(config or {}), clients_per_round=self.clients_per_round,
                                 seed=self.seed, server_data=self.server_data, **runtime)
        return self.runner

    def _headline(self) -> ArrayRecord:
        return self.strategy.spec.to_record(next(iter(self.strategy.central_models().values())))

    # -- Flower's Strategy --------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        runner = self._runner(grid, arrays, config)
        if len(runner.directory.node_of) < runner.clients_per_round:
            runner.directory.wait_for(runner.clients_per_round, runner.wait_nodes, runner.poll_interval)
        step = self.first_step + server_round - 1
        entry, accepted = runner.open_step(step)
        flights = runner.launch(runner.sample(runner.clients_per_round), step, virtual=True)
        entry.sampled = len(flights)
        outgoing = [(runner.message(f), f) for f in flights]
        self._round = (entry, accepted, time.perf_counter(), outgoing)
        return [m for m, _ in outgoing]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        entry, accepted, started, outgoing = self._round
        by_request = {m.metadata.reply_to_message_id: m for m in replies}
        for msg, flight in outgoing:  # dispatch order, whatever order the replies came in
            self.runner.hand_over(flight, by_request.get(msg.metadata.message_id), entry.round, entry, accepted)
        entry = self.runner.close_step(entry, accepted, started)
        if self.on_step:
            self.on_step(entry)
        row = {k: v for k, v in entry.to_dict().items() if isinstance(v, (int, float))}
        return self._headline(), MetricRecord(row)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        runner = self._runner(grid, arrays, config)
        connected = runner.directory.poll()
        clients = sorted(c for c, n in runner.directory.node_of.items() if n in connected)
        chosen = sorted(self._rng.sample(clients, min(self.evaluate_clients, len(clients))))
        messages = []
        for c in chosen:
            payload = self.strategy.model_for(c)
            payload = dataclasses.replace(payload, config={**payload.config, **dict(config)})
            messages.append(runner.dispatcher.message(runner.directory.node_of[c], payload, self.strategy.version,
                                                      MessageType.EVALUATE))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        ok = [m.content[METRICS] for m in replies if not m.has_error() and METRICS in m.content.metric_records]
        if not ok:
            return None
        return MetricRecord(weighted_mean(
            (float(r[NUM_EXAMPLES]), {k: float(v) for k, v in r.items() if k not in (NUM_EXAMPLES, PARTITION_ID)})
            for r in ok))

    def summary(self) -> None:
        log(INFO, "%s under Flower's start(): %s", type(self.strategy).__name__, self.strategy.describe())

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None, *,
              clock: str | None = None, delay_sigma: float = 0.0, concurrency: int | None = None) -> Result:
        """Flower's ``start``: its round loop, or with `clock` the hybridfl runtime (``"virtual"`` delays of
        σ = `delay_sigma` steps, or ``"wall"`` with `concurrency` clients busy). `train_config` is what every
        message carries (for the project's ClientApp: the data spec, model and local recipe)."""
        if clock is None:
            self._runner(grid, initial_arrays, train_config, reply_timeout=timeout, wait_nodes=timeout)
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)
        runner = self._runner(grid, initial_arrays, train_config, clock=clock, delay_sigma=delay_sigma,
                              concurrency=concurrency or self.clients_per_round, reply_timeout=timeout,
                              wait_nodes=timeout)
        runner.directory.wait_for(self.clients_per_round, timeout, runner.poll_interval)
        result = Result()
        if evaluate_fn and (metrics := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = metrics

        def on_step(entry: StepLog) -> None:
            result.train_metrics_clientapp[entry.round] = MetricRecord(entry.train)
            if evaluate_fn and (metrics := evaluate_fn(entry.round, self._headline())) is not None:
                result.evaluate_metrics_serverapp[entry.round] = metrics

        runner.run(num_rounds, on_step)
        result.evaluate_metrics_clientapp[num_rounds] = MetricRecord(
            federated_evaluate(grid, runner.directory, runner.dispatcher, self.strategy, timeout))
        result.arrays = self._headline()
        return result
