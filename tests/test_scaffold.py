"""SCAFFOLD (the worked example of docs/adding-a-method.md) against Algorithm 1 of its paper, by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.training import LocalRecipe, local_steps, run_epochs
from strategies import Scaffold
from strategies.base import Update

SPEC = ParamSpec(("w",), ((5,),))
RECIPE = LocalRecipe(local_epochs=2, batch_size=4, lr=0.1, optimizer="sgd", momentum=0.0)


def vec(seed: int) -> torch.Tensor:
    return torch.randn(5, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,batch,epochs", [(10, 4, 2), (9, 4, 1), (8, 4, 3), (1, 4, 2), (4, 4, 1), (5, 2, 1)])
def test_local_steps_counts_the_steps_the_training_loop_takes(n, batch, epochs):
    w = nn.Parameter(torch.zeros(1))
    steps = []
    run_epochs(torch.optim.SGD([w], lr=0.1), n, batch, epochs, seed=0,
               batch_loss=lambda idx: steps.append(1) or w.sum())
    assert local_steps(n, batch, epochs) == len(steps)


def test_the_client_objective_adds_the_correction_to_every_gradient():
    model = nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    correction = torch.arange(8, dtype=torch.float32)  # c − c_i, flat in the parameters' order
    loss = build_loss("scaffold", {}, Received(model, start, {"correction": correction}))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    grads = torch.autograd.grad(loss(x, y, model(x)), list(model.parameters()))
    plain = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]),
                               torch.cat([g.reshape(-1) for g in plain]) + correction)


def test_a_round_updates_the_model_and_the_control_variates_as_algorithm_1():
    s = Scaffold(server_lr=0.5, num_clients=4, recipe=RECIPE)
    s.initialize(vec(0), SPEC)
    # Round 1: no control variates yet, clients 0 and 2 (10 and 9 examples: K = 6 and 6 steps).
    sent = {c: s.model_for(c) for c in (0, 2)}
    assert all(torch.equal(p.arrays["correction"], torch.zeros(5)) for p in sent.values())
    assert Scaffold.client_side.objective == "scaffold"
    x0, d = s.params.clone(), {0: vec(10), 2: vec(12)}
    for c, n in ((0, 10), (2, 9)):
        s.receive(Update(c, 0, d[c], n, sent=sent[c]))
    s.close_round()
    s.step()
    c_plus = {c: -d[c] / (local_steps(n, 4, 2) * 0.1) for c, n in ((0, 10), (2, 9))}  # option II, c = c_i = 0
    torch.testing.assert_close(s.params, x0 + 0.5 / 2 * (d[0] + d[2]))
    torch.testing.assert_close(s.c, (c_plus[0] + c_plus[2]) / 4)  # c ← c + |S|/N · mean(Δc_i)
    torch.testing.assert_close(s.c_i[0], c_plus[0])
    # Round 2: client 0 gets c − c_0; its new control variate uses what it was sent.
    payload, c1, x1 = s.model_for(0), s.c.clone(), s.params.clone()
    torch.testing.assert_close(payload.arrays["correction"], c1 - c_plus[0])
    s.receive(Update(0, 1, vec(20), 10, sent=payload))
    s.close_round()
    s.step()
    new_c0 = c_plus[0] - c1 + (-vec(20)) / (local_steps(10, 4, 2) * 0.1)  # c_i − c + (x − y_i) / (K η_l)
    torch.testing.assert_close(s.c_i[0], new_c0)
    torch.testing.assert_close(s.c, c1 + (new_c0 - c_plus[0]) / 4)
    torch.testing.assert_close(s.params, x1 + 0.5 * vec(20))


def test_it_needs_the_clients_recipe_and_their_number():
    with pytest.raises(ValueError, match="num_clients"):
        Scaffold(recipe=RECIPE)
    with pytest.raises(ValueError, match="recipe"):
        Scaffold(num_clients=3)


def test_on_heterogeneous_quadratics_scaffold_reaches_the_optimum_where_fedavg_drifts():
    """f_i(w) = h_i/2 (w − a_i)²: with K local steps FedAvg's fixed point is biased toward the flatter client;
    SCAFFOLD's control variates remove the drift (the paper's motivation), so it converges to Σ h_i a_i / Σ h_i."""
    h, a, lr, k = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0]), 0.1, 5
    recipe = LocalRecipe(local_epochs=k, batch_size=4, lr=lr, optimizer="sgd", momentum=0.0)  # 4 examples: K = 5 steps
    spec = ParamSpec(("w",), ((1,),))

    def local(x: torch.Tensor, i: int, correction: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        for _ in range(k):
            y = y - lr * (h[i] * (y - a[i]) + correction)
        return y - x

    final = {}
    for name, corrected in (("scaffold", True), ("fedavg", False)):
        s = Scaffold(server_lr=1.0, num_clients=2, recipe=recipe)
        s.initialize(torch.zeros(1), spec)
        for _ in range(300):
            for i in (0, 1):
                payload = s.model_for(i)
                correction = payload.arrays["correction"] if corrected else torch.zeros(1)
                s.receive(Update(i, s.version, local(s.params, i, correction), 4, sent=payload))
            s.close_round()
            s.step()
        final[name] = float(s.params)
    optimum = float((h * a).sum() / h.sum())  # 0.75
    assert final["scaffold"] == pytest.approx(optimum, abs=1e-5)
    assert abs(final["fedavg"] - optimum) > 0.05  # FedAvg's drift (≈ 0.67 here)
