"""The command's progress (hybridfl/progress.py): a line rewritten in place on a terminal, plain lines elsewhere; an
in-process run's step, accepted updates, last evaluation and time left; a sweep's finished runs and time left."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

from hybridfl.cli import main
from hybridfl.progress import Line, RunProgress, SweepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_is_rewritten_on_a_terminal_and_plain_elsewhere():
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        line = Line(stream)
        line.update("round 1/2")
        line.print("run a finished")
        line.update("round 2/2")
        line.close()
    assert pipe.getvalue() == "run a finished\n"  # no status lines where nothing can rewrite them
    assert tty.getvalue() == ("\r\x1b[2Kround 1/2" "\r\x1b[2Krun a finished\nround 1/2" "\r\x1b[2Kround 2/2" "\n")


def test_a_runs_line_counts_updates_keeps_the_last_evaluation_and_estimates_the_time_left():
    stream = Terminal()
    progress = RunProgress(SimpleNamespace(num_rounds=4), Path("."), Line(stream))
    progress.round({"round": 0, "test-accuracy": 0.1})  # before training: no line yet
    assert stream.getvalue() == ""
    progress.round({"round": 1, "accepted": 3})
    progress.round({"round": 2, "accepted": 5, "test-accuracy": 0.5})
    progress.round({"round": 3, "accepted": 4})
    last = stream.getvalue().split("\r\x1b[2K")[-1]
    assert last.startswith("round 3/4 [###############-----] 12 updates accepted · test accuracy 0.5000 at round 2 ·")
    assert last.endswith(" left")
    progress.finish({})
    assert stream.getvalue().endswith("\n")


def test_a_sweeps_lines_say_the_time_left_and_a_terminal_keeps_its_state_below():
    pipe, tty = io.StringIO(), Terminal()
    for stream in (pipe, tty):
        progress = SweepProgress(Line(stream))
        progress("2 runs to do (0 already in x)")
        progress("[1/2] a/s0: test 0.5000 val 0.5000 (3 s)", 1, 2)
        progress("[2/2] a/s1: test 0.6000 val 0.6000 (3 s)", 2, 2)
    lines = pipe.getvalue().splitlines()
    assert lines[0] == "2 runs to do (0 already in x)" and len(lines) == 3
    assert lines[1].startswith("[1/2] a/s0") and " left" in lines[1] and lines[2].endswith("about 0s left")
    assert "sweep [##########----------] 1/2 runs done" in tty.getvalue()
    assert tty.getvalue().endswith("2/2 runs done\n")


def test_an_in_process_run_on_a_terminal_shows_its_line_and_quiets_flowers_info(tmp_path, monkeypatch):
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    level = logging.getLogger("flwr").level
    small = ["dataset=synthetic", "num-clients=4", "clients-per-round=4", "local-epochs=1", f"output-dir={tmp_path}"]
    assert main(["run", "fedavg-digits", "num-rounds=2", *small, "run-name=p"]) == 0
    assert "round 2/2 [####################] 8 updates accepted · test accuracy" in stream.getvalue()
    assert logging.getLogger("flwr").level == level  # restored
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    assert main(["run", "fedavg-digits", "num-rounds=1", *small, "run-name=q"]) == 0
    assert "updates accepted ·" not in out.getvalue()  # not a terminal: the log lines are the plain form
