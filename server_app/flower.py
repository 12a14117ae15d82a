"""Every hybridfl strategy as a Flower ``Strategy``: ``FlowerStrategy(FedBuff()).start(grid, arrays, ...)``.

The wrapper drives the same :class:`~server_app.runtime.Runner` the hybridfl runtime uses —
its client sampling, train seeds, payloads, reply checks, counters and events — one round at a time
under Flower's own ``start()`` round loop (``server_app.clocks.OuterLoop``): ``configure_train`` is its
``begin_round`` (``clients_per_round`` clients, each with its ``model_for`` payload); ``aggregate_train`` its
``end_round`` (the replies in dispatch order, a bad one rejected and counted, the strategy
stepping when it is ready). Flower's rounds end with a barrier, so this is
the virtual clock with σ = 0: a synchronous method gives the same models and metrics under both
loops (tested).

``start(..., clock="virtual" | "wall", delay_sigma=..., concurrency=...)`` runs the hybridfl runtime
behind the same call instead, for asynchronous training from a Flower user's ServerApp.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import Strategy as FlowerBase

from common.params import ParamSpec
from common.protocol import METRICS, NUM_EXAMPLES, PARTITION_ID
from server_app.clocks import OuterLoop
from server_app.evaluation import federated_evaluate, weighted_mean
from server_app.rounds import Round, RoundLog
from server_app.runtime import Runner, RuntimeConfig
from strategies.base import Strategy


class FlowerStrategy(FlowerBase):
    """A hybridfl strategy under Flower's ``Strategy`` interface.

    Args:
        strategy: the hybridfl strategy (initialised from ``start``'s arrays unless `runner` is given).
        clients_per_round: clients sampled per round.
        evaluate_clients: clients asked to evaluate after each round (0: no per-round federated evaluation).
        seed: seeds sampling and the clients' train seeds.
        server_data: the server's own data, for the methods that use it.
        runner: a runner already wired to the grid (the ServerApp's); otherwise ``start`` builds one.
        on_round: called with each round's :class:`RoundLog` (the ServerApp evaluates, records, checkpoints).
        first_round: the runtime's number of Flower's round 1 (a resumed run goes on from its checkpoint's round).
    """

    def __init__(self, strategy: Strategy, *, clients_per_round: int = 10, evaluate_clients: int = 0, seed: int = 0,
                 server_data: Any = None, runner: Runner | None = None,
                 on_round: Callable[[RoundLog], None] | None = None, first_round: int = 1) -> None:
        self.strategy, self.runner, self.on_round, self.first_round = strategy, runner, on_round, first_round
        self.clients_per_round, self.evaluate_clients = clients_per_round, evaluate_clients
        self.seed, self.server_data = seed, server_data
        self._rng = random.Random(seed)  # evaluation sampling only
        self._round: Round | None = None  # the round configure_train opened

    def _runner(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord | None, **runtime: Any) -> Runner:
        if self.runner is None:
            spec = ParamSpec.of_record(arrays)
            self.strategy.initialize(spec.from_record(arrays), spec)
            self.runner = Runner(grid, self.strategy, dict(config or {}),
                                 RuntimeConfig(clients_per_round=self.clients_per_round, **runtime), seed=self.seed,
                                 server_data=self.server_data)
        return self.runner

    def _headline(self) -> ArrayRecord:
        return self.strategy.spec.to_record(next(iter(self.strategy.central_models().values())))

    # -- Flower's Strategy --------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._round = OuterLoop(self._runner(grid, arrays, config)).begin_round(self.first_round + server_round - 1)
        return self._round.messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        entry = OuterLoop(self.runner).end_round(self._round, replies)
        if self.on_round:
            self.on_round(entry)
        row = {k: v for k, v in entry.to_dict().items() if isinstance(v, (int, float))}
        return self._headline(), MetricRecord(row)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._runner(grid, arrays, config).evaluate_messages(self.evaluate_clients, self._rng, dict(config))

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
        σ = `delay_sigma` rounds, or ``"wall"`` with `concurrency` clients busy). `train_config` is what every
        message carries (for the project's ClientApp: the data spec, model and local recipe)."""
        if clock is None:
            self._runner(grid, initial_arrays, train_config, reply_timeout_s=timeout, wait_nodes_s=timeout)
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)
        runner = self._runner(grid, initial_arrays, train_config, clock=clock, delay_sigma=delay_sigma,
                              concurrency=concurrency or self.clients_per_round, reply_timeout_s=timeout,
                              wait_nodes_s=timeout)
        runner.wait_for_nodes(self.clients_per_round)
        result = Result()
        if evaluate_fn and (metrics := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = metrics

        def on_round(entry: RoundLog) -> None:
            result.train_metrics_clientapp[entry.round] = MetricRecord(entry.train)
            if evaluate_fn and (metrics := evaluate_fn(entry.round, self._headline())) is not None:
                result.evaluate_metrics_serverapp[entry.round] = metrics

        runner.run(num_rounds, on_round)
        result.evaluate_metrics_clientapp[num_rounds] = MetricRecord(
            federated_evaluate(grid, runner.directory, runner.dispatcher, self.strategy, timeout,
                               runner.evaluated_examples))
        result.arrays = self._headline()
        return result
