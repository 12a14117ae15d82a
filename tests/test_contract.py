"""The strategy contract, checked for every registered strategy (like torch's optimizer test battery):
state_dict round trip mid-run, resume after a crash, rejection of bad replies, determinism per seed,
Flower's loop against the runtime, server data really used under both loops and checked at attach."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.clientapp import ClientApp
from helpers import Crash, crashing, digest, faulty_client_app, rows
from torch import nn

from client_app.app import app as client_app
from common.codecs import WireCodecs
from common.config import ConfigError, make_options, specs_of
from common.datasets import ArrayDataset
from common.server_data import ServerData
from hybridfl.engine.inprocess import InProcessGrid, run_inprocess
from hybridfl.sweep import config_digest
from server_app.config import load_config
from server_app.run import TrainingRun, build_run
from strategies import STRATEGIES, Center, FedAvg, FedDF, Feddle, FedFT, GradientTransfer
from strategies.base import Update
from strategies.feddual import LOSS_GRADIENT
from strategies.fedem import COMPONENT_DELTAS, COMPONENTS, MIXTURE

NAMES = sorted(STRATEGIES)
# Every strategy, then family variants that take other paths: Feddle out of domain (its own head on digits), FedMerge's
# Fixed ablation, FedDUAL's loss-gradient aggregation (a client side that sends a gradient back)
CASES = [(name, {}) for name in NAMES] + [
    ("feddle", {"server-dataset": "digits", "server-dataset-size": 40, "fallback-lambda": 0.01}),
    ("fedmerge", {"fixed-models": 2}),
    ("feddual", {"dynamic-source": "loss-gradient"}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in list(extra.items())[:1]) for name, extra in CASES]
# cnn-width 16, half the default: no claim here is about the model, and its convolutions were most of the battery's
# CPU (99 CPU s against 209 at 32, the battery alone on 2 workers); at 8 FedDUAL's loss-gradient run with topk16
# updates diverged (an update rejected by max-update-ratio)
BASE = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 6, "local-epochs": 1,
        "batch-size": 16, "central-size": 40, "checkpoint-every": 2, "plots": False, "cnn-width": 16}
METHOD_KEYS = {"buffer-size": 2}  # given to the strategies that have them: a small buffer steps often
ASYNC = {"delay-sigma": 1.5}  # updates cross step boundaries: checkpoints hold flights and half-full buffers


def config(name: str, **kw: Any) -> dict[str, Any]:
    """The battery's run of strategy `name`: BASE, and of METHOD_KEYS those the strategy has (a key it does not use
    is refused)."""
    own = specs_of(STRATEGIES[name].Config)
    return {**BASE, **{k: v for k, v in METHOD_KEYS.items() if k in own}, "strategy": name, **kw}


# Finished runs of the stock ClientApp by configuration (its digest: output folder aside, defaults dropped): the
# battery's tests that need the very same run (an uninterrupted run, the runtime's and Flower's loop at the central
# split's default size) share one
_FINISHED: dict[str, Path] = {}


def run(tmp_path: Path, name: str, run_name: str, client_app: ClientApp | None = None, fresh: bool = False,
        **kw: Any) -> Path:
    """The battery's run of `name` (made in `tmp_path`, or one made earlier with the same configuration unless
    `fresh`: a test that compares two runs of one configuration needs both made)."""
    cfg = config(name, **{"output-dir": str(tmp_path), "run-name": run_name, **kw})
    key = None if client_app is not None else config_digest(cfg)
    if key in _FINISHED and not fresh:
        return _FINISHED[key]
    out = run_inprocess(cfg, client_app=client_app)
    if key is not None:
        _FINISHED.setdefault(key, out)
    return out


def same(a: Any, b: Any) -> bool:
    """Deep equality of strategy state: tensors bit for bit, modules by state_dict, dataclasses by fields."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, nn.Module):
        return type(a) is type(b) and same(a.state_dict(), b.state_dict())
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def built(tmp_path: Path, name: str, run_name: str, **kw: Any) -> TrainingRun:
    cfg = load_config(config(name, **{"output-dir": str(tmp_path), "run-name": run_name, **kw}))
    r = build_run(InProcessGrid(client_app, cfg.num_clients), cfg)
    r.runner.directory.wait_for(cfg.num_clients, 10)
    return r


# What a strategy's clients send back besides the delta (made up like the delta, for `feed`)
REPLY_ARRAYS = {
    "fedem": lambda s, sent, gen: {COMPONENT_DELTAS: 0.01 * torch.randn(sent.arrays[COMPONENTS].shape, generator=gen),
                                   MIXTURE: torch.softmax(torch.randn(sent.arrays[MIXTURE].shape, generator=gen), 0)},
    "feddual": lambda s, sent, gen: {LOSS_GRADIENT: torch.randn(sum(d.stop - d.start for d in s._dynamic),
                                                                generator=gen)},
}


def feed(r: TrainingRun, step: int) -> None:
    """The same two made-up updates, then the end of a step, into `r`'s strategy."""
    s = r.strategy
    for c in (0, 1):
        gen = torch.Generator().manual_seed(10 * step + c)
        delta, sent = 0.01 * torch.randn(s.spec.numel, generator=gen), s.model_for(c)
        arrays = REPLY_ARRAYS[s.name](s, sent, gen) if s.name in REPLY_ARRAYS else {}
        update = Update(c, s.version, delta, 10 + c, arrays=arrays, sent=sent)
        s.check(update)
        s.receive(update)
        if s.ready():
            s.step()
    s.close_round()
    if s.ready():
        s.step()


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_state_dict_round_trip_mid_run_restores_every_attribute(tmp_path, name, extra):
    r = built(tmp_path, name, "a", **ASYNC, **extra)
    r.runner.run(3, r.on_round)  # mid-run: flights in the air, buffers and atlases part full
    state, again = r.strategy.state_dict(), r.strategy.state_dict()
    twin = built(tmp_path, name, "b", **ASYNC, **extra)
    twin.strategy.load_state_dict(state)
    structure = type(r.strategy)._structure
    assert same({k: v for k, v in vars(twin.strategy).items() if k not in structure},
                {k: v for k, v in vars(r.strategy).items() if k not in structure})
    for step in range(3):  # the restored twin goes on exactly as the original
        feed(r, step)
        feed(twin, step)
        assert twin.strategy.version == r.strategy.version and torch.equal(twin.strategy.params, r.strategy.params)
    assert same(state, again)  # a state_dict is a copy: going on did not change it
    with pytest.raises(ValueError, match="missing"):
        twin.strategy.load_state_dict({k: v for k, v in state.items() if k != "version"})


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_a_run_killed_mid_step_and_resumed_ends_byte_identical(tmp_path, name, extra):
    whole = run(tmp_path, name, "whole", **ASYNC, **extra)
    with pytest.raises(Crash):  # killed during step 5, after the checkpoint of step 4
        run(tmp_path, name, "killed", crashing(5, tmp_path / "killed"), **ASYNC, **extra)
    killed = tmp_path / "killed"
    assert len(rows(killed)) == 5 and not (killed / "summary.json").exists()
    resumed = run_inprocess({"resume": str(killed)})
    assert resumed == killed
    assert digest(resumed / "model.pt") == digest(whole / "model.pt")
    # a client side's own state (Ditto's personal models: their personal-* metrics) comes back with the in-process
    # nodes' states (server_app/node_state.py)
    assert rows(resumed) == rows(whole)
    assert rows(resumed, "events.jsonl") == rows(whole, "events.jsonl")
    assert (killed / "nodes").is_dir() == STRATEGIES[name].client_side.stateful
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed-after-round"] == 4 and summary["total-accepted"] == sum(r["accepted"] for r in rows(whole))


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_bad_replies_are_rejected_counted_and_the_run_goes_on(tmp_path, name, extra):
    out = run(tmp_path, name, "faulty", faulty_client_app(), **{"num-clients": 5, "clients-per-round": 5,
                                                                "num-rounds": 3, **extra})
    steps = rows(out)[1:]
    assert [(r["accepted"], r["rejected"], r["failures"]) for r in steps] == [(2, 2, 1)] * 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final-version"] >= 3 and torch.isfinite(torch.tensor(summary["final-test-loss"]))
    model = torch.load(out / "model.pt")
    assert all(torch.isfinite(t).all() for t in model.values())


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_the_seed_fixes_the_run(tmp_path, name, extra):
    a, b, c = (run(tmp_path, name, n, fresh=n == "b", **ASYNC, **extra, seed=s)
               for n, s in (("a", 0), ("b", 0), ("c", 4)))
    assert digest(a / "model.pt") == digest(b / "model.pt") != digest(c / "model.pt")
    assert rows(a) == rows(b) and rows(a, "events.jsonl") == rows(b, "events.jsonl")


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_flowers_loop_gives_the_runtimes_synchronous_run(tmp_path, name, extra):
    ours = run(tmp_path, name, "runtime", **{"num-rounds": 3, **extra})
    flowers = run(tmp_path, name, "flower", loop="flower", **{"num-rounds": 3, **extra})
    assert digest(flowers / "model.pt") == digest(ours / "model.pt")
    assert rows(flowers) == rows(ours) and rows(flowers, "events.jsonl") == rows(ours, "events.jsonl")


# Each dense update codec and topk16 once, each with a model codec, the last model codec topk as a difference
# (common/codecs.py; topk16's differences and topk's updates: tests/test_codecs.py, tests/test_resume.py)
CODECS = [("fp16", "none", False), ("int8", "fp16", False), ("topk16", "topk", True)]


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_every_method_works_on_what_each_codec_it_accepts_delivers_and_refuses_the_others_at_start(tmp_path, name,
                                                                                                   extra):
    """Through the ClientApp's mod and the runtime's decoding: every update accepted (the runtime decodes by the
    run's codec and rejects any other record: each reply was encoded as the run says), a finite model, fewer bytes
    counted each way; a pairing the method refuses fails at start."""
    plain = run(tmp_path, name, "runtime", **{"num-rounds": 3, **extra})
    base = json.loads((plain / "summary.json").read_text())
    for update_codec, model_codec, difference in CODECS:
        keys = {"num-rounds": 3, **extra, "update-codec": update_codec, "model-codec": model_codec,
                "model-difference": difference}
        cls = STRATEGIES[name]
        cfg = config(name, **keys)
        if cls.codec_refusal(make_options(cls.Config, cfg), make_options(WireCodecs, cfg)):
            with pytest.raises(ConfigError, match="update-codec"):
                load_config(cfg)
            continue
        out = run(tmp_path, name, f"{update_codec}-{model_codec}", **keys)
        steps = rows(out)[1:]
        assert sum(r["accepted"] for r in steps) == base["total-accepted"] > 0, update_codec
        assert sum(r["rejected"] + r["failures"] for r in steps) == 0, update_codec
        summary = json.loads((out / "summary.json").read_text())
        assert all(torch.isfinite(v).all() for v in torch.load(out / "model.pt").values())
        assert summary["bytes-up-per-update"] < base["bytes-up-per-update"], update_codec
        assert (summary["bytes-down-per-dispatch"] < base["bytes-down-per-dispatch"]) == (model_codec != "none")


@pytest.mark.parametrize("loop", ["hybridfl", "flower"])
@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_server_data_methods_use_their_data_and_the_others_ignore_it(tmp_path, name, extra, loop):
    """The server's central split is carved from the test split, so the clients' data is the same with 40 or
    60 central samples: only a method that uses the server's data can end with another model."""
    small, large = (run(tmp_path, name, f"c{n}", loop=loop, **{"central-size": n, "num-rounds": 3, **extra})
                    for n in (40, 60))
    uses = STRATEGIES[name].server_data != "none" and "server-dataset" not in extra  # OOD: not the central split
    assert (digest(small / "model.pt") != digest(large / "model.pt")) == uses


class InDomainMethod(FedAvg):
    """A user's own method, unregistered, that trains on the server's labels."""

    server_data = "in-domain"


OOD = ServerData(ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64), 2), False,
                 torch.device("cpu"), "digits")


@pytest.mark.parametrize("strategy,server,key,label", [
    (FedDF(), None, "central-size", "feddf"),
    (Feddle(), None, "central-size", "feddle"),
    (GradientTransfer(), None, "central-size", "gradient-transfer"),
    (Center(), OOD, "server-dataset", "center"),
    (FedFT(), OOD, "server-dataset", "fedft"),
    (Feddle(server_finetune_epochs=1), OOD, "server-dataset", "feddle"),
    (InDomainMethod(), OOD, "server-dataset", InDomainMethod.reference()),  # not hybridfl's: named by its path
])
def test_a_strategy_built_by_hand_refuses_unfit_server_data_at_attach(strategy, server, key, label):
    """Strategy.attach is the one check, so a strategy outside build_run (a user's own ServerApp) gets it too."""
    value = "'digits'" if server else "0"
    with pytest.raises(ConfigError, match=f"'{key}' = {value} .*strategy '{label}'") as info:
        strategy.attach(server)
    assert info.value.key == key and strategy.server is None


def test_attach_takes_the_server_data_a_strategy_can_use():
    for strategy, server in ((FedAvg(), None), (FedAvg(), OOD), (FedDF(), OOD), (Feddle(), OOD)):
        strategy.attach(server)
        assert strategy.server is server


def test_a_misspelt_server_need_is_refused():
    class Misspelt(FedAvg):
        server_data = "in_domain"

    with pytest.raises(ValueError, match="'in_domain': expected one of"):
        Misspelt().attach(None)



# --- a method's client side: one declared channel -------------------------------------------------------------


def test_every_message_carries_the_options_the_client_side_declares_and_a_callers_config_cannot_change_a_run_key():
    from common.params import ParamSpec
    from server_app.runtime import Runner
    from strategies.ditto import Ditto

    model = nn.Linear(3, 2)
    strategy = Ditto(ditto_lambda=0.3, num_clients=4)
    strategy.initialize(ParamSpec.of(model).flatten(model), ParamSpec.of(model), model)
    runner = Runner(InProcessGrid(client_app, 4), strategy, {"lr": 0.01, "local-objective": "cross-entropy"})
    runner.wait_for_nodes(4)
    messages = runner.evaluate_messages(2, random.Random(0), {"eval-split": "test"})
    assert [{k: m.content["config"][k] for k in ("ditto-lambda", "strategy", "lr", "eval-split")}
            for m in messages] == [{"ditto-lambda": 0.3, "strategy": "ditto", "lr": 0.01, "eval-split": "test"}] * 2
    with pytest.raises(ValueError, match="cannot change the run's keys: local-objective"):
        runner.evaluate_messages(1, random.Random(0), {"local-objective": "proximal"})


def test_a_client_side_reading_a_key_its_strategy_does_not_declare_is_refused_at_definition():
    from strategies.client import ClientSide

    class Reads(ClientSide):
        keys = ("ditto-lambda",)

    with pytest.raises(TypeError, match="reads keys its Config does not declare: ditto-lambda"):
        class Wrong(FedAvg):
            client_side = Reads


def test_a_method_whose_clients_need_their_objective_refuses_another():
    assert load_config(config("scaffold")).strategy == "scaffold"
    assert load_config(config("scaffold", **{"local-objective": "scaffold"})).strategy == "scaffold"
    with pytest.raises(ConfigError, match="local-objective.*'scaffold' or unset: strategy 'scaffold' trains its "
                                          "clients with objective 'scaffold'"):
        load_config(config("scaffold", **{"local-objective": "proximal"}))
