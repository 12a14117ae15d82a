"""The one training loop, evaluation order, and client objectives (chosen by the train message)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from torch import nn
from torch.nn import functional as F

from client_app.app import app as client_app
from common.models import build_from_config
from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.protocol import ARRAYS, TRAIN_SEED
from common.splits import ArrayDataset, load_dataset
from common.training import evaluate, predict, run_epochs
from hybridfl.engine.inprocess import InProcessGrid
from server_app.config import client_config, load_config


class BatchRecorder(nn.Module):
    """Predicts class 0 for everything and records the labels (encoded in x) of every batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.batches: list[set[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append({int(v) for v in x.reshape(len(x), -1)[:, 0]})
        return torch.zeros(len(x), 4) + self.w


def test_evaluation_batches_do_not_follow_a_class_sorted_split():
    """Animal-MNIST's test split is stored class by class; with batch statistics a one-class batch would leak
    its label into the predictions. Batches are formed in a seeded shuffle, and the results stay in order."""
    y = np.repeat(np.arange(4), 600)
    data = ArrayDataset(y.astype(np.float32).reshape(-1, 1, 1, 1), y.astype(np.int64), 4)
    model = BatchRecorder()
    result = evaluate(model, data, batch_size=1024, seed=0)
    assert len(model.batches) == 3 and all(batch == {0, 1, 2, 3} for batch in model.batches)
    assert result["accuracy"] == pytest.approx(0.25)
    x = torch.randn(50, 3)
    lin = nn.Linear(3, 4)
    torch.testing.assert_close(predict(lin, x, batch_size=7, seed=3), lin(x), rtol=1e-6, atol=1e-6)


def test_the_loop_is_seeded_and_skips_a_lone_trailing_sample():
    def batches(n: int, seed: int) -> list[list[int]]:
        w, seen = nn.Parameter(torch.zeros(1)), []
        run_epochs(torch.optim.SGD([w], lr=0.1), n, 4, 2, seed, lambda idx: seen.append(idx.tolist()) or w.sum())
        return seen

    assert batches(10, 1) == batches(10, 1) != batches(10, 2)
    assert [len(b) for b in batches(9, 1)] == [4, 4, 4, 4]  # the ninth sample alone is skipped, per epoch
    assert sorted(i for b in batches(8, 1)[:2] for i in b) == list(range(8))  # an epoch sees every sample once


def test_proximal_objective_adds_mu_times_the_drift_to_the_gradient():
    model = nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # drifted from what it received
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    plain = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    for mu in (0.0, 0.3):
        loss = build_loss("proximal", {"proximal-mu": mu}, Received(model, start))
        grads = torch.autograd.grad(loss(x, y, model(x)), list(model.parameters()))
        for g, g0, w, w0 in zip(grads, plain, model.parameters(), start):
            torch.testing.assert_close(g, g0 + mu * (w - w0))
    with pytest.raises(KeyError, match="unknown client objective 'hinge'"):
        build_loss("hinge", {}, Received(model, start))


def test_the_client_trains_with_the_objective_its_message_names():
    cfg = load_config({"dataset": "synthetic", "num-clients": 2, "clients-per-round": 2, "local-epochs": 3,
                       "lr": 0.1})
    full = load_dataset("synthetic")
    model = build_from_config(cfg.to_dict(), (1, 8, 8), full.num_classes, seed=0)
    pspec = ParamSpec.of(model)
    grid = InProcessGrid(client_app, num_nodes=2)
    node = next(iter(grid.get_node_ids()))

    def delta_norm(objective: str, mu: float) -> float:
        config = ConfigRecord({**client_config(cfg), "local-objective": objective, "proximal-mu": mu,
                               "version": 0, TRAIN_SEED: 5})
        msg = Message(RecordDict({ARRAYS: pspec.to_record(pspec.flatten(model)), "config": config}),
                      dst_node_id=node, message_type="train")
        (reply,) = grid.send_and_receive([msg])
        assert not reply.has_error(), reply.error
        return float(pspec.from_record(reply.content[ARRAYS]).norm())

    plain = delta_norm("cross-entropy", 0.0)
    no_pull, strong_pull = delta_norm("proximal", 0.0), delta_norm("proximal", 5.0)
    assert plain == pytest.approx(no_pull, rel=1e-6) and strong_pull < 0.5 * plain
