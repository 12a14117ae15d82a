"""The clocks: when the runner hands an update over to the strategy, one class per clock.

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
itself: hybridfl/launch/real_fleet.py).

A clock reads and moves the runner's one table of flights (server_app/flights.py) through :class:`Driven`, the
runner's part it drives; the runner owns sampling, dispatch, the hand-over and the round's record.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

from flwr.app import Message

from server_app.flights import Flight, Flights
from server_app.rounds import Round, RoundLog
from strategies.base import Update

OnRound = Callable[[RoundLog], None]


class Driven(Protocol):
    """What a clock uses of the runner (server_app/runtime.py's :class:`~server_app.runtime.Runner`)."""

    runtime: Any  # its RuntimeConfig
    directory: Any  # its NodeDirectory
    flights: Flights
    device_t: float
    reply_to_dispatch: list[float]
    reply_parts: dict[str, list[float]]
    pushed_in: float

    def open_round(self, rnd: int) -> tuple[RoundLog, list[Update]]: ...
    def close_round(self, entry: RoundLog, accepted: list[Update], started: float) -> RoundLog: ...
    def is_last(self, rnd: int, num_rounds: int) -> bool: ...
    def idle(self, exclude: set[int] = ..., refresh_every: float = ...) -> list[int]: ...
    def sample(self, k: int, exclude: set[int] = ..., refresh_every: float = ...) -> list[int]: ...
    def dispatch(self, clients: list[int], rnd: int, virtual: bool) -> None: ...
    def launch(self, clients: list[int], rnd: int, virtual: bool) -> list[Flight]: ...
    def message(self, flight: Flight) -> Message: ...
    def wait_for_nodes(self, count: int, timeout: float | None = None) -> None: ...
    def wait_for_reachable(self, rnd: int) -> None: ...
    def skip_to_online(self) -> bool: ...
    def poll(self, flights: list[Flight] | None = None) -> bool: ...
    def hand_over(self, flight: Flight, reply: Message | None, rnd: int, entry: RoundLog,
                  accepted: list[Update]) -> bool: ...


class Clock(ABC):
    """Runs rounds `first_round` .. `num_rounds` of `runner`, calling `on_round` with each closed round."""

    name: ClassVar[str]

    def __init__(self, runner: Driven) -> None:
        self.runner = runner

    @abstractmethod
    def run(self, first_round: int, num_rounds: int, on_round: OnRound) -> None:
        """Hand every update over in this clock's order, closing each round as it ends, until the run ends."""

    def _close(self, rnd: int, num_rounds: int, entry: RoundLog, accepted: list[Update], started: float,
               on_round: OnRound) -> bool:
        """Close round `rnd`; True if it ends the run."""
        last = self.runner.is_last(rnd, num_rounds)
        on_round(self.runner.close_round(entry, accepted, started))
        return last


class VirtualClock(Clock):
    """Seeded delays in rounds: a flight is handed over in its ``due_round``, in dispatch order."""

    name = "virtual"

    def run(self, first_round: int, num_rounds: int, on_round: OnRound) -> None:
        r = self.runner
        for rnd in range(first_round, num_rounds + 1):
            started = time.perf_counter()
            entry, accepted = r.open_round(rnd)
            barrier = r.device_t  # device time: the round lasts until its last message handed over completes
            if not r.flights and not r.idle():
                r.wait_for_reachable(rnd)
            chosen = r.sample(r.runtime.clients_per_round)
            r.dispatch(chosen, rnd, virtual=True)
            entry.sampled = len(chosen)
            sampled = set(chosen)  # a client is sampled at most once per round
            while due := r.flights.due(rnd):
                while any(f.message_id not in r.flights.replies for f in due):
                    r.pace.after(r.poll(due))
                for f in due:
                    barrier = max(barrier, f.ends)
                    if not r.hand_over(f, r.flights.take(f), rnd, entry, accepted):
                        replacement = r.sample(1, exclude=sampled)
                        r.dispatch(replacement, rnd, virtual=True)
                        sampled.update(replacement)
                        entry.sampled += len(replacement)
            r.device_t = max(r.device_t, barrier)  # (device time may have jumped to a device coming online)
            if self._close(rnd, num_rounds, entry, accepted, started, on_round):
                return


class WallClock(Clock):
    """Real arrival order: ``concurrency`` clients kept busy, a freed slot refilled at once, a round closed every
    ``clients-per-round`` arrivals."""

    name = "wall"

    def run(self, first_round: int, num_rounds: int, on_round: OnRound) -> None:
        r = self.runner
        rnd, started = first_round, time.perf_counter()
        entry, accepted = r.open_round(rnd)
        while True:
            if not r.flights and not r.idle(refresh_every=1.0):
                r.wait_for_reachable(rnd)
            free = r.runtime.concurrency - len(r.flights)
            if free > 0:
                fresh = r.sample(free, refresh_every=1.0)
                r.dispatch(fresh, rnd, virtual=False)
                entry.sampled += len(fresh)
            if not r.poll():
                r.pace.wait()
                continue
            r.pace.reset()
            for f in r.flights.arrived():
                got_at = time.perf_counter()
                r.hand_over(f, r.flights.take(f), rnd, entry, accepted)
                handed = time.perf_counter() - got_at
                # Refill the freed slot at once: the reply -> next dispatch latency is the runtime's overhead.
                fresh = r.sample(1, refresh_every=1.0)
                r.dispatch(fresh, rnd, virtual=False)
                if fresh:
                    r.reply_to_dispatch.append(time.perf_counter() - got_at)
                    r.reply_parts["hand-over"].append(handed)
                    r.reply_parts["push"].append(r.pushed_in)
                    entry.sampled += 1
                if entry.ended() >= r.runtime.clients_per_round:
                    if self._close(rnd, num_rounds, entry, accepted, started, on_round):
                        return
                    rnd, started = rnd + 1, time.perf_counter()
                    entry, accepted = r.open_round(rnd)


class DeviceClock(Clock):
    """The wall clock's protocol in device time: the next event is the flight that completes (or vanishes) first,
    or a device coming online while a slot is free; the host waits only for that flight's reply."""

    name = "device"

    def run(self, first_round: int, num_rounds: int, on_round: OnRound) -> None:
        r = self.runner
        rnd, started = first_round, time.perf_counter()
        entry, accepted = r.open_round(rnd)
        while True:
            if not r.flights and not r.idle():
                r.wait_for_reachable(rnd)
            free = r.runtime.concurrency - len(r.flights)
            if free > 0 and (fresh := r.sample(free)):
                r.dispatch(fresh, rnd, virtual=False)
                entry.sampled += len(fresh)
                continue
            nxt = r.flights.first_to_end()
            end = nxt.ends
            if free > 0:  # a device coming online before the next completion takes a free slot first
                before = r.device_t
                if r.skip_to_online() and r.device_t < end:
                    continue
                r.device_t = before
            while nxt.message_id not in r.flights.replies:
                r.pace.after(r.poll([nxt]))
            r.device_t = max(r.device_t, end)
            r.hand_over(nxt, r.flights.take(nxt), rnd, entry, accepted)
            if entry.ended() >= r.runtime.clients_per_round:
                if self._close(rnd, num_rounds, entry, accepted, started, on_round):
                    return
                rnd, started = rnd + 1, time.perf_counter()
                entry, accepted = r.open_round(rnd)


class OuterLoop:
    """Rounds driven one at a time from another loop (Flower's ``start()``: server_app/flower.py), each a barrier:
    every update of a round comes back in it."""

    def __init__(self, runner: Driven) -> None:
        self.runner = runner

    def begin_round(self, rnd: int) -> Round:
        """Open round `rnd`: sample ``clients-per-round`` idle clients and build their train messages
        (:attr:`Round.messages`)."""
        r = self.runner
        if len(r.directory.node_of) < r.runtime.clients_per_round:
            r.wait_for_nodes(r.runtime.clients_per_round)
        entry, accepted = r.open_round(rnd)
        flights = r.launch(r.sample(r.runtime.clients_per_round), rnd, virtual=True)
        entry.sampled = len(flights)
        return Round(entry, accepted, time.perf_counter(), [(r.message(f), f) for f in flights])

    def end_round(self, current: Round, replies: Iterable[Message]) -> RoundLog:
        """Hand `current`'s replies to the strategy in dispatch order, whatever order they came in (a missing one
        counts as timed out, a bad one is rejected and counted), and close the round."""
        r = self.runner
        by_request = {m.metadata.reply_to_message_id: m for m in replies}
        r.device_t = max([r.device_t, *(f.ends for _, f in current.outgoing)])
        for msg, flight in current.outgoing:
            flight.message_id = msg.metadata.message_id  # Flower's loop pushed it
            r.hand_over(flight, by_request.get(msg.metadata.message_id), current.entry.round, current.entry,
                        current.accepted)
        return r.close_round(current.entry, current.accepted, current.started)


CLOCKS: dict[str, type[Clock]] = {c.name: c for c in (VirtualClock, WallClock, DeviceClock)}
