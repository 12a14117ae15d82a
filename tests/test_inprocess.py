"""End to end through the in-process engine: the real ServerApp and ClientApp objects in one process."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from helpers import faulty_client_app, rows

from client_app.app import app as client_app
from common.models import build_model
from common.params import ParamSpec
from common.protocol import ARRAYS, TRAIN_SEED
from common.splits import data_spec, load_dataset, make_splits
from common.training import evaluate
from hybridfl.engine.inprocess import InProcessGrid, run_inprocess
from server_app.config import client_config, load_config
from server_app.flower import FlowerStrategy
from strategies import build_strategy


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_gives_byte_identical_models_and_another_seed_does_not(small_run):
    a, _ = small_run("a", seed=5)
    b, _ = small_run("b", seed=5)
    c, _ = small_run("c", seed=6)
    assert digest(a / "model.pt") == digest(b / "model.pt")
    assert digest(a / "model.pt") != digest(c / "model.pt")
    ma, mc = torch.load(a / "model.pt"), torch.load(c / "model.pt")
    assert any(not torch.equal(ma[k], mc[k]) for k in ma)


def test_a_run_without_plots_writes_the_same_files_and_numbers_but_no_image(small_run):
    drawn, with_plots = small_run("drawn")
    plain, without = small_run("plain", plots=False)
    assert sorted(p.name for p in drawn.iterdir() if p.suffix != ".png") == sorted(p.name for p in plain.iterdir())
    assert {"accuracy.png", "staleness.png"} <= {p.name for p in drawn.iterdir()}
    assert digest(drawn / "model.pt") == digest(plain / "model.pt") and rows(drawn) == rows(plain)
    assert without["config"]["plots"] is False and with_plots["config"]["plots"] is True


def test_outputs_written(small_run):
    out, summary = small_run("outputs", **{"num-rounds": 4, "eval-every": 2})
    lines = rows(out)
    assert [r["round"] for r in lines] == [0, 1, 2, 3, 4]
    assert [("test-accuracy" in r) for r in lines] == [True, False, True, False, True]
    assert all(r["accepted"] == 4 for r in lines[1:])
    assert summary["final-version"] == 4 and summary["total-accepted"] == 16
    assert summary["final-test-accuracy"] == lines[-1]["test-accuracy"]
    assert summary["max-last-5-evals"] == max(r["test-accuracy"] for r in lines if "test-accuracy" in r)
    assert summary["client-eval"]["replies"] == 4
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    state = torch.load(out / "model.pt")
    assert set(state) == {n for n, _ in build_model("cnn", 1, 8, 4, 0).named_parameters()}
    # The saved model is the one whose accuracy the summary reports.
    cfg = load_config({"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4})
    model = build_model("cnn", 1, 8, 4, 0)
    model.load_state_dict(state)
    acc = evaluate(model, make_splits(data_spec(cfg)).test)["accuracy"]
    assert acc == pytest.approx(summary["final-test-accuracy"])


def test_bad_replies_are_counted_and_the_run_goes_on(small_run):
    out, summary = small_run("faulty", client_app=faulty_client_app(), **{"num-clients": 5, "clients-per-round": 5})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [(r["accepted"], r["failures"], r["rejected"]) for r in rows] == [(2, 1, 2)] * 3
    assert summary["total-failures"] == 3 and summary["total-rejected"] == 6 and summary["final-version"] == 3
    assert np.isfinite(summary["final-test-loss"])


def test_a_run_whose_replies_mostly_fail_stops_quoting_the_first_failure(small_run, tmp_path):
    """3 of every 5 replies lost (an exception, NaN, a wrong shape): over max-failed-fraction 0.5 the run stops
    after its first step with an error that counts them and quotes the first; at the default (0.8) it goes on (the
    test above); with every reply failing, the default stops it too. What it wrote so far stays."""
    faulty = {"client_app": faulty_client_app(), "num-clients": 5, "clients-per-round": 5}
    with pytest.raises(RuntimeError, match=r"round 1: 3 of the run's 5 dispatches failed, were rejected or timed out "
                                           r"\(0 timed out after reply-timeout-s = 600\), more than "
                                           r"max-failed-fraction = 0.5; the first: round 1, client \d: "):
        small_run("strict", **faulty, **{"max-failed-fraction": 0.5})
    assert [r["round"] for r in rows(tmp_path / "strict")] == [0, 1]

    def broken(msg: Message, context) -> Message:
        raise RuntimeError("the device's disk is full")

    failing = ClientApp()
    failing.train()(broken)
    for kind in ("evaluate", "query"):
        getattr(failing, kind)()(lambda msg, context: client_app(msg, context))
    with pytest.raises(RuntimeError, match=r"4 of the run's 4 dispatches .* the first: round 1, client \d: error reply "
                                           r"\(code \d\): RuntimeError: the device's disk is full"):
        small_run("broken", client_app=failing)
    # asked never to stop, it runs out its rounds, and then fails: a run that accepted no update learned nothing
    with pytest.raises(RuntimeError, match=r"the run accepted no update in 2 rounds \(8 failed, 0 rejected, 0 "
                                           r"unavailable at the SuperLink, 0 timed out .*\); the first: round 1, "
                                           r"client \d: error reply"):
        small_run("tolerant", client_app=failing, **{"max-failed-fraction": 1.0, "num-rounds": 2})
    assert [r["round"] for r in rows(tmp_path / "tolerant")] == [0, 1, 2]


def test_client_exception_becomes_an_error_reply():
    grid = InProcessGrid(client_app, num_nodes=2)
    node = next(iter(grid.get_node_ids()))
    # A train message without its config: the handler raises, the reply carries the error.
    msg = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node, message_type="train")
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and reply.error.code == 2 and "KeyError" in reply.error.reason


def test_unknown_node_gets_node_unavailable():
    grid = InProcessGrid(client_app, num_nodes=1)
    (reply,) = grid.send_and_receive([Message(RecordDict(), dst_node_id=12345, message_type="train")])
    assert reply.has_error() and reply.error.code == 5


@pytest.mark.parametrize("name,clock", [("fedavg", None), ("fedbuff", "wall")])
def test_strategy_runs_under_flowers_start(name, clock):
    """`FlowerStrategy(strategy).start(grid, ...)` works the way Flower users expect: Flower's own round loop,
    or (FedBuff, `clock="wall"`) the hybridfl runtime behind the same call."""
    cfg = load_config({"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "local-epochs": 2,
                       "batch-size": 16, "strategy": name, **({"buffer-size": 2} if name == "fedbuff" else {})})
    grid = InProcessGrid(client_app, num_nodes=4)
    full, spec = load_dataset("synthetic"), data_spec(cfg)
    model = build_model("cnn", 1, 8, full.num_classes, seed=0)
    pspec = ParamSpec.of(model)
    strategy = build_strategy(cfg.strategy, cfg.options)
    test = make_splits(spec).test

    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        pspec.load_into(model, pspec.from_record(arrays))
        return MetricRecord(evaluate(model, test))

    train_config = ConfigRecord(client_config(cfg))
    result = FlowerStrategy(strategy, clients_per_round=4, evaluate_clients=4).start(
        grid=grid, initial_arrays=pspec.to_record(pspec.flatten(model)), num_rounds=3, train_config=train_config,
        evaluate_fn=evaluate_fn, clock=clock)
    accs = [result.evaluate_metrics_serverapp[r]["accuracy"] for r in range(4)]
    assert accs[-1] > accs[0] + 0.3
    assert strategy.version == (3 if name == "fedavg" else 6)  # FedBuff: 4 arrivals per step, K = 2
    assert torch.equal(pspec.from_record(result.arrays), strategy.params)
    assert set(result.evaluate_metrics_clientapp[3]) >= {"eval-accuracy", "eval-loss"}
    assert all(m["train-loss"] > 0 for m in result.train_metrics_clientapp.values())


@pytest.mark.e2e
def test_main_job_reaches_085_in_process(tmp_path):
    """README command (1)'s job (Feddle-ID on digits: 20 clients, 5 per step, delays σ = 5 steps,
    150 held-out digits on the server) through the in-process engine."""
    from hybridfl.launch.job import MAIN_JOB

    out = run_inprocess({"preset": MAIN_JOB, "output-dir": str(tmp_path), "run-name": "main"})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["strategy"] == "feddle" and summary["server-data"] == "150 in-domain samples on cpu"
    assert summary["final-test-accuracy"] >= 0.85
    searches = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss-after" in r]
    # a search at every step with arrivals; on average it lowers the server loss from FedBuff's point
    assert len(searches) >= 50
    assert sum(r["loss-after"] for r in searches) < sum(r["loss-before"] for r in searches)


@pytest.mark.e2e
def test_lora_fedavg_sends_only_adapters_and_head_and_learns(tmp_path):
    """ViT with LoRA on digits: the wire carries adapters + head only, and FedAvg improves accuracy."""
    sent: list[int] = []
    grid = InProcessGrid(client_app, num_nodes=4)
    push = grid.push_messages

    def recording_push(messages):
        messages = list(messages)
        sent.extend(m.content[ARRAYS]["params"].numpy().size for m in messages if m.metadata.message_type == "train")
        return push(messages)

    grid.push_messages = recording_push
    # input 16 (16 patches, not 64): a quarter of the compute, and the same wire and the same learning claim
    out = run_inprocess({"model": "vit-small", "input-size": 16, "num-clients": 4, "clients-per-round": 4,
                         "num-rounds": 3, "local-epochs": 1, "optimizer": "adam", "lr": 0.003,
                         "output-dir": str(tmp_path), "run-name": "lora"}, grid=grid)
    model = build_model("vit-small", 1, 8, 10, seed=0)
    trainable = ParamSpec.of(model)
    assert all(".lora_" in n or n.startswith("head.") for n in trainable.names)
    total = sum(p.numel() for p in model.parameters())
    assert set(sent) == {trainable.numel} and trainable.numel < 0.02 * total
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["test-accuracy"] > rows[0]["test-accuracy"] + 0.15


def test_client_model_cache_carries_nothing_between_messages():
    """The ClientApp reuses one model per process; buffers and frozen weights are reset per message."""
    from client_app.work import _model
    from common.models import build_from_config, model_config

    grid = InProcessGrid(client_app, num_nodes=2)
    cfg = load_config({"dataset": "synthetic", "num-clients": 2, "clients-per-round": 2, "model": "resnet18",
                       "input-size": 32, "batch-norm": "running", "batch-size": 16, "local-epochs": 1})
    full = load_dataset("synthetic")
    model = build_from_config(cfg.to_dict(), (1, 8, 8), full.num_classes, seed=0)
    pspec = ParamSpec.of(model)
    config = ConfigRecord({**client_config(cfg), "version": 0, TRAIN_SEED: 1})
    node = next(iter(grid.get_node_ids()))

    def send(kind: str) -> Message:
        content = RecordDict({ARRAYS: pspec.to_record(pspec.flatten(model)), "config": config})
        (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type=kind)])
        assert not reply.has_error(), reply.error
        return reply

    before = dict(send("evaluate").content["metrics"])
    send("train")  # updates the cached model's BatchNorm running statistics
    after = dict(send("evaluate").content["metrics"])
    assert before == after  # ...which the next message does not see
    _, initial, _ = _model(tuple(sorted(model_config(cfg.to_dict()).items())), (1, 8, 8), full.num_classes, cfg.seed)
    assert any("running_mean" in n for n in initial)
