"""The runtime: one loop over a Flower ``Grid`` for synchronous and asynchronous training.

The runner owns timing and the network; the strategy owns the math. One word per concept, in the code, the logs
and the outputs: each **round** (``num-rounds`` of them; a line of metrics.jsonl) the runner dispatches work, hands
arriving updates to the strategy one by one (``receive``; a strategy **step** whenever ``ready()``), then closes the
round (``close_round``; a step if ``ready()``). Every step makes the next model **version**; a round may hold no
step (a buffer still filling) or several (FedAsync steps on every update), and the round's line keeps them all.
At most one message is in flight per client (= per node); every dispatch is tagged with the
model version it carries, and staleness = current version − that version.

Three clocks decide when an update is handed over (``virtual``, ``wall``, ``device``): server_app/clocks.py,
one class each, over the runner's one table of flights (server_app/flights.py).

An error reply, an unusable reply or a reply slower than ``reply-timeout-s`` frees its slot and the
work goes to another idle client; a run with no reachable client for ``wait-nodes-s`` fails.

Every flight keeps the payload it carries (shared between the flights of one version) and its
``train-seed``: the update it brings back is handed to the strategy with that payload (``sent``),
and a resumed run sends exactly the same messages again (:meth:`Runner.state_dict`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message, MessageType
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from common.codecs import encoded_nbytes
from common.config import COUNT, POSITIVE, ConfigError, OneOf, Range, check_options, option
from common.fleet import Fleet, FleetName, fleet_names
from common.protocol import STRATEGY, UPDATES_BEFORE
from flower_internals.replies import ReplyPuller, push
from server_app.clocks import CLOCKS
from server_app.evaluation import weighted_mean
from server_app.flights import Flight, Flights, fate
from server_app.rounds import RoundLog
from server_app.wire import (
    MAX_COUNT,
    POLL_INTERVAL_S,
    POLL_MAX_INTERVAL_S,
    Dispatcher,
    NodeDirectory,
    Pace,
    read_update,
)
from strategies.base import Strategy, Update


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The runtime keys: how the runner drives the clients (server_app/clocks.py says how each clock works)."""

    clients_per_round: int = option(10, COUNT, "clients sampled per round (virtual clock); arrivals per round "
                                    "(wall clock)", "1 … `num-clients`")
    clock: str = option("virtual", OneOf(tuple(CLOCKS)), "virtual: seeded delays in rounds; wall: real arrival order; "
                        "device: arrival order in the fleet's device time (see above)")
    fleet: str = option("", FleetName(fleet_names), "the devices' profiles (compute, link, availability) that "
                        "device time follows: a built-in fleet or a fleet YAML file ([A real fleet]"
                        "(../tutorials/fleet.md))", "`\"\"`, `ideal`, `lognormal`, `intermittent`, a `.yaml` path")
    delay_sigma: float = option(0.0, Range(0), "σ of the half-normal client delay, in rounds "
                                "(0 = synchronous)")
    concurrency: int = option(10, COUNT, "clients kept busy by the wall clock")
    reply_timeout_s: float = option(600.0, POSITIVE, "seconds a dispatched update may take before it is given up")
    poll_interval_s: float = option(POLL_INTERVAL_S, Range(0, 1, low_open=True),
                                    "seconds between pulls for replies while they come")
    poll_max_interval_s: float = option(POLL_MAX_INTERVAL_S, Range(0, 10, low_open=True),
                                        "the longest wait between pulls: each pull that brings nothing doubles the "
                                        "wait, up to this (at least `poll-interval-s`); a reply brings it back to "
                                        "`poll-interval-s`")
    wait_nodes_s: float = option(120.0, POSITIVE,
                                 "seconds to wait for `num-clients` nodes at start (a resumed run then goes on with "
                                 "those connected), or for any node later")
    max_num_examples: int = option(0, Range(0), "the most `num-examples` a client's reply may claim; 0 = its "
                                   "partition's training size as the server cuts it (a reply claiming more is "
                                   "rejected: a device's lie would set its weight in every example-weighted mean)")
    max_update_ratio: float = option(100.0, Range(0), "an update whose ℓ2 norm exceeds this multiple of the model it "
                                     "started from (of 1, for a model of smaller norm) is rejected: a finite but huge "
                                     "update would leave a model every later client fails on (0 = no bound)")
    model_copies_mib: float = option(1024.0, POSITIVE, "MiB of the devices' model copies the server keeps for "
                                     "`model-difference` (a float32 model each); past it, the copy used longest ago is "
                                     "dropped, and that device's next message carries the whole model")
    time_budget_s: float = option(0.0, Range(0), "seconds of training after which the run ends with the round under "
                                  "way, evaluated and saved as its last (0 = none; a resumed run counts from its "
                                  "resumption): a deadline, or a load test's length")


class Runner:
    """Drives a strategy over a Grid with a virtual or a wall clock (see the module docstring).

    It owns the run's :class:`NodeDirectory` (node <-> client; fill it with ``directory.wait_for`` before
    ``run``) and :class:`Dispatcher` (messages and train seeds).

    Args:
        grid: Flower grid (simulation, deployment, or the in-process engine).
        strategy: an initialised :class:`~strategies.base.Strategy`.
        run_config: what every message carries (data spec, model, the clients' local recipe).
        runtime: the clock and its settings (:class:`RuntimeConfig`; default: its defaults).
        seed: seeds client sampling and delays.
        server_data: attached to the strategy (its one hand-over: ``strategy.server``).
        on_event: called with a dict for every update handed over or lost (events.jsonl).
        client_sizes: each client's parts' sizes as the server cuts them (``train``, ``test``): the most
            ``num-examples`` its replies may claim unless ``max-num-examples`` says otherwise; with `fleet`, what a
            message's compute time counts.
        fleet: client c's device is ``fleet.devices[c]`` (default: the ideal fleet, no device time).
    """

    def __init__(self, grid: Grid, strategy: Strategy, run_config: dict[str, Any],
                 runtime: RuntimeConfig | None = None, *, seed: int = 0, server_data: Any = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 client_sizes: Mapping[int, Mapping[str, int]] | None = None, fleet: Fleet | None = None) -> None:
        self.runtime = runtime if runtime is not None else RuntimeConfig()
        check_options(self.runtime)
        self.grid, self.strategy = grid, strategy
        self.replies = ReplyPuller(grid)
        self.pace = Pace(self.runtime.poll_interval_s, self.runtime.poll_max_interval_s)
        self.directory = NodeDirectory(grid, strategy.num_clients or MAX_COUNT, replies=self.replies, pace=self.pace)
        self.client_sizes = dict(client_sizes or {})
        self.fleet = None if fleet is None or fleet.ideal else fleet
        if self.runtime.clock == "device" and self.fleet is None:
            raise ValueError("clock='device' needs a fleet whose devices cost time (fleet='lognormal', a YAML file)")
        self._epochs = int(run_config.get("local-epochs", 1))
        self.device_t = 0.0
        copies = int(self.runtime.model_copies_mib * 2**20 // (4 * max(strategy.spec.numel, 1)))
        self.dispatcher = Dispatcher(strategy.spec, {**run_config, STRATEGY: strategy.reference(),
                                                     **strategy.client_options()}, seed, held_limit=copies)
        if self.dispatcher.codecs.model_difference and copies < 1:
            raise ConfigError("model-copies-mib", self.runtime.model_copies_mib,
                              f"at least {4 * strategy.spec.numel / 2**20:.3g} (one float32 copy of this model) with "
                              "model-difference = true")
        strategy.attach(server_data)
        self.on_event = on_event or (lambda event: None)
        self._sample_rng = random.Random(seed)
        self._delay_rng = np.random.default_rng([seed, 2])
        self.flights = Flights()
        self.discarded: list[str] = []  # the train messages still in flight when the run ended
        self.lost_at_resume: list[int] = []  # clients of flights restored from a checkpoint whose device is gone
        self.pushed_again: list[str] = []  # train messages of pushes the SuperLink lost, sent again under new ids
        self._seq = 0
        self._reachable: set[int] = set()
        self._reachable_at = -1e9
        # clients whose node the SuperLink answered for as unavailable, by when: out of the reachable ones until a
        # node list read after that lists their node again (a cached list re-dispatched to a gone device at once,
        # each message failing in milliseconds, until the run's failure budget was spent)
        self._gone: dict[int, float] = {}
        self._t0 = time.perf_counter()
        self._deadline = float("inf")  # time-budget-s, from the start of run()
        self.final_round: int | None = None  # the round that ends the run, once a loop has decided it
        self._strategy_steps: list[dict[str, float]] = []  # what each strategy step of the current round measured
        self._bytes_down = self._bytes_extra = 0  # payload bytes dispatched in the current round, and extra ones
        self._pulled = (0, 0)  # the reply puller's counts at the last round's close
        self.reply_to_dispatch: list[float] = []  # wall clock: seconds from a reply to the next dispatch
        # ... and two of its parts: handing the reply to the strategy (a strategy step when one is due), and
        # Flower's push of the next message to the SuperLink
        self.reply_parts: dict[str, list[float]] = {"hand-over": [], "push": []}
        self.first_loss = ""  # why the run's first update counted against max-failed-fraction was lost
        self.pushed_in = 0.0
        self._good: dict[str, Any] | None = None  # the strategy's state after its last step with a finite model

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs from the runner: its generators, the dispatch counter, the flights in
        the air with their payloads and seeds, each client's dispatch count and the elapsed time."""
        return {"sample-rng": self._sample_rng.getstate(), "delay-rng": self._delay_rng.bit_generator.state,
                "seq": self._seq, "flights": [f.state() for f in self.flights.in_order()],
                "dispatches": dict(self.dispatcher.dispatches), "elapsed": time.perf_counter() - self._t0,
                "device-t": self.device_t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state`; its flights are sent again (to their clients' current nodes) when the run goes on."""
        self._sample_rng.setstate(state["sample-rng"])
        self._delay_rng.bit_generator.state = state["delay-rng"]
        self._seq = state["seq"]
        self.flights = Flights(Flight(**f) for f in state["flights"])
        self.dispatcher.dispatches = dict(state["dispatches"])
        self._t0 = time.perf_counter() - state["elapsed"]
        self.device_t = state.get("device-t", 0.0)

    # -- shared machinery -------------------------------------------------------------------
    def _delay(self) -> int:
        """A virtual delay in rounds: round(|z|), z ~ N(0, σ²)."""
        sigma = self.runtime.delay_sigma
        return int(round(abs(self._delay_rng.normal(0.0, sigma)))) if sigma > 0 else 0

    def _reachable_clients(self, refresh_every: float = 0.0) -> set[int]:
        """Clients whose node is connected now (node list re-read at most every `refresh_every` s)."""
        if time.perf_counter() - self._reachable_at >= refresh_every:
            read_at = time.perf_counter()
            nodes = self.directory.poll()
            self._reachable = {c for c, n in self.directory.node_of.items() if n in nodes}
            self._reachable_at = read_at
            self._gone = {c: t for c, t in self._gone.items() if t >= read_at}
        return self._reachable - set(self._gone)

    def idle(self, exclude: set[int] = frozenset(), refresh_every: float = 0.0) -> list[int]:
        """Reachable clients with nothing in flight (in device time: whose device is online now)."""
        idle = self._reachable_clients(refresh_every) - set(self.flights) - exclude
        return sorted(c for c in idle if self._online(c))

    def _device_now(self) -> float:
        """Device time now: the host's seconds since the run started for the wall clock (its devices are real),
        the simulated fleet's for the others."""
        return time.perf_counter() - self._t0 if self.runtime.clock == "wall" else self.device_t

    def _online(self, client: int) -> bool:
        """Whether `client`'s device is online at the device time (the wall clock's real devices say so
        themselves: a device offline has no node)."""
        return self.fleet is None or self.runtime.clock == "wall" or self.fleet.devices[client].online(self.device_t)

    def skip_to_online(self) -> bool:
        """Nobody idle is online: move device time to the first time a reachable idle client's device comes online;
        False when none ever does (or device time does not apply)."""
        if self.fleet is None or self.runtime.clock == "wall":
            return False
        idle = self._reachable_clients() - set(self.flights)
        t = min((self.fleet.devices[c].next_online(self.device_t) for c in idle), default=float("inf"))
        if t == float("inf"):
            return False
        self.device_t = t
        return True

    def sample(self, k: int, exclude: set[int] = frozenset(), refresh_every: float = 0.0) -> list[int]:
        """`k` idle reachable clients (fewer if fewer are idle), drawn with the run's seed, in client order."""
        idle = self.idle(exclude, refresh_every)
        return sorted(self._sample_rng.sample(idle, min(k, len(idle))))

    def launch(self, clients: list[int], rnd: int, virtual: bool) -> list[Flight]:
        """New flights to `clients`: each gets the strategy's payload, a train seed and (virtual) a delay."""
        flights = []
        for c in clients:
            payload = self.strategy.model_for(c)
            down = self.dispatcher.model_nbytes(c, payload.params.numel()) + payload.extra_nbytes
            self._bytes_down += down
            self._bytes_extra += payload.extra_nbytes
            self._seq += 1
            now = self._device_now()
            flight = Flight(self._seq, c, self.strategy.version, rnd, rnd + self._delay() if virtual else -1, payload,
                            self.dispatcher.next_seed(c), device_start=now, device_done=now)
            if self.fleet is not None and self.runtime.clock != "wall":
                device = self.fleet.devices[c]
                examples = self.client_sizes.get(c, {}).get("train", 0) * self._epochs
                flight.device_done += device.message_s(
                    examples, down, self._wire_nbytes(self.dispatcher.codecs.update_codec, payload.params))
                flight.device_off = device.offline_at(self.device_t)
            flights.append(flight)
        return flights

    def message(self, flight: Flight) -> Message:
        """The train message of `flight`, addressed to its client's current node."""
        flight.node = self.directory.node_of[flight.client]
        return self.dispatcher.message(flight.node, flight.payload, flight.version, train_seed=flight.train_seed,
                                       config={UPDATES_BEFORE: self.dispatcher.dispatches[flight.client] - 1},
                                       client=flight.client)

    def _push(self, flights: list[Flight]) -> None:
        if not flights:
            return
        now = time.perf_counter()
        ids = push(self.grid, lambda: [self.message(f) for f in flights], abandoned=self.pushed_again)
        self.pushed_in = time.perf_counter() - now
        for flight, mid in zip(flights, ids):
            flight.message_id, flight.sent_at = mid, now
            self.flights[flight.client] = flight

    def dispatch(self, clients: list[int], rnd: int, virtual: bool) -> None:
        self._push(self.launch(clients, rnd, virtual))

    def _resend(self) -> None:
        """Send the flights restored from a checkpoint again (they were in the air when it was written)."""
        restored = [f for f in self.flights.in_order() if not f.message_id]
        gone = [f for f in restored if f.client not in self.directory.node_of]
        for f in gone:  # its device did not come back (the run resumed without it): counted, not sent
            del self.flights[f.client]
            restored.remove(f)
        self.lost_at_resume = [f.client for f in gone]
        if gone:
            log(WARNING, "%d updates in flight at the checkpoint were for clients whose devices did not come back, "
                "lost: clients %s", len(gone), self.lost_at_resume)
        if restored:
            log(INFO, "resending the %d updates that were in flight at the checkpoint", len(restored))
            self._push(restored)

    def poll(self, flights: list[Flight] | None = None) -> bool:
        """Pull the replies of `flights` (default: every flight); True if anything new (:meth:`Flights.poll`)."""
        return self.flights.poll(self.replies, self.runtime.reply_timeout_s, flights)

    def hand_over(self, flight: Flight, reply: Message | None, rnd: int, entry: RoundLog,
                   accepted: list[Update]) -> bool:
        """Give `flight`'s reply (None: timed out) to the strategy, stepping whenever it is ready; False if
        the update is lost (error, unusable, late)."""
        self.flights.pop(flight.client, None)
        self.dispatcher.settle(flight.client, reply)
        event = {"round": rnd, "client": flight.client, "node": flight.node, "message": flight.message_id,
                 "base-version": flight.version, "dispatch-round": flight.dispatch_round,
                 "t": round(time.perf_counter() - self._t0, 4), "device-start": round(flight.device_start, 4),
                 "device-t": round(self._device_now() if self.runtime.clock == "wall" else flight.ends, 4)}

        def read(reply: Message) -> Update:
            update = read_update(reply, flight.client, flight.version, flight.payload, self.dispatcher.spec,
                                 self._max_examples(flight.client), self.dispatcher.codecs,
                                 self.runtime.max_update_ratio)
            self.strategy.check(update)
            return update

        update, outcome, reason = fate(flight, reply, self.runtime.reply_timeout_s, read)
        if update is None:
            entry.lost(outcome)
            if outcome == "failure" and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                self._gone[flight.client] = time.perf_counter()
            log(WARNING, "round %d: update of client %d (node %d) lost: %s", rnd, flight.client, flight.node, reason)
            if not self.first_loss and outcome not in ("vanished", "unavailable"):
                self.first_loss = f"round {rnd}, client {flight.client}: {reason}"
            self.on_event({**event, "outcome": outcome, "reason": reason})
            return False
        staleness = update.staleness(self.strategy.version)
        if self._good is None:  # the state every update of the run is received into: the first good one
            self._good = self.strategy.state_dict()
        self.strategy.receive(update)
        accepted.append(update)
        entry.accepted += 1
        entry.bytes_up += self._wire_nbytes(self.dispatcher.codecs.update_codec, update.delta) + update.extra_nbytes
        entry.staleness.append(staleness)
        if self.strategy.ready():
            self._strategy_step(entry)
        self.on_event({**event, "outcome": "accepted", "staleness": staleness, "version": self.strategy.version})
        return True

    def _wire_nbytes(self, codec: str, flat: torch.Tensor) -> int:
        """The bytes `flat` (the model, or an update) takes on the wire through `codec` (the extras travel as
        float32)."""
        return encoded_nbytes(codec, flat.numel(), self.dispatcher.codecs)

    def _max_examples(self, client: int) -> int:
        """The most ``num-examples`` `client`'s train reply may claim (``max-num-examples``, else its training
        size)."""
        return self.runtime.max_num_examples or self.client_sizes.get(client, {}).get("train", MAX_COUNT)

    def evaluated_examples(self, client: int) -> int:
        """The most ``num-examples`` `client`'s evaluate reply may claim: its held-out test part, or its training
        part where it holds none out (``max-num-examples`` where set)."""
        sizes = self.client_sizes.get(client, {})
        return self.runtime.max_num_examples or max(sizes.get("train", MAX_COUNT), sizes.get("test", 0))

    def _strategy_step(self, entry: RoundLog) -> None:
        """The strategy's step; one that leaves a central model non-finite is refused: the strategy goes back to
        its state after its last good step (the updates received since are dropped with it) and the run goes on."""
        measured = self.strategy.step()
        bad = sorted(name for name, model in self.strategy.central_models().items() if not torch.isfinite(model).all())
        if bad:
            lost = self.strategy.version
            if self._good is not None:
                self.strategy.load_state_dict(self._good)
            entry.refused_steps += 1
            log(WARNING, "round %d: the step to version %d made a non-finite model (%s): refused, back to version %d",
                entry.round, lost, ", ".join(bad), self.strategy.version)
            self.on_event({"round": entry.round, "outcome": "refused-step", "version": lost,
                           "reason": f"non-finite model: {', '.join(bad)}",
                           "t": round(time.perf_counter() - self._t0, 4)})
            return
        self._good = self.strategy.state_dict()
        self._strategy_steps.append({"version": self.strategy.version, **measured})

    def open_round(self, rnd: int) -> tuple[RoundLog, list[Update]]:
        self._strategy_steps, self._bytes_down, self._bytes_extra = [], 0, 0
        return RoundLog(rnd, self.strategy.version), []

    def is_last(self, rnd: int, num_rounds: int) -> bool:
        """Whether round `rnd` ends the run: the last of `num_rounds`, or the one under way when ``time-budget-s``
        ran out (kept in :attr:`final_round`, by which the ServerApp evaluates and saves it as the last)."""
        if rnd == num_rounds or time.perf_counter() >= self._deadline:
            self.final_round = rnd
        return self.final_round == rnd

    def close_round(self, entry: RoundLog, accepted: list[Update], started: float) -> RoundLog:
        self.strategy.close_round()
        if self.strategy.ready():
            self._strategy_step(entry)
        entry.version = self.strategy.version
        entry.bytes_down, entry.bytes_extra_down = self._bytes_down, self._bytes_extra
        pulled = (self.replies.pulled_replies, self.replies.pulled_bytes)
        entry.pulled_replies, entry.pulled_bytes = pulled[0] - self._pulled[0], pulled[1] - self._pulled[1]
        self._pulled = pulled
        entry.device_t = self.device_t = self._device_now()
        entry.steps = list(self._strategy_steps)
        entry.train = weighted_mean((u.num_examples, u.metrics) for u in accepted)
        entry.seconds = time.perf_counter() - started
        return entry

    def wait_for_reachable(self, rnd: int) -> None:
        """Nothing in flight and nobody to dispatch to: wait for a client to (re)connect, or fail."""
        deadline = time.perf_counter() + self.runtime.wait_nodes_s
        while not self.idle(refresh_every=1.0):
            if self.skip_to_online():
                return
            if time.perf_counter() >= deadline:
                raise RuntimeError(f"round {rnd}: no reachable client for {self.runtime.wait_nodes_s:.0f}s "
                                   f"(known partitions {self.directory.clients}); is any SuperNode running?")
            time.sleep(min(1.0, self.runtime.wait_nodes_s))

    def latency_summary(self) -> dict[str, float]:
        """Median, p95 and p99 of the wall clock's reply -> next-dispatch latency (empty for the virtual clock), and
        the medians of its parts: the hand-over to the strategy, and Flower's push."""
        if not self.reply_to_dispatch:
            return {}
        lat = np.asarray(self.reply_to_dispatch)
        return {"median": float(np.median(lat)), "p95": float(np.percentile(lat, 95)),
                "p99": float(np.percentile(lat, 99)), "count": int(lat.size),
                **{f"{part}-median": float(np.median(v)) for part, v in self.reply_parts.items()}}

    # -- the public API: a run (below), or one round at a time from another loop (clocks.OuterLoop) ----
    def wait_for_nodes(self, count: int, timeout: float | None = None) -> None:
        """Wait until `count` clients have a node (default: ``wait-nodes-s``), or fail."""
        self.directory.wait_for(count, self.runtime.wait_nodes_s if timeout is None else timeout)

    def evaluate_messages(self, count: int, rng: random.Random, config: dict[str, Any]) -> list[Message]:
        """Evaluation messages to `count` connected clients drawn with `rng`, each with its ``model_for``
        payload and `config`."""
        connected = self.directory.poll()
        clients = sorted(c for c, n in self.directory.node_of.items() if n in connected)
        messages = []
        for c in sorted(rng.sample(clients, min(count, len(clients)))):
            messages.append(self.dispatcher.message(self.directory.node_of[c], self.strategy.model_for(c),
                                                    self.strategy.version, MessageType.EVALUATE, config=config))
        return messages

    # -- a run on its clock (server_app/clocks.py) -------------------------------------------
    def run(self, num_rounds: int, on_round: Callable[[RoundLog], None], first_round: int = 1) -> None:
        """Run rounds `first_round` .. `num_rounds`, calling `on_round` after each (evaluation, logging,
        checkpoints); flights restored from a checkpoint are sent again first."""
        self._deadline = time.perf_counter() + (self.runtime.time_budget_s or float("inf"))
        self._resend()
        CLOCKS[self.runtime.clock](self).run(first_round, num_rounds, on_round)
        self.discarded = [f.message_id for f in self.flights.in_order()]
        if self.flights:
            log(INFO, "%d dispatched updates still in flight at the end are discarded", len(self.flights))
        # their models and replies are not kept through the final evaluation, nor the copy of the last good state
        self.flights, self._good = Flights(), None
        self.replies.close()
