"""The runtime: one loop over a Flower ``Grid`` for synchronous and asynchronous training.

The runner owns timing and the network; the strategy owns the math. One word per concept, in the code, the logs
and the outputs: each **round** (``num-rounds`` of them; a line of metrics.jsonl) the runner dispatches work, hands
arriving updates to the strategy one by one (``receive``; a strategy **step** whenever ``ready()``), then closes the
round (``close_round``; a step if ``ready()``). Every step makes the next model **version**; a round may hold no
step (a buffer still filling) or several (FedAsync steps on every update), and the round's line keeps them all.
At most one message is in flight per client (= per node); every dispatch is tagged with the
model version it carries, and staleness = current version − that version.

Two clocks decide when an update is handed over:

* ``virtual`` (simulation, tests, benchmarks; Feddle App. D): in round k the runner samples N idle
  clients (fewer if fewer are idle), draws each one's delay d = round(|z|), z ~ N(0, σ²), in
  rounds, and hands its update over in round k + d, whatever order replies physically arrive in.
  The event sequence and the final model depend only on the seed. σ = 0 is synchronous FL: every
  update of round k arrives in round k (a barrier).
* ``wall`` (deployment): keeps ``concurrency`` clients busy and hands updates over in real arrival
  order, re-dispatching to an idle client as soon as a slot frees; a round closes every N arrivals.
* ``device`` (simulation of a fleet in device time): the ``wall`` clock's protocol on the fleet's clock
  instead of the host's: a message dispatched at device time t completes at t + its device's
  :meth:`~common.fleet.DeviceProfile.message_s` (download, compute, upload), updates are handed over in
  that order (ties by dispatch order), only clients online at t are dispatched to, and one whose device goes
  offline before its message completes is lost at that moment (``vanished``). Deterministic by seed.

Every run keeps **device time** (``device-t`` in metrics.jsonl and events.jsonl) under the run's ``fleet``
(common/fleet.py; the ideal fleet costs no time): the ``device`` clock's own; the ``virtual`` clock's is a
barrier's (a round ends when the last message handed over in it completes; devices offline at a round's start
are not sampled, a message whose device goes offline before it completes is lost as ``vanished``), which is
synchronous FL's wall-clock time for σ = 0; the ``wall`` clock's is the host's elapsed time (a real fleet paces
itself: hybridfl/real_fleet.py).

An error reply, an unusable reply or a reply slower than ``reply-timeout-s`` frees its slot and the
work goes to another idle client; a run with no reachable client for ``wait-nodes-s`` fails.

Every flight keeps the payload it carries (shared between the flights of one version) and its
``train-seed``: the update it brings back is handed to the strategy with that payload (``sent``),
and a resumed run sends exactly the same messages again (:meth:`Runner.state_dict`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message, MessageType
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from common.codecs import encoded_nbytes
from common.config import COUNT, POSITIVE, OneOf, Range, check_options, option
from common.fleet import Fleet, fleet_names
from common.protocol import STRATEGY, UPDATES_BEFORE
from server_app.evaluation import weighted_mean
from server_app.replies import ReplyPuller, push
from server_app.wire import MAX_COUNT, Dispatcher, NodeDirectory, RejectedReply, parse_reply
from strategies.base import Payload, Strategy, Unusable, Update

CLOCKS = ("virtual", "wall", "device")


@dataclass(frozen=True)
class FleetName(OneOf):
    """A built-in fleet, or a fleet YAML file (common/fleet.py)."""

    def ok(self, v: str) -> bool:
        return v == "" or super().ok(v) or v.endswith((".yaml", ".yml"))

    def describe(self) -> str:
        return f"'' (ideal), one of {', '.join(map(repr, self.allowed()))}, or a fleet YAML file (.yaml)"


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The runtime keys: how the runner drives the clients (the module docstring says how each clock works)."""

    clients_per_round: int = option(10, COUNT, "clients sampled per round (virtual clock); arrivals per round "
                                    "(wall clock)", "1 … `num-clients`")
    clock: str = option("virtual", OneOf(CLOCKS), "virtual: seeded delays in rounds; wall: real arrival order; "
                        "device: arrival order in the fleet's device time (see above)")
    fleet: str = option("", FleetName(fleet_names), "the devices' profiles (compute, link, availability) that "
                        "device time follows: a built-in fleet or a fleet YAML file ([A real fleet]"
                        "(../tutorials/fleet.md))", "`\"\"`, `ideal`, `lognormal`, `intermittent`, a `.yaml` path")
    delay_sigma: float = option(0.0, Range(0), "σ of the half-normal client delay, in rounds "
                                "(0 = synchronous)")
    concurrency: int = option(10, COUNT, "clients kept busy by the wall clock")
    reply_timeout_s: float = option(600.0, POSITIVE, "seconds a dispatched update may take before it is given up")
    poll_interval_s: float = option(0.05, Range(0, 1, low_open=True), "seconds between pulls for replies")
    wait_nodes_s: float = option(120.0, POSITIVE,
                                 "seconds to wait for `num-clients` nodes at start (a resumed run then goes on with "
                                 "those connected), or for any node later")
    max_num_examples: int = option(0, Range(0), "the most `num-examples` a client's reply may claim; 0 = its "
                                   "partition's training size as the server cuts it (a reply claiming more is "
                                   "rejected: a device's lie would set its weight in every example-weighted mean)")
    max_update_ratio: float = option(100.0, Range(0), "an update whose ℓ2 norm exceeds this multiple of the model it "
                                     "started from (of 1, for a model of smaller norm) is rejected: a finite but huge "
                                     "update would leave a model every later client fails on (0 = no bound)")
    time_budget_s: float = option(0.0, Range(0), "seconds of training after which the run ends with the round under "
                                  "way, evaluated and saved as its last (0 = none; a resumed run counts from its "
                                  "resumption): a deadline, or a load test's length")


@dataclass
class Flight:
    """One dispatched update on its way."""

    seq: int  # dispatch order: ties between arrivals are broken by it, so runs are reproducible
    client: int
    version: int  # the model version it carries
    dispatch_round: int
    due_round: int  # virtual clock: the round it is handed over in; wall clock: unused (-1)
    payload: Payload  # what the client was sent
    train_seed: int
    device_start: float = 0.0  # device time it was dispatched at
    device_done: float = 0.0  # ... it completes at, on its device's profile
    device_off: float = float("inf")  # ... its device goes offline at (before device_done: it vanishes)
    node: int = -1  # where it went (transient: node ids change when a run resumes)
    message_id: str = ""
    sent_at: float = 0.0  # perf_counter() at push

    def state(self) -> dict[str, Any]:
        """What survives a restart (not where it went: node ids change)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("node", "message_id", "sent_at")}


@dataclass
class Round:
    """A round driven from another loop (:meth:`Runner.begin_round`): its log so far and its train messages."""

    entry: RoundLog
    accepted: list[Update]
    started: float
    outgoing: list[tuple[Message, Flight]]

    @property
    def messages(self) -> list[Message]:
        return [m for m, _ in self.outgoing]


@dataclass
class RoundLog:
    """What happened in one round; a line of metrics.jsonl."""

    round: int
    version: int
    sampled: int = 0  # dispatches made in this round (replacements included)
    accepted: int = 0
    failures: int = 0  # error replies: exception on the device, node unavailable
    rejected: int = 0  # replies that arrived but could not be used (shape, NaN, missing keys, wrong version)
    refused_steps: int = 0  # strategy steps whose model was not finite: undone, the run went on from the last good one
    timeouts: int = 0  # no reply within reply-timeout-s
    vanished: int = 0  # the device went offline before its message completed (device time; a fleet's windows)
    device_t: float = 0.0  # device time at the round's close (module docstring)
    bytes_down: int = 0  # models and arrays sent in this round's dispatches (as the run's model-codec encodes them)
    bytes_up: int = 0  # ... and received in its accepted updates (update-codec)
    pulled_replies: int = 0  # deployment: train replies pulled from the SuperLink in this round ...
    pulled_bytes: int = 0  # ... and their objects' bytes, as the devices sent them (0 in-process)
    bytes_extra_down: int = 0  # of bytes-down, what is not the model: extra arrays (examples, a central gradient)
    staleness: list[int] = field(default_factory=list)
    train: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)  # with validation-size, for tuning
    personal: dict[str, float] = field(default_factory=dict)  # every client's model on its own held-out split
    steps: list[dict[str, float]] = field(default_factory=list)  # what each strategy step of the round measured
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k.replace("_", "-"): v for k, v in self.__dict__.items()
               if k not in ("train", "test", "validation", "personal", "staleness", "steps")}
        # the round's model comes from its last step: its measures head the line, every step's follow in "steps"
        out.update({k: v for k, v in (self.steps[-1] if self.steps else {}).items() if k != "version"})
        out["steps"] = [dict(m) for m in self.steps]
        if self.staleness:
            out["staleness-mean"] = float(np.mean(self.staleness))
            out["staleness-max"] = int(max(self.staleness))
        out.update({f"train-{k.removeprefix('train-')}": v for k, v in self.train.items()})
        out.update({f"test-{k}": v for k, v in self.test.items()})
        out.update({f"val-{k}": v for k, v in self.validation.items()})
        out.update({f"personal-{k}": v for k, v in self.personal.items()})
        return out


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
        self.directory = NodeDirectory(grid, strategy.num_clients or MAX_COUNT, replies=self.replies)
        self.client_sizes = dict(client_sizes or {})
        self.fleet = None if fleet is None or fleet.ideal else fleet
        if self.runtime.clock == "device" and self.fleet is None:
            raise ValueError("clock='device' needs a fleet whose devices cost time (fleet='lognormal', a YAML file)")
        self._epochs = int(run_config.get("local-epochs", 1))
        self.device_t = 0.0
        self.dispatcher = Dispatcher(strategy.spec, {**run_config, STRATEGY: strategy.reference(),
                                                     **strategy.client_options()}, seed)
        strategy.attach(server_data)
        self.on_event = on_event or (lambda event: None)
        self._sample_rng = random.Random(seed)
        self._delay_rng = np.random.default_rng([seed, 2])
        self.flights: dict[int, Flight] = {}  # client -> its flight
        self.discarded: list[str] = []  # the train messages still in flight when the run ended
        self.lost_at_resume: list[int] = []  # clients of flights restored from a checkpoint whose device is gone
        self._replies: dict[str, Message | None] = {}  # message id -> reply (None: timed out)
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
        self.first_loss = ""  # why the run's first lost update (failed, rejected, timed out) was lost
        self._pushed_in = 0.0
        self._good: dict[str, Any] | None = None  # the strategy's state after its last step with a finite model

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs from the runner: its generators, the dispatch counter, the flights in
        the air with their payloads and seeds, each client's dispatch count and the elapsed time."""
        return {"sample-rng": self._sample_rng.getstate(), "delay-rng": self._delay_rng.bit_generator.state,
                "seq": self._seq, "flights": [f.state() for f in sorted(self.flights.values(), key=lambda f: f.seq)],
                "dispatches": dict(self.dispatcher.dispatches), "elapsed": time.perf_counter() - self._t0,
                "device-t": self.device_t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state`; its flights are sent again (to their clients' current nodes) when the run goes on."""
        self._sample_rng.setstate(state["sample-rng"])
        self._delay_rng.bit_generator.state = state["delay-rng"]
        self._seq = state["seq"]
        self.flights = {f["client"]: Flight(**f) for f in state["flights"]}
        self._replies = {}
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

    def _idle(self, exclude: set[int] = frozenset(), refresh_every: float = 0.0) -> list[int]:
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

    def _skip_to_online(self) -> bool:
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

    def _sample(self, k: int, exclude: set[int] = frozenset(), refresh_every: float = 0.0) -> list[int]:
        """`k` idle reachable clients (fewer if fewer are idle), drawn with the run's seed, in client order."""
        idle = self._idle(exclude, refresh_every)
        return sorted(self._sample_rng.sample(idle, min(k, len(idle))))

    def _launch(self, clients: list[int], rnd: int, virtual: bool) -> list[Flight]:
        """New flights to `clients`: each gets the strategy's payload, a train seed and (virtual) a delay."""
        flights = []
        for c in clients:
            payload = self.strategy.model_for(c)
            down = self._wire_nbytes(self.dispatcher.codecs.model_codec, payload.params) + payload.extra_nbytes
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

    def _message(self, flight: Flight) -> Message:
        """The train message of `flight`, addressed to its client's current node."""
        flight.node = self.directory.node_of[flight.client]
        return self.dispatcher.message(flight.node, flight.payload, flight.version, train_seed=flight.train_seed,
                                       config={UPDATES_BEFORE: self.dispatcher.dispatches[flight.client] - 1})

    def _push(self, flights: list[Flight]) -> None:
        if not flights:
            return
        now = time.perf_counter()
        ids = push(self.grid, lambda: [self._message(f) for f in flights])
        self._pushed_in = time.perf_counter() - now
        for flight, mid in zip(flights, ids):
            flight.message_id, flight.sent_at = mid, now
            self.flights[flight.client] = flight

    def _dispatch(self, clients: list[int], rnd: int, virtual: bool) -> None:
        self._push(self._launch(clients, rnd, virtual))

    def _resend(self) -> None:
        """Send the flights restored from a checkpoint again (they were in the air when it was written)."""
        restored = sorted((f for f in self.flights.values() if not f.message_id), key=lambda f: f.seq)
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

    def _poll(self, flights: list[Flight] | None = None) -> bool:
        """Pull the replies of `flights` (default: every flight), mark those past the timeout; True if anything
        new. The virtual clock pulls only the flights due now: a reply is held (and, in-process, the client's work
        done) only when it is handed over, so the server holds the replies of one round, not of every flight."""
        flights = list(self.flights.values()) if flights is None else flights
        waiting = [f.message_id for f in flights if f.message_id not in self._replies]
        if not waiting:
            return False
        got = self.replies.pull(waiting)
        for m in got:
            self._replies[m.metadata.reply_to_message_id] = m
        now = time.perf_counter()
        timeout = self.runtime.reply_timeout_s
        late = [f for f in flights if f.message_id not in self._replies and now - f.sent_at > timeout]
        for f in late:
            self._replies[f.message_id] = None
            self.replies.discard(f.message_id)
        return bool(got or late)

    def _hand_over(self, flight: Flight, reply: Message | None, rnd: int, entry: RoundLog,
                   accepted: list[Update]) -> bool:
        """Give `flight`'s reply (None: timed out) to the strategy, stepping whenever it is ready; False if
        the update is lost (error, unusable, late)."""
        self.flights.pop(flight.client, None)
        event = {"round": rnd, "client": flight.client, "node": flight.node, "message": flight.message_id,
                 "base-version": flight.version,
                 "dispatch-round": flight.dispatch_round, "t": round(time.perf_counter() - self._t0, 4),
                 "device-start": round(flight.device_start, 4),
                 "device-t": round(self._device_now() if self.runtime.clock == "wall"
                                   else min(flight.device_done, flight.device_off), 4)}
        update, outcome, reason = None, "accepted", ""
        if flight.device_off < flight.device_done:
            outcome, reason = "vanished", (f"its device went offline at device time {flight.device_off:.1f}s, "
                                           f"before the message completed at {flight.device_done:.1f}s")
            entry.vanished += 1
        elif reply is None:
            outcome, reason = "timeout", f"no reply within {self.runtime.reply_timeout_s:.0f}s"
            entry.timeouts += 1
        else:
            try:
                update = parse_reply(reply, self.dispatcher.spec, self._max_examples(flight.client),
                                     self.dispatcher.codecs)
                if (update.client, update.base_version) != (flight.client, flight.version):
                    raise RejectedReply(f"reply is for client {update.client} at version {update.base_version}, "
                                        f"but client {flight.client} was sent version {flight.version}")
                update.sent = flight.payload
                self._check_size(update)
                self.strategy.check(update)
            except (RejectedReply, Unusable) as err:
                outcome, reason = ("failure" if reply.has_error() else "rejected"), str(err)
                if reply.has_error():
                    entry.failures += 1
                    if reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                        self._gone[flight.client] = time.perf_counter()
                else:
                    entry.rejected += 1
        if update is None or outcome != "accepted":
            log(WARNING, "round %d: update of client %d (node %d) lost: %s", rnd, flight.client, flight.node, reason)
            if not self.first_loss and outcome != "vanished":
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

    def _check_size(self, update: Update) -> None:
        """Reject `update` if ‖Δ‖ > ``max-update-ratio`` · max(‖ω^τ‖, 1) (norms in float64: a finite float32
        update's norm cannot overflow there)."""
        ratio = self.runtime.max_update_ratio
        if not ratio:
            return
        size, start = (float(torch.linalg.vector_norm(t, dtype=torch.float64)) for t in (update.delta, update.start))
        if size > ratio * max(start, 1.0):
            raise RejectedReply(f"update norm {size:.3g} is over max-update-ratio {ratio:g} x the norm of the model "
                                f"it started from ({start:.3g})")

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

    def _open_round(self, rnd: int) -> tuple[RoundLog, list[Update]]:
        self._strategy_steps, self._bytes_down, self._bytes_extra = [], 0, 0
        return RoundLog(rnd, self.strategy.version), []

    def _is_last(self, rnd: int, num_rounds: int) -> bool:
        """Whether round `rnd` ends the run: the last of `num_rounds`, or the one under way when ``time-budget-s``
        ran out (kept in :attr:`final_round`, by which the ServerApp evaluates and saves it as the last)."""
        if rnd == num_rounds or time.perf_counter() >= self._deadline:
            self.final_round = rnd
        return self.final_round == rnd

    def _close_round(self, entry: RoundLog, accepted: list[Update], started: float) -> RoundLog:
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

    def _wait_for_reachable(self, rnd: int) -> None:
        """Nothing in flight and nobody to dispatch to: wait for a client to (re)connect, or fail."""
        deadline = time.perf_counter() + self.runtime.wait_nodes_s
        while not self._idle(refresh_every=1.0):
            if self._skip_to_online():
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

    # -- the public API: a run, or one round at a time from another loop (Flower's) ---------------
    def wait_for_nodes(self, count: int, timeout: float | None = None) -> None:
        """Wait until `count` clients have a node (default: ``wait-nodes-s``), or fail."""
        self.directory.wait_for(count, self.runtime.wait_nodes_s if timeout is None else timeout,
                                self.runtime.poll_interval_s)

    def begin_round(self, rnd: int) -> Round:
        """Open round `rnd` driven from another loop (a barrier: every update comes back in this round): sample
        ``clients-per-round`` idle clients and build their train messages (:attr:`Round.messages`)."""
        if len(self.directory.node_of) < self.runtime.clients_per_round:
            self.wait_for_nodes(self.runtime.clients_per_round)
        entry, accepted = self._open_round(rnd)
        flights = self._launch(self._sample(self.runtime.clients_per_round), rnd, virtual=True)
        entry.sampled = len(flights)
        return Round(entry, accepted, time.perf_counter(), [(self._message(f), f) for f in flights])

    def end_round(self, current: Round, replies: Iterable[Message]) -> RoundLog:
        """Hand `current`'s replies to the strategy in dispatch order, whatever order they came in (a missing one
        counts as timed out, a bad one is rejected and counted), and close the round."""
        by_request = {m.metadata.reply_to_message_id: m for m in replies}
        self.device_t = max([self.device_t, *(min(f.device_done, f.device_off) for _, f in current.outgoing)])
        for msg, flight in current.outgoing:
            flight.message_id = msg.metadata.message_id  # Flower's loop pushed it
            self._hand_over(flight, by_request.get(msg.metadata.message_id), current.entry.round, current.entry,
                            current.accepted)
        return self._close_round(current.entry, current.accepted, current.started)

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

    # -- the two clocks -----------------------------------------------------------------------
    def run(self, num_rounds: int, on_round: Callable[[RoundLog], None], first_round: int = 1) -> None:
        """Run rounds `first_round` .. `num_rounds`, calling `on_round` after each (evaluation, logging,
        checkpoints); flights restored from a checkpoint are sent again first."""
        self._deadline = time.perf_counter() + (self.runtime.time_budget_s or float("inf"))
        self._resend()
        loop = {"virtual": self._run_virtual, "wall": self._run_wall, "device": self._run_device}[self.runtime.clock]
        loop(first_round, num_rounds, on_round)
        self.discarded = [f.message_id for f in sorted(self.flights.values(), key=lambda f: f.seq)]
        if self.flights:
            log(INFO, "%d dispatched updates still in flight at the end are discarded", len(self.flights))
        # their models and replies are not kept through the final evaluation, nor the copy of the last good state
        self.flights, self._replies, self._good = {}, {}, None
        self.replies.close()

    def _run_virtual(self, first_round: int, num_rounds: int, on_round: Callable[[RoundLog], None]) -> None:
        for rnd in range(first_round, num_rounds + 1):
            started = time.perf_counter()
            entry, accepted = self._open_round(rnd)
            barrier = self.device_t  # device time: the round lasts until its last message handed over completes
            if not self.flights and not self._idle():
                self._wait_for_reachable(rnd)
            chosen = self._sample(self.runtime.clients_per_round)
            self._dispatch(chosen, rnd, virtual=True)
            entry.sampled = len(chosen)
            sampled = set(chosen)  # a client is sampled at most once per round
            while due := sorted((f for f in self.flights.values() if f.due_round <= rnd), key=lambda f: f.seq):
                while any(f.message_id not in self._replies for f in due):
                    if not self._poll(due):
                        time.sleep(self.runtime.poll_interval_s)
                for f in due:
                    barrier = max(barrier, min(f.device_done, f.device_off))
                    if not self._hand_over(f, self._replies.pop(f.message_id), rnd, entry, accepted):
                        replacement = self._sample(1, exclude=sampled)
                        self._dispatch(replacement, rnd, virtual=True)
                        sampled.update(replacement)
                        entry.sampled += len(replacement)
            self.device_t = max(self.device_t, barrier)  # (device time may have jumped to a device coming online)
            last = self._is_last(rnd, num_rounds)
            on_round(self._close_round(entry, accepted, started))
            if last:
                return

    def _run_wall(self, first_round: int, num_rounds: int, on_round: Callable[[RoundLog], None]) -> None:
        rnd, started = first_round, time.perf_counter()
        entry, accepted = self._open_round(rnd)
        while True:
            if not self.flights and not self._idle(refresh_every=1.0):
                self._wait_for_reachable(rnd)
            free = self.runtime.concurrency - len(self.flights)
            if free > 0:
                fresh = self._sample(free, refresh_every=1.0)
                self._dispatch(fresh, rnd, virtual=False)
                entry.sampled += len(fresh)
            if not self._poll():
                time.sleep(self.runtime.poll_interval_s)
                continue
            arrived = sorted((f for f in self.flights.values() if f.message_id in self._replies), key=lambda f: f.seq)
            for f in arrived:
                got_at = time.perf_counter()
                self._hand_over(f, self._replies.pop(f.message_id), rnd, entry, accepted)
                handed = time.perf_counter() - got_at
                # Refill the freed slot at once: the reply -> next dispatch latency is the runtime's overhead.
                fresh = self._sample(1, refresh_every=1.0)
                self._dispatch(fresh, rnd, virtual=False)
                if fresh:
                    self.reply_to_dispatch.append(time.perf_counter() - got_at)
                    self.reply_parts["hand-over"].append(handed)
                    self.reply_parts["push"].append(self._pushed_in)
                    entry.sampled += 1
                if entry.accepted + entry.failures + entry.rejected + entry.timeouts >= self.runtime.clients_per_round:
                    last = self._is_last(rnd, num_rounds)
                    on_round(self._close_round(entry, accepted, started))
                    if last:
                        return
                    rnd, started = rnd + 1, time.perf_counter()
                    entry, accepted = self._open_round(rnd)

    def _run_device(self, first_round: int, num_rounds: int, on_round: Callable[[RoundLog], None]) -> None:
        """The wall clock's protocol in device time: the next event is the flight that completes (or vanishes)
        first, or a device coming online while a slot is free; the host waits only for that flight's reply."""
        rnd, started = first_round, time.perf_counter()
        entry, accepted = self._open_round(rnd)
        while True:
            if not self.flights and not self._idle():
                self._wait_for_reachable(rnd)
            free = self.runtime.concurrency - len(self.flights)
            if free > 0 and (fresh := self._sample(free)):
                self._dispatch(fresh, rnd, virtual=False)
                entry.sampled += len(fresh)
                continue
            nxt = min(self.flights.values(), key=lambda f: (min(f.device_done, f.device_off), f.seq))
            end = min(nxt.device_done, nxt.device_off)
            if free > 0:  # a device coming online before the next completion takes a free slot first
                before = self.device_t
                if self._skip_to_online() and self.device_t < end:
                    continue
                self.device_t = before
            while nxt.message_id not in self._replies:
                if not self._poll([nxt]):
                    time.sleep(self.runtime.poll_interval_s)
            self.device_t = max(self.device_t, end)
            self._hand_over(nxt, self._replies.pop(nxt.message_id), rnd, entry, accepted)
            if entry.accepted + entry.failures + entry.rejected + entry.timeouts + entry.vanished \
                    >= self.runtime.clients_per_round:
                last = self._is_last(rnd, num_rounds)
                on_round(self._close_round(entry, accepted, started))
                if last:
                    return
                rnd, started = rnd + 1, time.perf_counter()
                entry, accepted = self._open_round(rnd)
