"""Memory that grows with what is in the air, not with the number of clients: the models the server holds during
training are bounded by the model versions in flight plus the strategy's own state, and the end-of-run evaluation
sends every client a model in waves, so at most a wave of model-carrying messages exists at once."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from flwr.app import Array, Message

from client_app.app import app as client_app
from hybridfl.engine.inprocess import InProcessGrid
from server_app.config import load_config
from server_app.evaluation import client_evaluate
from server_app.rounds import RoundLog
from server_app.run import build_run


class CountingGrid(InProcessGrid):
    """Counts the messages pushed and not yet pulled, and the most of them at once."""

    def __init__(self, num_nodes: int) -> None:
        super().__init__(client_app, num_nodes)
        self.in_air = self.most = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = list(super().push_messages(messages))
        self.in_air += len(ids)
        self.most = max(self.most, self.in_air)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(super().pull_messages(message_ids))
        self.in_air -= len(replies)
        return replies


def test_the_client_evaluation_keeps_at_most_a_wave_of_models_in_the_air(tmp_path: Path) -> None:
    cfg = load_config({"dataset": "synthetic", "num-clients": 7, "clients-per-round": 2, "num-rounds": 1,
                       "output-dir": str(tmp_path)})
    grid = CountingGrid(cfg.num_clients)
    r = build_run(grid, cfg)
    r.runner.directory.wait_for(cfg.num_clients, 10)
    results = {}
    for wave in (3, 100):
        grid.most = 0
        results[wave], asked = client_evaluate(grid, r.runner.directory, r.runner.dispatcher, r.strategy, 30.0, wave)
        assert asked == 7 and grid.in_air == 0
        assert grid.most == min(wave, 7)
    assert sorted(results[3]) == list(range(7))
    assert results[3] == results[100]  # the same metrics for every client, whatever the wave


def test_the_connected_line_names_a_few_partitions_not_every_one(tmp_path: Path, flower_log: list[str]) -> None:
    cfg = load_config({"dataset": "synthetic", "num-clients": 50, "clients-per-round": 2, "num-rounds": 1,
                       "output-dir": str(tmp_path)})
    r = build_run(InProcessGrid(client_app, cfg.num_clients), cfg)
    r.runner.directory.wait_for(cfg.num_clients, 10)
    [line] = [m for m in flower_log if "clients connected" in m]
    assert line.startswith("50 clients connected") and line.endswith(" and 30 more")
    assert line.count(":") == 1 + 20  # the label's, then one per partition named


def test_a_long_client_evaluation_says_how_far_it_is(tmp_path: Path, flower_log: list[str], monkeypatch) -> None:
    from server_app import evaluation

    monkeypatch.setattr(evaluation, "PROGRESS_EVERY_S", 0.0)  # a line after every wave
    cfg = load_config({"dataset": "synthetic", "num-clients": 7, "clients-per-round": 2, "num-rounds": 1,
                       "output-dir": str(tmp_path)})
    r = build_run(InProcessGrid(client_app, cfg.num_clients), cfg)
    r.runner.directory.wait_for(cfg.num_clients, 10)
    client_evaluate(r.runner.grid, r.runner.directory, r.runner.dispatcher, r.strategy, 30.0, 3)
    assert [m for m in flower_log if m.startswith("client evaluation:")] == [
        f"client evaluation: {n} of 7 clients asked, {n} replied" for n in (3, 6, 7)]


@pytest.fixture
def new_objects_only() -> Iterator[None]:
    """Every object alive before the test (the worker's modules, earlier tests' leftovers) moved out of the collector's
    generations (``gc.freeze``) for the test: ``gc.collect`` and ``gc.get_objects`` then walk only what the test
    made (walking everything, the counts were 13 of the test's 16 CPU s, measured alone; the same counts either way)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def model_copies(numel: int) -> tuple[int, int]:
    """Model-sized buffers alive in this process that the collector sees: (torch storages of `numel` floats, views
    counted once; bytes of Flower ``Array`` s of that size in messages and replies, one bytes object shared by many
    messages counted once)."""
    gc.collect()
    objects = gc.get_objects()
    storages = {o.untyped_storage().data_ptr() for o in objects if isinstance(o, torch.Tensor) and o.numel() == numel}
    arrays = {id(o.data) for o in objects if isinstance(o, Array) and len(o.data) >= 4 * numel}
    return len(storages), len(arrays)


@pytest.mark.parametrize(("preset", "own"), [("fedasync-digits", 1), ("feddle-digits", 10 + 2)])
def test_models_held_during_training_are_bounded_by_the_versions_in_flight(tmp_path: Path, preset: str, own: int,
                                                                           new_objects_only: None) -> None:
    """σ = 4 with 120 clients: most clients are idle and ~16 updates are in the air over ~8 model versions. The
    server holds, as tensors, one payload per version in flight, the step's accepted updates and the strategy's own
    state (`own`: FedAsync's model; Feddle's atlas of 10 anchors, its model and its search's copy), plus a few
    working copies; as message bytes, one record per version in flight (shared by that version's messages) and
    no reply that is not due: nothing per message, per reply or per client."""
    cfg = load_config({"preset": preset, "num-clients": 120, "clients-per-round": 4, "delay-sigma": 4.0,
                       "num-rounds": 24, "eval-every": 100, "local-epochs": 1, "checkpoint-every": 0, "cnn-width": 8,
                       "output-dir": str(tmp_path)})
    r = build_run(InProcessGrid(client_app, cfg.num_clients), cfg)
    r.runner.directory.wait_for(cfg.num_clients, 10)
    seen: list[tuple[int, int, int, int, int]] = []  # after each step: flights, versions, accepted, copies

    def on_round(entry: RoundLog) -> None:
        flights = r.runner.flights.values()
        seen.append((len(flights), len({f.version for f in flights}), entry.accepted, *model_copies(r.pspec.numel)))

    r.runner.run(cfg.num_rounds, on_round)
    assert max(s[0] for s in seen) >= 12 and max(s[1] for s in seen) >= 4  # the bound is tested under load
    for flights, versions, accepted, storages, arrays in seen:
        # own twice: the runner keeps a copy of the strategy's state after its last good step (a refused step's way
        # back, server_app/runtime.py)
        assert storages <= versions + accepted + 2 * own + 4, (flights, versions, accepted, storages)
        assert arrays <= versions + 1, (flights, versions, arrays)  # the dispatcher's last record may be unsent
    assert r.runner.flights == {} and model_copies(r.pspec.numel)[0] <= own + 4  # nothing kept of the discarded


def test_a_failed_scale_point_records_the_runs_reason_and_runs_again(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/scale.py: a point whose run failed keeps the ServerApp's exception, not the launcher's last line,
    and the next invocation runs it again (a point that ran is not)."""
    import subprocess

    from benchmarks import scale

    streamed = ("Traceback (most recent call last):\n  File \"wire.py\", line 132, in wait_for\n"
                "RuntimeError: only 3 of 4 clients connected within 120s (partitions [0, 1, 2])\n")
    monkeypatch.setattr(scale.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, streamed, "error: run 7 ended as 'finished:failed'; logs in /tmp/x\n"))
    failed = scale.run_point("flwr", "fedasync", 10, 2, "fashion-mnist", 60)
    assert failed["error"] == "exit 1: RuntimeError: only 3 of 4 clients connected within 120s (partitions [0, 1, 2])"

    ran = []
    measured = {k: v for k, v in failed.items() if k != "error"} | {"peak-mb": 1.0, "seconds": 1.0, "accepted": 1,
                                                                   "client-eval-replies": 10}
    monkeypatch.setattr(scale, "run_point", lambda *point: ran.append(point[:4]) or measured)
    monkeypatch.setattr(scale, "plot", lambda results, path: None)
    (tmp_path / "runs.jsonl").write_text(json.dumps(failed) + "\n")  # with its job's digest: current, but failed
    args = ["--engines", "flwr", "--methods", "fedasync", "--clients", "10", "--steps", "2", "--dataset",
            "fashion-mnist", "--results", str(tmp_path)]
    assert scale.main(args) == 0 and ran == [("flwr", "fedasync", 10, 2)]  # the failed point, again
    assert scale.main(args) == 0 and len(ran) == 1  # now it ran: not again
