"""FedEM: the client's E-step, M-step and weighted component updates, its mixture prediction, and the
server's per-component averaging, by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from common.params import ParamSpec
from common.splits import ArrayDataset
from common.training import LocalRecipe, evaluate
from strategies import FedEM
from strategies.base import Unusable, Update
from strategies.fedem import COMPONENT_DELTAS, COMPONENTS, MIXTURE, evaluate_mixture, train_mixture

MODEL = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
SPEC = ParamSpec.of(MODEL)
RECIPE = LocalRecipe(local_epochs=2, batch_size=8, lr=0.1, optimizer="sgd", momentum=0.0)


def data(seed: int = 0, n: int = 30) -> ArrayDataset:
    gen = torch.Generator().manual_seed(seed)
    return ArrayDataset(torch.randn(n, 1, 2, 2, generator=gen).numpy(),
                        torch.randint(0, 3, (n,), generator=gen).numpy(), 3)


def components(M: int = 3) -> torch.Tensor:
    return torch.randn(M, SPEC.numel, generator=torch.Generator().manual_seed(5))


def test_the_local_update_is_the_e_step_the_m_step_and_responsibility_weighted_training():
    d, theta, pi = data(), components(), torch.tensor([0.5, 0.3, 0.2])
    x, y = torch.from_numpy(d.x), torch.from_numpy(d.y)
    losses = []
    for t in theta:
        SPEC.load_into(MODEL, t)
        losses.append(F.cross_entropy(MODEL(x), y, reduction="none").detach())
    q = torch.softmax(pi.log()[:, None] - torch.stack(losses), 0)
    trained, new_pi, metrics = train_mixture(MODEL, SPEC, theta, pi, d, RECIPE, seed=3)
    torch.testing.assert_close(new_pi, q.mean(1))  # M-step: π_m = mean_i q(z_i = m)
    likelihood = (pi[:, None] * torch.exp(-torch.stack(losses))).sum(0)
    assert metrics["train-loss"] == pytest.approx(float(-likelihood.log().mean()), rel=1e-5)
    assert not torch.equal(trained, theta)
    # a component with π_m = 0 has q = 0 everywhere: its weighted loss has no gradient, it is returned as sent
    trained, new_pi, _ = train_mixture(MODEL, SPEC, theta, torch.tensor([1.0, 0.0, 0.0]), d, RECIPE, seed=3)
    assert torch.equal(trained[1:], theta[1:]) and not torch.equal(trained[0], theta[0])
    assert new_pi.tolist() == [1.0, 0.0, 0.0]


def test_the_mixture_predicts_with_the_clients_weights():
    d, theta = data(1), components()
    SPEC.load_into(MODEL, theta[1])
    alone = evaluate(MODEL, d)
    mixed = evaluate_mixture(MODEL, SPEC, theta, torch.tensor([0.0, 1.0, 0.0]), d)
    assert mixed["accuracy"] == alone["accuracy"] and mixed["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    half = evaluate_mixture(MODEL, SPEC, theta, torch.tensor([0.5, 0.5, 0.0]), d)
    x, y = torch.from_numpy(d.x), torch.from_numpy(d.y)
    probs = 0.0
    for t in theta[:2]:
        SPEC.load_into(MODEL, t)
        probs = probs + 0.5 * torch.softmax(MODEL(x), 1).detach()
    assert half["loss"] == pytest.approx(float(-probs[torch.arange(len(y)), y].log().mean()), rel=1e-5)


def test_the_server_averages_every_component_and_keeps_each_clients_weights():
    s = FedEM(global_models=3, num_clients=4)
    s.initialize(SPEC.flatten(MODEL), SPEC, MODEL)
    theta0 = s.theta.clone()
    sent = s.model_for(2)
    assert torch.equal(sent.params, theta0[0]) and torch.equal(sent.arrays[COMPONENTS], theta0[1:].reshape(-1))
    assert torch.equal(sent.arrays[MIXTURE], torch.full((3,), 1 / 3))
    P = SPEC.numel
    deltas = {c: torch.arange(3 * P, dtype=torch.float32).reshape(3, P) * (c + 1) for c in (0, 2)}
    pis = {0: torch.tensor([0.7, 0.2, 0.1]), 2: torch.tensor([0.1, 0.1, 0.8])}
    for c, n in ((2, 30), (0, 10)):
        u = Update(c, 0, deltas[c][0], n, arrays={COMPONENT_DELTAS: deltas[c][1:].reshape(-1), MIXTURE: pis[c]},
                   sent=sent)
        s.check(u)
        s.receive(u)
    s.close_round()
    s.step()
    torch.testing.assert_close(s.theta, theta0 + 0.25 * deltas[0] + 0.75 * deltas[2])
    assert torch.equal(s.pi[0], pis[0]) and torch.equal(s.pi[2], pis[2])
    assert torch.equal(s.pi[1], torch.full((3,), 1 / 3))
    bad = {"no mixture": {COMPONENT_DELTAS: deltas[0][1:].reshape(-1)},
           "not summing to 1": {COMPONENT_DELTAS: deltas[0][1:].reshape(-1), MIXTURE: torch.tensor([0.5, 0.2, 0.1])},
           "short deltas": {COMPONENT_DELTAS: deltas[0][1], MIXTURE: pis[0]}}
    for arrays in bad.values():
        with pytest.raises(Unusable):
            s.check(Update(0, 1, deltas[0][0], 10, arrays=arrays, sent=sent))
