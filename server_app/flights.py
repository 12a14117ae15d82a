"""The table of updates in flight: at most one dispatched update per client, what each carries, and the replies
pulled for them (by message id; None: given up after ``reply-timeout-s``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flwr.app import Message

from flower_internals.replies import ReplyPuller
from server_app.wire import RejectedReply, unavailable
from strategies.base import Payload, Unusable, Update


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

    @property
    def ends(self) -> float:
        """Device time it is handed over at: when it completes, or when its device goes offline first."""
        return min(self.device_done, self.device_off)


class Flights(dict[int, Flight]):
    """Client -> its flight, and :attr:`replies` pulled for them; every listing is in dispatch order."""

    def __init__(self, flights: Iterable[Flight] = ()) -> None:
        super().__init__((f.client, f) for f in flights)
        self.replies: dict[str, Message | None] = {}  # message id -> reply (None: timed out)

    def in_order(self) -> list[Flight]:
        return sorted(self.values(), key=lambda f: f.seq)

    def due(self, rnd: int) -> list[Flight]:
        """The virtual clock's: flights handed over in round `rnd` or before."""
        return [f for f in self.in_order() if f.due_round <= rnd]

    def arrived(self) -> list[Flight]:
        """Flights whose reply is in, then those given up, each in dispatch order: a round that closes on this poll
        counts the replies in hand before the deadlines that passed beside them (``max-failed-fraction`` is checked
        at a round's close)."""
        ended = [f for f in self.in_order() if f.message_id in self.replies]
        return sorted(ended, key=lambda f: self.replies[f.message_id] is None)

    def first_to_end(self) -> Flight:
        """The device clock's next event: the flight that completes (or vanishes) first, ties in dispatch order."""
        return min(self.values(), key=lambda f: (f.ends, f.seq))

    def poll(self, puller: ReplyPuller, timeout_s: float, flights: list[Flight] | None = None) -> bool:
        """Pull the replies of `flights` (default: every flight), mark those past `timeout_s` as given up; True if
        anything new. The virtual clock pulls only the flights due now: a reply is held (and, in-process, the client's
        work done) only when it is handed over, so the server holds the replies of one round, not of every flight."""
        flights = list(self.values()) if flights is None else flights
        waiting = [f.message_id for f in flights if f.message_id not in self.replies]
        if not waiting:
            return False
        # late: past its deadline when this pull asked for it. A pull that takes long (a loaded server, large
        # replies) is the server's time, not the device's: its reply may be in the next one
        asked = time.perf_counter()
        got = puller.pull(waiting)
        for m in got:
            self.replies[m.metadata.reply_to_message_id] = m
        late = [f for f in flights if f.message_id not in self.replies and asked - f.sent_at > timeout_s]
        for f in late:
            self.replies[f.message_id] = None
            puller.discard(f.message_id)
        return bool(got or late)

    def take(self, flight: Flight) -> Message | None:
        """`flight`'s reply (None: timed out), out of the table with it."""
        self.pop(flight.client, None)
        return self.replies.pop(flight.message_id)


def fate(flight: Flight, reply: Message | None, timeout_s: float,
         read: Callable[[Message], Update]) -> tuple[Update | None, str, str]:
    """What `flight` brought back: ``(update, "accepted", "")``, or ``(None, outcome, why)`` for an update lost:
    ``vanished`` (its device went offline before the message completed, in device time), ``timeout`` (no reply
    within `timeout_s`), ``unavailable`` (the SuperLink no longer held the message or its reply), ``failure`` (an
    error reply) or ``rejected`` (a reply that `read` refuses with :class:`RejectedReply` or :class:`Unusable`)."""
    if flight.device_off < flight.device_done:
        return None, "vanished", (f"its device went offline at device time {flight.device_off:.1f}s, before the "
                                  f"message completed at {flight.device_done:.1f}s")
    if reply is None:
        return None, "timeout", f"no reply within {timeout_s:.0f}s"
    if unavailable(reply):
        return None, "unavailable", f"the SuperLink: {reply.error.reason}"
    try:
        return read(reply), "accepted", ""
    except (RejectedReply, Unusable) as err:
        return None, ("failure" if reply.has_error() else "rejected"), str(err)
