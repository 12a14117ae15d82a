"""FedMerge's baselines that need no new math: Local (no federation) and FedAvg+ (FedAvg, then local
fine-tuning before each personalised evaluation), checked against what each client should hold."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from common.config import part_of
from common.models import build_from_config
from common.params import ParamSpec
from common.splits import client_partition, data_spec
from common.training import EVAL_STREAM, LocalRecipe, derive_seed, evaluate, train
from hybridfl.engine.inprocess import run_inprocess
from server_app.checkpoint import read_strategy_state
from server_app.config import load_config
from strategies import Local
from strategies.base import Update
from strategies.fedem import evaluate_mixture

JOB = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 4, "local-epochs": 1,
       "batch-size": 16, "partitioner": "clusters", "num-clusters": 2, "client-test-fraction": 0.25,
       "eval-every": 2, "checkpoint-every": 4}


def test_local_keeps_each_clients_own_model_and_shares_nothing():
    s = Local(num_clients=3)
    init = torch.zeros(4)
    s.initialize(init, ParamSpec(("w",), ((4,),)))
    first = s.model_for(0)
    s.receive(Update(0, 0, torch.ones(4), 5, sent=first))
    s.close_round()
    s.step()
    assert torch.equal(s.model_for(0).params, torch.ones(4))
    assert torch.equal(s.model_for(1).params, init) and torch.equal(s.params, init)
    s.receive(Update(0, 1, torch.full((4,), 2.0), 5, sent=s.model_for(0)))
    s.close_round()
    s.step()
    assert torch.equal(s.model_for(0).params, torch.full((4,), 3.0))


def clients_and_model(out, job):
    cfg = load_config(job)
    model = build_from_config(cfg.to_dict(), (1, 8, 8), 4, seed=0)
    return cfg, model, ParamSpec.of(model), json.loads((out / "clients.jsonl").read_text().splitlines()[-1])


def test_local_clients_are_evaluated_with_their_own_models(tmp_path):
    job = {**JOB, "strategy": "local", "output-dir": str(tmp_path), "run-name": "local"}
    out = run_inprocess(job)
    cfg, model, spec, last = clients_and_model(out, job)
    local = read_strategy_state(out)["local"]
    assert len(local) == 4
    for c in range(4):
        spec.load_into(model, local[c])
        result = evaluate(model, client_partition(data_spec(cfg), c, "test"), seed=cfg.seed)
        assert result["loss"] == pytest.approx(last["eval-loss"][c], rel=1e-5)


def test_fedavg_plus_fine_tunes_the_global_model_on_each_client_before_evaluating(tmp_path):
    job = {**JOB, "strategy": "fedavg-plus", "finetune-epochs": 2, "output-dir": str(tmp_path), "run-name": "plus"}
    out = run_inprocess(job)
    cfg, model, spec, last = clients_and_model(out, job)
    state = read_strategy_state(out)
    recipe = dataclasses.replace(part_of(LocalRecipe, cfg), local_epochs=2)
    tuned = []
    for c in range(4):
        spec.load_into(model, state["params"])
        plain = evaluate(model, client_partition(data_spec(cfg), c, "test"), seed=cfg.seed)["loss"]
        train(model, client_partition(data_spec(cfg), c), recipe, seed=derive_seed(cfg.seed, EVAL_STREAM, c, 4))
        tuned.append(evaluate(model, client_partition(data_spec(cfg), c, "test"), seed=cfg.seed)["loss"])
        assert tuned[c] == pytest.approx(last["eval-loss"][c], rel=1e-5) and tuned[c] != pytest.approx(plain)


def test_ifca_clients_evaluate_the_cluster_model_of_lowest_training_loss(tmp_path):
    job = {**JOB, "strategy": "ifca", "global-models": 3, "output-dir": str(tmp_path), "run-name": "ifca"}
    out = run_inprocess(job)
    cfg, model, spec, last = clients_and_model(out, job)
    theta = read_strategy_state(out)["theta"]
    picks = set()
    for c in range(4):
        train_losses = []
        for t in theta:
            spec.load_into(model, t)
            train_losses.append(evaluate(model, client_partition(data_spec(cfg), c), seed=cfg.seed)["loss"])
        best = min(range(3), key=train_losses.__getitem__)
        picks.add(best)
        spec.load_into(model, theta[best])
        result = evaluate(model, client_partition(data_spec(cfg), c, "test"), seed=cfg.seed)
        assert result["loss"] == pytest.approx(last["eval-loss"][c], rel=1e-5)
    assert picks != {0}  # some client evaluates a model other than the message's own


def test_fedem_clients_evaluate_their_mixture(tmp_path):
    job = {**JOB, "strategy": "fedem", "global-models": 2, "output-dir": str(tmp_path), "run-name": "fedem"}
    out = run_inprocess(job)
    cfg, model, spec, last = clients_and_model(out, job)
    state = read_strategy_state(out)
    for c in range(4):
        mixed = evaluate_mixture(model, spec, state["theta"], state["pi"][c],
                                 client_partition(data_spec(cfg), c, "test"), seed=cfg.seed)
        assert mixed["loss"] == pytest.approx(last["eval-loss"][c], rel=1e-5)
    assert torch.allclose(torch.tensor(last["mixture"]), state["pi"])
    assert not torch.allclose(state["pi"], torch.full_like(state["pi"], 0.5))  # the clients' π moved
