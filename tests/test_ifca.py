"""IFCA: the client's cluster estimate (Alg. 1, line 6) and the server's per-cluster averaging, by hand."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from client_app.app import app as client_app
from common.params import ParamSpec
from common.protocol import METRICS
from common.splits import ArrayDataset
from common.training import evaluate
from hybridfl.engine.inprocess import run_inprocess
from strategies import IFCA
from strategies.base import Unusable, Update
from strategies.ifca import CANDIDATE, CANDIDATES, choose_candidate

MODEL = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
SPEC = ParamSpec.of(MODEL)


def test_the_client_trains_the_model_of_lowest_loss_on_its_own_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1, 2, 2, generator=gen)
    data = ArrayDataset(x.numpy(), (x.reshape(40, 4)[:, 0] > 0).long().numpy(), 2)
    wrong = torch.zeros(SPEC.numel)
    wrong[0], wrong[4] = 5.0, -5.0  # logits (5·x_0, −5·x_0): class 0 where the label is 1, and back
    candidates = torch.stack([torch.zeros(SPEC.numel), -wrong, wrong])  # chance, right, wrong
    SPEC.load_into(MODEL, candidates[0])
    chosen = choose_candidate(MODEL, SPEC, candidates[1:], data, seed=0)
    losses = []
    for c in candidates:
        SPEC.load_into(MODEL, c)
        losses.append(evaluate(MODEL, data)["loss"])
    assert chosen == min(range(3), key=losses.__getitem__) == 1
    SPEC.load_into(MODEL, candidates[2])
    assert choose_candidate(MODEL, SPEC, None, data, seed=0) == 0  # no candidates: keep the model
    assert torch.equal(SPEC.flatten(MODEL), candidates[2])


def test_each_cluster_averages_the_updates_of_the_clients_that_chose_it():
    s = IFCA(global_models=3, num_clients=4)
    s.initialize(SPEC.flatten(MODEL), SPEC, MODEL)
    theta0 = s.theta.clone()
    sent = s.model_for(0)
    assert torch.equal(sent.params, theta0[0]) and torch.equal(sent.arrays[CANDIDATES], theta0[1:])
    d = {c: torch.full((SPEC.numel,), float(c + 1)) for c in range(3)}
    for c, j, n in ((0, 2, 10), (1, 2, 30), (2, 0, 5)):
        u = Update(c, 0, d[c], n, metrics={CANDIDATE: float(j)}, sent=sent)
        s.check(u)
        s.receive(u)
    s.close_round()
    s.step()
    torch.testing.assert_close(s.theta[2], theta0[2] + 0.25 * d[0] + 0.75 * d[1])
    torch.testing.assert_close(s.theta[0], theta0[0] + d[2])
    assert torch.equal(s.theta[1], theta0[1])  # nobody chose it
    assert s.client_report() == {"cluster": [2, 2, 0, -1]}
    for bad in (3.0, -1.0, 0.5):
        with pytest.raises(Unusable, match="cluster index"):
            s.check(Update(0, 1, d[0], 1, metrics={CANDIDATE: bad}, sent=sent))


def test_a_reply_naming_no_cluster_is_rejected_and_counted_while_the_run_goes_on(tmp_path):
    lying = ClientApp()

    @lying.train()
    def train(msg: Message, context: Context) -> Message:
        reply = client_app(msg, context)
        if context.node_config["partition-id"] == 1:
            reply.content[METRICS][CANDIDATE] = 9
        return reply

    for kind in ("evaluate", "query"):
        getattr(lying, kind)()(lambda msg, context: client_app(msg, context))
    out = run_inprocess({"dataset": "synthetic", "num-clients": 3, "clients-per-round": 3, "num-rounds": 2,
                         "local-epochs": 1, "batch-size": 16, "strategy": "ifca", "global-models": 2,
                         "output-dir": str(tmp_path), "run-name": "ifca"}, client_app=lying)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total-rejected"] == 2 and summary["total-accepted"] == 4
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert {e["client"] for e in events if e["outcome"] == "rejected"} == {1}
    assert all("cluster index" in e["reason"] for e in events if e["outcome"] == "rejected")
