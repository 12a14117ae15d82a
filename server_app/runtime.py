"""The runtime: one loop over a Flower ``Grid`` for synchronous and asynchronous training.

The runner owns timing and the network; the strategy owns the math. Each *step* the runner
dispatches work, hands arriving updates to the strategy one by one (``receive``; ``aggregate``
whenever ``ready()``), then closes the step (``close_round``; ``aggregate`` if ``ready()``).
At most one message is in flight per client (= per node); every dispatch is tagged with the
model version it carries, and staleness = current version − that version.

Two clocks decide when an update is handed over:

* ``virtual`` (simulation, tests, benchmarks; Feddle App. D): at step k the runner samples N idle
  clients (fewer if fewer are idle), draws each one's delay d = round(|z|), z ~ N(0, σ²), in server
  steps, and hands its update over at step k + d, whatever order replies physically arrive in.
  The event sequence and the final model depend only on the seed. σ = 0 is synchronous FL: every
  update of step k arrives in step k (a round with a barrier).
* ``wall`` (deployment): keeps ``concurrency`` clients busy and hands updates over in real arrival
  order, re-dispatching to an idle client as soon as a slot frees; a step closes every N arrivals.

An error reply, an unusable reply or a reply slower than ``reply-timeout-s`` frees its slot and the
work goes to another idle client; a run with no reachable client for ``wait-nodes-s`` fails.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from common.params import ParamSpec
from server_app.messaging import Dispatcher, NodeDirectory, federated_evaluate
from strategies.base import HybridStrategy, RejectedReply, Update, parse_reply, weighted_mean

CLOCKS = ("virtual", "wall")


@dataclass
class Flight:
    """One dispatched update on its way."""

    seq: int  # dispatch order: ties between arrivals are broken by it, so runs are reproducible
    client: int
    node: int
    message_id: str
    version: int  # the model version it carries
    dispatch_step: int
    due_step: int  # virtual clock: the step it is handed over in; wall clock: unused (-1)
    sent_at: float  # perf_counter() at push


@dataclass
class StepLog:
    """What happened in one step (a round when the clock is synchronous); a line of metrics.jsonl."""

    round: int
    version: int
    sampled: int = 0  # dispatches made in this step (replacements included)
    accepted: int = 0
    failures: int = 0  # error replies: exception on the device, node unavailable
    rejected: int = 0  # replies that arrived but could not be used (shape, NaN, missing keys)
    timeouts: int = 0  # no reply within reply-timeout-s
    staleness: list[int] = field(default_factory=list)
    train: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)  # with validation-size, for tuning
    strategy: dict[str, float] = field(default_factory=dict)  # e.g. Feddle's coefficient search
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("train", "test", "validation", "staleness", "strategy")}
        out.update(self.strategy)
        if self.staleness:
            out["staleness-mean"] = float(np.mean(self.staleness))
            out["staleness-max"] = int(max(self.staleness))
        out.update({f"train-{k.removeprefix('train-')}": v for k, v in self.train.items()})
        out.update({f"test-{k}": v for k, v in self.test.items()})
        out.update({f"val-{k}": v for k, v in self.validation.items()})
        return out


class Runner:
    """Drives a strategy over a Grid with a virtual or a wall clock (see the module docstring).

    Args:
        grid: Flower grid (simulation, deployment, or the in-process engine).
        strategy: an initialised :class:`HybridStrategy`.
        directory: node <-> client map (filled with ``wait_for`` before ``run``).
        dispatcher: builds the messages.
        clients_per_round: N, clients sampled per step (virtual) / arrivals per step (wall).
        clock: ``"virtual"`` or ``"wall"``.
        delay_sigma: σ of the virtual half-normal delay, in server steps (0 = synchronous).
        concurrency: clients kept busy by the wall clock.
        reply_timeout: seconds after which an unanswered dispatch is given up.
        poll_interval: seconds between ``pull_messages`` calls when nothing arrived.
        wait_nodes: seconds to wait for a reachable client before failing the run.
        seed: seeds client sampling and delays.
        server_data: passed to ``strategy.aggregate``.
        on_event: called with a dict for every update handed over or lost (events.jsonl).
    """

    def __init__(self, grid: Grid, strategy: HybridStrategy, directory: NodeDirectory, dispatcher: Dispatcher, *,
                 clients_per_round: int, clock: str = "virtual", delay_sigma: float = 0.0, concurrency: int = 10,
                 reply_timeout: float = 600.0, poll_interval: float = 0.05, wait_nodes: float = 120.0,
                 seed: int = 0, server_data: Any = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r} is not one of {CLOCKS}")
        self.grid, self.strategy, self.directory, self.dispatcher = grid, strategy, directory, dispatcher
        self.clients_per_round, self.clock, self.delay_sigma = clients_per_round, clock, delay_sigma
        self.concurrency, self.reply_timeout, self.poll_interval = concurrency, reply_timeout, poll_interval
        self.wait_nodes, self.server_data = wait_nodes, server_data
        self.on_event = on_event or (lambda event: None)
        self._sample_rng = random.Random(seed)
        self._delay_rng = np.random.default_rng([seed, 2])
        self.flights: dict[int, Flight] = {}  # client -> its flight
        self._replies: dict[str, Message | None] = {}  # message id -> reply (None: timed out)
        self._seq = 0
        self._reachable: set[int] = set()
        self._reachable_at = -1e9
        self._t0 = time.perf_counter()
        self.reply_to_dispatch: list[float] = []  # wall clock: seconds from a reply to the next dispatch

    # -- shared machinery -------------------------------------------------------------------
    def delay(self) -> int:
        """A virtual delay in server steps: round(|z|), z ~ N(0, σ²)."""
        return int(round(abs(self._delay_rng.normal(0.0, self.delay_sigma)))) if self.delay_sigma > 0 else 0

    def reachable(self, refresh_every: float = 0.0) -> set[int]:
        """Clients whose node is connected now (node list re-read at most every `refresh_every` s)."""
        if time.perf_counter() - self._reachable_at >= refresh_every:
            nodes = self.directory.poll()
            self._reachable = {c for c, n in self.directory.node_of.items() if n in nodes}
            self._reachable_at = time.perf_counter()
        return self._reachable

    def idle(self, exclude: set[int] = frozenset(), refresh_every: float = 0.0) -> list[int]:
        return sorted(self.reachable(refresh_every) - set(self.flights) - exclude)

    def sample(self, k: int, exclude: set[int] = frozenset(), refresh_every: float = 0.0) -> list[int]:
        """`k` idle reachable clients (fewer if fewer are idle), drawn with the run's seed, in client order."""
        idle = self.idle(exclude, refresh_every)
        return sorted(self._sample_rng.sample(idle, min(k, len(idle))))

    def dispatch(self, clients: list[int], step: int, virtual: bool) -> None:
        version = self.strategy.version
        msgs, flights = [], []
        for c in clients:
            payload = self.strategy.configure(c, version)
            node = self.directory.node_of[c]
            msgs.append(self.dispatcher.message(node, c, payload.params, payload.config, version))
            self._seq += 1
            flights.append(Flight(self._seq, c, node, "", version, step, step + self.delay() if virtual else -1, 0.0))
        if not msgs:
            return
        now = time.perf_counter()
        for flight, mid in zip(flights, self.grid.push_messages(msgs)):
            flight.message_id, flight.sent_at = mid, now
            self.flights[flight.client] = flight

    def poll(self) -> bool:
        """Pull replies of every flight, mark flights past the timeout; True if anything new."""
        waiting = [f.message_id for f in self.flights.values() if f.message_id not in self._replies]
        if not waiting:
            return False
        got = list(self.grid.pull_messages(waiting))
        for m in got:
            self._replies[m.metadata.reply_to_message_id] = m
        now = time.perf_counter()
        late = [f for f in self.flights.values()
                if f.message_id not in self._replies and now - f.sent_at > self.reply_timeout]
        for f in late:
            self._replies[f.message_id] = None
        return bool(got or late)

    def hand_over(self, flight: Flight, step: int, entry: StepLog, accepted: list[Update]) -> bool:
        """Give `flight`'s reply to the strategy (aggregating whenever it is ready); False if it failed."""
        del self.flights[flight.client]
        reply = self._replies.pop(flight.message_id)
        event = {"step": step, "client": flight.client, "node": flight.node, "base-version": flight.version,
                 "dispatch-step": flight.dispatch_step, "t": round(time.perf_counter() - self._t0, 4)}
        if reply is None:
            outcome, reason = "timeout", f"no reply within {self.reply_timeout:.0f}s"
            entry.timeouts += 1
        else:
            try:
                update = parse_reply(reply, self.dispatcher.spec)
                outcome, reason = "accepted", ""
            except RejectedReply as err:
                outcome, reason = ("failure" if reply.has_error() else "rejected"), str(err)
                if reply.has_error():
                    entry.failures += 1
                else:
                    entry.rejected += 1
        if outcome != "accepted":
            log(WARNING, "step %d: update of client %d (node %d) lost: %s", step, flight.client, flight.node, reason)
            self.strategy.forget(flight.client)
            self.on_event({**event, "outcome": outcome, "reason": reason})
            return False
        staleness = update.staleness(self.strategy.version)
        self.strategy.receive(update)
        accepted.append(update)
        entry.accepted += 1
        entry.staleness.append(staleness)
        if self.strategy.ready():
            self.strategy.aggregate(self.server_data)
        self.on_event({**event, "outcome": "accepted", "staleness": staleness, "version": self.strategy.version})
        return True

    def close_step(self, entry: StepLog, accepted: list[Update], started: float) -> StepLog:
        self.strategy.close_round()
        if self.strategy.ready():
            self.strategy.aggregate(self.server_data)
        entry.version = self.strategy.version
        entry.strategy = self.strategy.metrics()
        entry.train = weighted_mean((u.num_examples, u.metrics) for u in accepted)
        entry.seconds = time.perf_counter() - started
        return entry

    def wait_for_reachable(self, step: int) -> None:
        """Nothing in flight and nobody to dispatch to: wait for a client to (re)connect, or fail."""
        deadline = time.perf_counter() + self.wait_nodes
        while not self.idle(refresh_every=1.0):
            if time.perf_counter() >= deadline:
                raise RuntimeError(f"step {step}: no reachable client for {self.wait_nodes:.0f}s "
                                   f"(known partitions {self.directory.clients}); is any SuperNode running?")
            time.sleep(min(1.0, self.wait_nodes))

    def latency_summary(self) -> dict[str, float]:
        """Median and p95 of the wall clock's reply -> next-dispatch latency (empty for the virtual clock)."""
        if not self.reply_to_dispatch:
            return {}
        lat = np.asarray(self.reply_to_dispatch)
        return {"median": float(np.median(lat)), "p95": float(np.percentile(lat, 95)), "count": int(lat.size)}

    # -- the two clocks -----------------------------------------------------------------------
    def run(self, num_steps: int, on_step: Callable[[StepLog], None]) -> None:
        """Run `num_steps` server steps, calling `on_step` after each (evaluation, logging)."""
        self._t0 = time.perf_counter()
        loop = self._run_virtual if self.clock == "virtual" else self._run_wall
        loop(num_steps, on_step)
        if self.flights:
            log(INFO, "%d dispatched updates still in flight at the end are discarded", len(self.flights))

    def _run_virtual(self, num_steps: int, on_step: Callable[[StepLog], None]) -> None:
        for step in range(1, num_steps + 1):
            started = time.perf_counter()
            entry, accepted = StepLog(step, self.strategy.version), []
            if not self.flights and not self.idle():
                self.wait_for_reachable(step)
            chosen = self.sample(self.clients_per_round)
            self.dispatch(chosen, step, virtual=True)
            entry.sampled = len(chosen)
            sampled = set(chosen)  # a client is sampled at most once per step
            while due := sorted((f for f in self.flights.values() if f.due_step <= step), key=lambda f: f.seq):
                while any(f.message_id not in self._replies for f in due):
                    if not self.poll():
                        time.sleep(self.poll_interval)
                for f in due:
                    if not self.hand_over(f, step, entry, accepted):
                        replacement = self.sample(1, exclude=sampled)
                        self.dispatch(replacement, step, virtual=True)
                        sampled.update(replacement)
                        entry.sampled += len(replacement)
            on_step(self.close_step(entry, accepted, started))

    def _run_wall(self, num_steps: int, on_step: Callable[[StepLog], None]) -> None:
        step, started = 1, time.perf_counter()
        entry, accepted = StepLog(step, self.strategy.version), []
        while True:
            if not self.flights and not self.idle(refresh_every=1.0):
                self.wait_for_reachable(step)
            free = self.concurrency - len(self.flights)
            if free > 0:
                fresh = self.sample(free, refresh_every=1.0)
                self.dispatch(fresh, step, virtual=False)
                entry.sampled += len(fresh)
            if not self.poll():
                time.sleep(self.poll_interval)
                continue
            arrived = sorted((f for f in self.flights.values() if f.message_id in self._replies), key=lambda f: f.seq)
            for f in arrived:
                got_at = time.perf_counter()
                self.hand_over(f, step, entry, accepted)
                # Refill the freed slot at once: the reply -> next dispatch latency is the runtime's overhead.
                fresh = self.sample(1, refresh_every=1.0)
                self.dispatch(fresh, step, virtual=False)
                if fresh:
                    self.reply_to_dispatch.append(time.perf_counter() - got_at)
                    entry.sampled += 1
                if entry.accepted + entry.failures + entry.rejected + entry.timeouts >= self.clients_per_round:
                    on_step(self.close_step(entry, accepted, started))
                    if step == num_steps:
                        return
                    step, started = step + 1, time.perf_counter()
                    entry, accepted = StepLog(step, self.strategy.version), []


def flower_start(strategy: HybridStrategy, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int, timeout: float,
                 train_config: ConfigRecord | None, evaluate_config: ConfigRecord | None,
                 evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None, *, clock: str,
                 delay_sigma: float, concurrency: int) -> Result:
    """Flower's ``Strategy.start`` contract on the hybridfl runtime: `num_rounds` server steps, the
    train/evaluate configs sent with every message, `evaluate_fn(step, arrays)` after each step, and
    a Flower ``Result``. Used by :class:`strategies.base.AsyncStrategy`."""
    spec = ParamSpec.of_record(initial_arrays)
    strategy.initialize(spec.from_record(initial_arrays), spec)
    directory = NodeDirectory(grid)
    directory.wait_for(strategy.clients_per_round, timeout)
    dispatcher = Dispatcher(spec, dict(train_config or {}), strategy.seed)
    runner = Runner(grid, strategy, directory, dispatcher, clients_per_round=strategy.clients_per_round,
                    clock=clock, delay_sigma=delay_sigma, concurrency=concurrency, reply_timeout=timeout,
                    wait_nodes=timeout, seed=strategy.seed)
    result = Result()
    if evaluate_fn and (metrics := evaluate_fn(0, initial_arrays)) is not None:
        result.evaluate_metrics_serverapp[0] = metrics

    def on_step(entry: StepLog) -> None:
        result.train_metrics_clientapp[entry.round] = MetricRecord(entry.train)
        if evaluate_fn and (metrics := evaluate_fn(entry.round, spec.to_record(strategy.params))) is not None:
            result.evaluate_metrics_serverapp[entry.round] = metrics

    runner.run(num_rounds, on_step)
    eval_dispatcher = Dispatcher(spec, dict(evaluate_config or {}), strategy.seed)
    result.evaluate_metrics_clientapp[num_rounds] = MetricRecord(
        federated_evaluate(grid, directory, eval_dispatcher, strategy.params, strategy.version, timeout))
    result.arrays = spec.to_record(strategy.params)
    return result
