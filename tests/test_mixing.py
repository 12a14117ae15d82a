"""Data mixing (strategies/mixing.py): each variant against the mixing paper's App. A pseudo-code, FedAvg where it
must equal it, and its payload accounting against the bytes the runtime really pushed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import MessageType
from helpers import digest, rows
from torch.nn import functional as F

from client_app.app import app as client_app
from common.config import ConfigError
from common.models import build_from_config
from common.params import ParamSpec
from common.protocol import ARRAYS, EXTRAS
from common.server_data import ServerData
from common.splits import data_spec, make_splits
from common.training import LocalRecipe, evaluate, server_seed, train_on_server
from hybridfl.engine.inprocess import InProcessGrid, run_inprocess
from server_app.config import load_config
from strategies import ExampleTransfer, FedAvg, GeneralizedFedAvg, GradientTransfer, ParallelTraining
from strategies.base import Update
from strategies.mixing import CENTRAL_GRADIENT, CENTRAL_X, CENTRAL_Y

TINY = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "num-rounds": 3, "local-epochs": 1,
        "batch-size": 16, "central-size": 40, "optimizer": "sgd", "lr": 0.05}
RECIPE = LocalRecipe(local_epochs=1, batch_size=8, lr=0.05)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def built(cls, **options):
    """`cls` on the synthetic data's CNN, with 40 central samples attached (as the runner attaches them)."""
    cfg = load_config({**TINY})
    model = build_from_config(cfg.to_dict(), (1, 8, 8), 4, seed=0)
    spec = ParamSpec.of(model)
    s = cls(recipe=RECIPE, seed=3, **options)
    s.initialize(spec.flatten(model), spec, model)
    s.attach(ServerData(make_splits(data_spec(cfg)).central, True, torch.device("cpu")))
    return s


def feed(s, deltas):
    for c, d in enumerate(deltas):
        s.receive(Update(c, s.version, d, 10 * (c + 1), sent=s.model_for(c)))
    s.close_round()
    return s.step()


def deltas(s, n=3):
    return [0.01 * torch.randn(s.spec.numel, generator=gen(c)) for c in range(n)]


# --- generalised FedAvg ---------------------------------------------------------------------------


def test_sgd_serveropt_at_lr_1_is_fedavg_and_fedadam_follows_reddi_et_al():
    s, f = built(GeneralizedFedAvg), FedAvg()
    f.initialize(s.params, s.spec)
    d = deltas(s)
    feed(s, d), feed(f, d)
    assert torch.equal(s.params, f.params)
    a = built(GeneralizedFedAvg, server_optimizer="adam", server_lr=0.1)
    x0 = a.params.clone()
    feed(a, d)
    delta = (10 * d[0] + 20 * d[1] + 30 * d[2]) / 60
    m, v = 0.1 * delta, 0.01 * delta * delta
    torch.testing.assert_close(a.params, x0 + 0.1 * m / (v.sqrt() + 1e-3))
    torch.testing.assert_close(a.moments[0], m) and torch.testing.assert_close(a.moments[1], v)


# --- parallel training -------------------------------------------------------------------------------


def test_parallel_training_merges_the_central_and_federated_deltas():
    s = built(ParallelTraining, central_weight=0.25, central_steps=3, central_lr=0.02, central_merge_lr=0.8,
              server_lr=0.5)
    x = s.params.clone()
    d = deltas(s)
    x_c, _ = train_on_server(s.model, s.spec, x, s.server, LocalRecipe(1, 8, 0.02), server_seed(3, 0), max_steps=3)
    metrics = feed(s, d)
    delta_f = 0.5 * (10 * d[0] + 20 * d[1] + 30 * d[2]) / 60
    torch.testing.assert_close(s.params, x + 0.8 * (0.25 * (x_c - x) + 0.75 * delta_f))
    assert metrics["central-train-loss"] > 0 and not torch.equal(x_c, x)


def test_parallel_training_at_alpha_1_is_central_training_alone():
    s = built(ParallelTraining, central_weight=1.0, central_steps=5)
    x = s.params.clone()
    x_c, _ = train_on_server(s.model, s.spec, x, s.server, RECIPE.__class__(1, 8, 1e-3), server_seed(3, 0),
                             max_steps=5)
    feed(s, deltas(s))
    torch.testing.assert_close(s.params, x_c)


@pytest.mark.parametrize("strategy,options", [("parallel-training", {"central-weight": 0.0}),
                                              ("example-transfer", {"transfer-examples": 0}),
                                              ("gradient-transfer", {"gradient-weight": 0.0})])
def test_each_variant_switched_off_is_fedavg_byte_for_byte(tmp_path, strategy, options):
    """Through the runtime, asynchronously: the central work still runs (central training, a zero gradient sent
    and added) but adds nothing."""
    common = {**TINY, "clients-per-round": 2, "delay-sigma": 1.0, "output-dir": str(tmp_path)}
    a = run_inprocess({**common, "strategy": strategy, **options, "run-name": strategy})
    b = run_inprocess({**common, "strategy": "fedavg", "run-name": "fedavg"})
    assert digest(a / "model.pt") == digest(b / "model.pt")


# --- gradient transfer ----------------------------------------------------------------------------


def test_the_transferred_gradient_is_autograd_of_the_central_loss_at_the_dispatched_model():
    s = built(GradientTransfer, transfer_batch=16, gradient_weight=0.5)
    feed(s, deltas(s))  # version 1: the gradient must be at the new model
    payload = s.model_for(2)
    assert GradientTransfer.client_side.objective == "gradient-transfer" and torch.equal(payload.params, s.params)
    x, y = s.central_batch(16, server_seed(3, 1))
    s.spec.load_into(s.model, s.params)
    params = [p for p in s.model.parameters() if p.requires_grad]
    g = torch.autograd.grad(F.cross_entropy(s.model(x), y), params)
    torch.testing.assert_close(payload.arrays[CENTRAL_GRADIENT], 0.5 * torch.cat([t.reshape(-1) for t in g]))
    assert s.model_for(0).arrays[CENTRAL_GRADIENT] is payload.arrays[CENTRAL_GRADIENT]  # one per version
    assert len(set(y.tolist())) > 1 and len(x) == 16


# --- example transfer ----------------------------------------------------------------------------


def test_each_dispatch_carries_its_own_central_examples():
    s = built(ExampleTransfer, transfer_examples=8)
    a, b, again = s.model_for(0), s.model_for(1), s.model_for(0)
    central = s.server.data
    assert a.arrays[CENTRAL_X].shape == (8, 1, 8, 8) and a.arrays[CENTRAL_Y].dtype == torch.float32
    assert not torch.equal(a.arrays[CENTRAL_X], b.arrays[CENTRAL_X])  # drawn per client
    assert torch.equal(a.arrays[CENTRAL_X], again.arrays[CENTRAL_X])  # and fixed by (version, client)
    for x, y in zip(a.arrays[CENTRAL_X], a.arrays[CENTRAL_Y]):  # real central samples with their labels
        i = int(np.flatnonzero((central.x == x.numpy()).all(axis=(1, 2, 3)))[0])
        assert central.y[i] == int(y)
    assert a.extra_nbytes == 4 * 8 * (64 + 1)


def test_only_the_transferred_examples_teach_the_class_the_clients_lack(tmp_path):
    """A label shift: class 3 leaves the clients (central-classes) and only the server holds it. FedAvg never
    predicts it; with example transfer the clients learn it from the examples they are sent."""
    common = {**TINY, "central-classes": "3", "central-size": 0, "num-rounds": 4, "local-epochs": 2,
              "output-dir": str(tmp_path)}
    splits = make_splits(data_spec(load_config(common)))
    assert set(splits.central.y.tolist()) == {3} and 3 not in set(splits.train.y.tolist())
    lacking = splits.test.subset(np.flatnonzero(splits.test.y == 3))
    recall = {}
    for name, extra in (("fedavg", {}), ("example-transfer", {"transfer-examples": 16})):
        out = run_inprocess({**common, "strategy": name, **extra, "run-name": name})
        model = build_from_config(load_config(common).to_dict(), (1, 8, 8), 4, seed=0)
        model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
        recall[name] = evaluate(model, lacking)["accuracy"]
    assert recall["fedavg"] == 0.0 and recall["example-transfer"] > 0.8


def test_payload_counters_match_the_bytes_actually_pushed(tmp_path):
    pushed = []  # (all array bytes, extra array bytes) of every train message the grid was given

    class Counting(InProcessGrid):
        def push_messages(self, messages):
            messages = list(messages)
            for m in messages:
                if m.metadata.message_type == MessageType.TRAIN:
                    model = sum(a.numpy().nbytes for _, a in m.content[ARRAYS].items())
                    extra = (sum(a.numpy().nbytes for _, a in m.content[EXTRAS].items())
                             if EXTRAS in m.content.array_records else 0)
                    pushed.append((model + extra, extra))
            return super().push_messages(messages)

    out = run_inprocess({**TINY, "strategy": "example-transfer", "transfer-examples": 5, "delay-sigma": 1.0,
                         "clients-per-round": 2, "output-dir": str(tmp_path), "run-name": "count"},
                        grid=Counting(client_app, TINY["num-clients"]))
    steps = rows(out)
    assert pushed and sum(r["bytes-down"] for r in steps) == sum(p for p, _ in pushed)
    assert sum(r["bytes-extra-down"] for r in steps) == sum(e for _, e in pushed) == len(pushed) * 4 * 5 * (64 + 1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["extra-bytes-down-per-dispatch"] == 4 * 5 * (64 + 1)
    model = ParamSpec.of(build_from_config(load_config(TINY).to_dict(), (1, 8, 8), 4, seed=0)).numel
    assert summary["bytes-up-per-update"] == 4 * model  # the uplink is unchanged: one delta


def test_mixing_needs_in_domain_central_data_and_says_which_key():
    with pytest.raises(ConfigError, match="'central-size' = 0 .*strategy 'gradient-transfer'"):
        run_inprocess({**TINY, "central-size": 0, "strategy": "gradient-transfer", "output-dir": "/tmp/x"})
