"""The ``hybridfl`` command (hybridfl/cli.py): each subcommand in-process, its errors and its help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from hybridfl.cli import command_overrides, describe, main
from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.job import MAIN_JOB
from server_app.presets import preset_names

SHORT = ["num-rounds=2", "eval-every=1", "checkpoint-every=1"]


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_the_arguments_name_a_preset_or_the_main_job_then_overrides():
    assert command_overrides([]) == {"preset": MAIN_JOB}
    assert command_overrides(["fedbuff-digits", "num-rounds=5", "run-name=x"]) == {
        "preset": "fedbuff-digits", "num-rounds": 5, "run-name": "x"}
    assert command_overrides(["preset=fedbuff-digits", "lr=0.1"]) == {"preset": "fedbuff-digits", "lr": 0.1}
    assert command_overrides(["resume=outputs/a"]) == {"resume": "outputs/a"}  # a resumed run keeps its own preset
    # a task of one's own: the plain base
    assert command_overrides(["dataset=mypkg.data:load", "model=mypkg.nets:mlp"]) == {
        "dataset": "mypkg.data:load", "model": "mypkg.nets:mlp"}


def test_run_then_resume_in_process(tmp_path: Path, capsys):
    out = str(tmp_path)
    assert main(["run", "fedavg-digits", *SHORT, f"output-dir={out}", "run-name=cli"]) == 0
    first = _summary(tmp_path / "cli")
    assert first["final-version"] == 2 and first["config"]["preset"] == "fedavg-digits"
    assert f"run cli: final test accuracy {first['final-test-accuracy']:.4f}" in capsys.readouterr().out
    assert main(["resume", str(tmp_path / "cli"), "num-rounds=3"]) == 0
    resumed = _summary(tmp_path / "cli")
    assert resumed["final-version"] == 3 and resumed["resumed-after-round"] == 2
    assert not (tmp_path / "cli" / "clients.jsonl").exists()  # no client evaluation, no empty per-client file


def test_a_bad_key_or_value_exits_2_naming_it_and_writes_nothing(tmp_path: Path, capsys):
    assert main(["run", "fedavg-digits", "num-rounds=0", f"output-dir={tmp_path}"]) == 2
    assert "'num-rounds' = 0" in capsys.readouterr().err
    assert main(["run", "no-such-preset", f"output-dir={tmp_path}"]) == 2
    assert "'preset' = 'no-such-preset'" in capsys.readouterr().err
    assert main(["run", "--mode", "bogus"]) == 2
    assert "'bogus' is not one of 'in-process', 'simulation', 'deployment'" in capsys.readouterr().err
    assert main(["resume", str(tmp_path / "nothing-here")]) == 2
    assert main(["run", "fedavg-digits", "=3", f"output-dir={tmp_path}"]) == 2  # a malformed override
    assert "bad override '=3': expected KEY=VALUE" in capsys.readouterr().err
    assert main(["resume", str(tmp_path), "rounds"]) == 2
    assert "bad override 'rounds'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_setting_impossible_for_the_data_is_refused_at_start_on_the_server(tmp_path: Path, capsys):
    """Ditto with more clusters than the data has classes: the partitions are cut on the server first, so the run
    stops there (exit 2, the key named), not on every client, and leaves no run folder."""
    assert main(["run", "ditto-digits", "num-rounds=2", "num-clusters=11", f"output-dir={tmp_path}",
                 "run-name=failing"]) == 2
    err = capsys.readouterr().err
    assert "config key 'num-clusters' = 11 is not allowed: expected a value in [1, min(classes=10, clients=10)]" in err
    assert not (tmp_path / "failing").exists()


BROKEN_DEVICES = """from strategies.client import ClientSide
from strategies.fedavg import FedAvg


class Unplugged(ClientSide):
    def train(self, task):
        raise RuntimeError("this device's sensor is unplugged")


class BrokenClients(FedAvg):
    client_side = Unplugged
"""


def test_a_run_whose_clients_all_fail_exits_1_saying_why(tmp_path: Path, capsys, monkeypatch):
    """A method (one's own, by import path) whose every client fails: the run ends with exit 1 and the first
    client's reason, not as a success after 0 versions."""
    (tmp_path / "broken.py").write_text(BROKEN_DEVICES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "fedavg-digits", "num-rounds=2", "strategy=broken:BrokenClients", f"output-dir={tmp_path}",
                 "run-name=failing"]) == 1
    err = capsys.readouterr().err
    assert "round 1: 10 of the run's 10 dispatches failed, were rejected or timed out (0 timed out" in err
    assert "this device's sensor is unplugged" in err
    assert not (tmp_path / "failing" / "summary.json").exists()


def test_an_unexpected_error_prints_one_line_and_keeps_the_traceback_in_a_file(tmp_path, monkeypatch, capsys):
    """Not a config error (exit 2) nor a failed run: one line naming the exception and where its traceback went,
    exit 1; `--verbose` prints the traceback too."""
    from hybridfl.engine import inprocess

    def broken(overrides):
        raise ValueError("the loader returned 3 columns, the model expects 4")

    monkeypatch.setattr(inprocess, "run_inprocess", broken)
    assert main(["run", "fedavg-digits", f"output-dir={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ValueError: the loader returned 3 columns, the model expects 4 "
                                               "(the traceback: ")
    trace = Path(err[0].rsplit("(the traceback: ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in trace.read_text() and "in broken" in trace.read_text()
    assert trace.stat().st_mode & 0o077 == 0  # a file of its own, readable by its owner only
    planted = trace.with_name(f"hybridfl-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
    assert trace != planted  # not a name another user could guess (and plant a link at) from the time and PID
    trace.unlink()
    assert main(["run", "fedavg-digits", f"output-dir={tmp_path}", "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("error: ValueError")
    Path(err.rsplit("(the traceback: ", 1)[1].strip().rstrip(")")).unlink()


def test_presets_lists_every_preset_with_one_line(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # every one has a description
    # a preset's own comment is given as its first sentence, whole (not its first line, cut mid-sentence)
    assert describe("ca2fl-digits").endswith(".") and "each server step samples" in describe("ca2fl-digits")
    assert all(d.endswith(".") for d in map(describe, preset_names()) if " + " not in d and "/methods/" not in d)
    assert main(["presets", "feddle-fmnist/fedbuff"]) == 0
    assert {line.split()[0] for line in capsys.readouterr().out.splitlines()} == {
        n for n in preset_names() if n.startswith("feddle-fmnist/fedbuff")}
    # a preset without its own comment says what it builds on and what it sets
    assert describe("feddle-fmnist/fedbuff-dir0.1-n20") == ("feddle-fmnist/methods/fedbuff + dirichlet-alpha=0.1, "
                                                            "delay-sigma=20")
    assert describe("feddle-digits").startswith("Feddle-ID on digits")


def test_the_console_command_is_installed_with_help_on_every_subcommand():
    scripts = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hybridfl": "hybridfl.cli:entry"}
    done = subprocess.run([sys.executable, "-m", "hybridfl.cli", "--help"], capture_output=True, text=True,
                          cwd=PROJECT_DIR, timeout=120)
    assert done.returncode == 0 and all(sub in done.stdout for sub in ("run", "resume", "presets")), done.stderr


@pytest.mark.parametrize("argv", [["run", "--help"], ["resume", "--help"], ["presets", "--help"]])
def test_every_subcommand_has_help(argv, capsys):
    assert main(argv) == 0
    assert "Usage:" in capsys.readouterr().out
