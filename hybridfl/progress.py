"""Progress for the ``hybridfl`` command: one line rewritten in place on a terminal, plain lines otherwise.

A run in-process shows ``round 37/100 [####------] 412 updates accepted · test accuracy 0.8123 at round 30 · about
1m12s left`` (on a terminal, where the per-step log lines it replaces would scroll; elsewhere those log lines are
the plain form). A sweep prints one line per finished run with an estimate of the time left, and on a terminal
keeps a line of the sweep's state below them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from server_app.run import duration
from server_app.tracking import Tracker


class Line:
    """A status line: rewritten in place on a terminal; `print` puts a finished message above it."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.text = ""

    def update(self, text: str) -> None:
        if self.tty:
            self.text = text
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()

    def print(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        if self.tty and self.text:
            self.stream.write(self.text)
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.text:
            self.stream.write("\n")
            self.stream.flush()
        self.text = ""


def bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total) if total else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class RunProgress(Tracker):
    """An in-process run's line: its step, the updates accepted so far, the last evaluation and the time left."""

    def __init__(self, cfg: Any, out: Path, line: Line) -> None:
        self.total, self.line = cfg.num_rounds, line
        self.started = time.perf_counter()
        self.first: int | None = None
        self.accepted = 0
        self.evaluated = ""

    def round(self, row: dict[str, Any]) -> None:
        rnd = int(row["round"])
        self.accepted += int(row.get("accepted", 0))
        if "test-accuracy" in row:
            self.evaluated = f" · test accuracy {row['test-accuracy']:.4f} at round {rnd}"
        if rnd == 0:  # the evaluation before training
            return
        self.first = rnd if self.first is None else self.first
        left = (time.perf_counter() - self.started) / (rnd - self.first + 1) * (self.total - rnd)
        self.line.update(f"round {rnd}/{self.total} {bar(rnd, self.total)} {self.accepted} updates accepted"
                         f"{self.evaluated} · about {duration(left)} left")

    def finish(self, summary: dict[str, Any]) -> None:
        self.line.close()


class SweepProgress:
    """A sweep's lines: each finished run with the time left; on a terminal, the sweep's state below them."""

    def __init__(self, line: Line) -> None:
        self.line = line
        self.started = time.perf_counter()

    def __call__(self, text: str, done: int = 0, total: int = 0) -> None:
        if total and done:
            left = (time.perf_counter() - self.started) / done * (total - done)
            text += f"; about {duration(left)} left"
        self.line.print(text)
        if total:
            self.line.update(f"sweep {bar(done, total)} {done}/{total} runs done")
        if total and done == total:
            self.line.close()
