"""Center, Fed+FT and HFCL against their definitions: the same floats as FedAvg + train() by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import stepped

from common.config import ConfigError, part_of
from common.models import build_model
from common.params import ParamSpec
from common.server_data import ServerData
from common.splits import ArrayDataset
from common.training import LocalRecipe, evaluate, server_seed, train, train_on_server
from server_app.config import load_config
from strategies import HFCL, STRATEGIES, Center, FedAvg, FedFT, build_strategy
from strategies.base import Update

RECIPE = LocalRecipe(local_epochs=2, batch_size=8, lr=0.05, optimizer="sgd", momentum=0.9)


def setup(seed: int = 0, n_server: int = 40, in_domain: bool = True):
    model = build_model("cnn", 1, 8, 4, seed=seed)
    spec = ParamSpec.of(model)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_server, 1, 8, 8, generator=g)
    y = torch.randint(0, 4, (n_server,), generator=g)
    server = ServerData(ArrayDataset(x.numpy(), y.numpy(), 4), in_domain, torch.device("cpu"),
                        "" if in_domain else "digits")
    updates = [Update(c, 0, 0.01 * torch.randn(spec.numel, generator=g), n)
               for c, n in ((3, 17), (0, 5), (1, 30))]
    return model, spec, server, updates


def started(strategy, model, spec, updates):
    strategy.initialize(spec.flatten(model), spec, copy.deepcopy(model))
    for u in updates:
        strategy.receive(u)
    strategy.close_round()
    return strategy


def fedavg_of(model, spec, updates) -> torch.Tensor:
    s = started(FedAvg(), model, spec, updates)
    s.step()
    return s.params


def trained(model, spec, flat, server, recipe, seed) -> torch.Tensor:
    """What train() makes of `flat` on the server's data, by hand."""
    m = copy.deepcopy(model)
    spec.load_into(m, flat)
    train(m, server.data, recipe, seed)
    return spec.flatten(m)


def test_center_ignores_client_updates_and_lowers_the_server_loss():
    model, spec, server, updates = setup()
    kw = dict(server_train_lr=0.05, server_train_epochs=3, recipe=RECIPE, seed=2)
    with_updates = started(Center(**kw), model, spec, updates)
    without = started(Center(**kw), model, spec, [])
    omega = with_updates.params.clone()
    assert with_updates.ready() and without.ready()  # a step does not wait for clients
    metrics = stepped(with_updates, server)
    stepped(without, server)
    a, b = with_updates.params, without.params
    assert torch.equal(a, b) and with_updates.version == 1
    assert metrics["ignored-updates"] == 3 and with_updates.ignored == 0  # counted per step
    expected = trained(model, spec, omega, server, LocalRecipe(3, 8, 0.05, "sgd", 0.9), server_seed(2, 0))
    assert torch.equal(a, expected)
    m = copy.deepcopy(model)
    before = evaluate(m, server.data)["loss"]
    spec.load_into(m, a)
    assert evaluate(m, server.data)["loss"] < before


def test_fedft_is_fedavg_then_exactly_train_on_the_server_data():
    model, spec, server, updates = setup()
    s = started(FedFT(server_train_lr=0.01, server_train_epochs=2, recipe=RECIPE, seed=7), model, spec, updates)
    metrics = stepped(s, server)
    got = s.params
    merged = fedavg_of(model, spec, updates)
    recipe = LocalRecipe(2, RECIPE.batch_size, 0.01, RECIPE.optimizer, RECIPE.momentum)
    assert torch.equal(got, trained(model, spec, merged, server, recipe, server_seed(7, 0)))
    assert not torch.equal(got, merged) and s.version == 1
    assert metrics["updates"] == 3 and "server-train-loss" in metrics
    assert not s.ready()  # the step's updates are consumed


def test_hfcl_is_fedavg_over_the_clients_and_the_server_as_one_more_client():
    model, spec, server, updates = setup()
    s = started(HFCL(recipe=RECIPE, seed=3), model, spec, updates)
    omega = s.params.clone()
    metrics = stepped(s, server)
    got = s.params
    delta_s = trained(model, spec, omega, server, RECIPE, server_seed(3, 0)) - omega  # the clients' recipe
    # Hand computation: Σ n_j Δ_j / Σ n_j with the server's n = |D_S| = 40, in FedAvg's float32 weights.
    everyone = [Update(-1, 0, delta_s, len(server)), *sorted(updates, key=lambda u: u.client)]
    total = sum(u.num_examples for u in everyone)
    expected = omega + sum((u.num_examples / total) * u.delta for u in everyone)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # ...and exactly FedAvg given the server's update as one more reply.
    assert torch.equal(got, fedavg_of(model, spec, [*updates, Update(-1, 0, delta_s, len(server))]))
    assert s.version == 1 and metrics["updates"] == 3


@pytest.mark.parametrize("cls", [Center, FedFT, HFCL])
def test_out_of_domain_or_missing_server_data_is_a_clear_error(cls):
    model, spec, server, updates = setup(in_domain=False)
    s = started(cls(recipe=RECIPE), model, spec, updates)
    with pytest.raises(ConfigError, match=f"'server-dataset' = 'digits' .*in-domain.*strategy '{cls.name}'"):
        s.attach(server)
    with pytest.raises(ConfigError, match=f"'central-size' = 0 .*strategy '{cls.name}'"):
        s.attach(None)
    assert s.server is None and s.version == 0 and torch.equal(s.params, spec.flatten(model))  # nothing moved


def test_train_on_server_returns_cpu_params_and_is_deterministic():
    model, spec, server, _ = setup()
    flat = spec.flatten(model)
    a, stats = train_on_server(copy.deepcopy(model), spec, flat, server, RECIPE, 11)
    b, _ = train_on_server(copy.deepcopy(model), spec, flat, server, RECIPE, 11)
    assert a.device.type == "cpu" and torch.equal(a, b) and not torch.equal(a, flat)
    assert set(stats) == {"train-loss", "train-accuracy"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_train_on_server_on_cuda_matches_cpu_closely(monkeypatch):
    # cuDNN's convolutions default to TF32 (10-bit mantissa) on Ampere and later: on an H200 that alone put 12 % of
    # the weights more than 1e-4 apart after these 10 SGD steps. The comparison is of the code path, in fp32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model, spec, server, _ = setup()
    flat = spec.flatten(model)
    cpu, _ = train_on_server(copy.deepcopy(model), spec, flat, server, RECIPE, 11)
    gpu_server = ServerData(server.data, True, torch.device("cuda"))
    gpu, _ = train_on_server(copy.deepcopy(model), spec, flat, gpu_server, RECIPE, 11)
    assert gpu.device.type == "cpu"
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name,cls", [("center", Center), ("fedft", FedFT), ("hfcl", HFCL)])
def test_built_from_a_run_config(name, cls):
    assert STRATEGIES[name] is cls
    schedule = {"server-train-lr": 1e-4, "server-train-epochs": 10} if cls is not HFCL else {}  # HFCL has none
    cfg = load_config({"strategy": name, **schedule, "lr": 0.02, "seed": 4})
    s = build_strategy(cfg.strategy, cfg.options, seed=cfg.seed, recipe=part_of(LocalRecipe, cfg))
    assert isinstance(s, cls) and s.seed == 4 and s.recipe.lr == 0.02
    if cls is not HFCL:
        assert (s.config.server_train_lr, s.config.server_train_epochs) == (1e-4, 10)
        assert s.describe()["server-train-epochs"] == 10
    else:
        assert s.describe() == {"strategy": "hfcl", "aggregation": "mean", "trim-fraction": 0.1,  # FedAvg's defences
                                "update-norm-bound": 0.0, "update-norm-multiple": 0.0}
