"""What a round records (a line of metrics.jsonl), and a round driven from another loop (Flower's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message

from server_app.flights import Flight
from strategies.base import Update


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
    unavailable: int = 0  # the SuperLink no longer held the message or its reply (server_app.wire.unavailable)
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

    def lost(self, outcome: str) -> None:
        """Count an update lost as `outcome` (:func:`server_app.flights.fate`'s)."""
        counter = {"failure": "failures", "rejected": "rejected", "timeout": "timeouts", "vanished": "vanished",
                   "unavailable": "unavailable"}[outcome]
        setattr(self, counter, getattr(self, counter) + 1)

    def ended(self) -> int:
        """The round's dispatches that have ended, whatever their outcome."""
        return self.accepted + self.failures + self.rejected + self.timeouts + self.vanished + self.unavailable

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


@dataclass
class Round:
    """A round driven from another loop (:meth:`server_app.clocks.OuterLoop.begin_round`): its log so far and its
    train messages."""

    entry: RoundLog
    accepted: list[Update]
    started: float
    outgoing: list[tuple[Message, Flight]]

    @property
    def messages(self) -> list[Message]:
        return [m for m, _ in self.outgoing]
