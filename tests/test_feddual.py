"""FedDUAL (strategies/feddual.py, the ``feddual`` client objective) against its paper's equations, its
reference code's behaviour, and FedAvg where the two must agree."""

from __future__ import annotations

import json

import numpy as np
import ot
import pytest
import torch
from helpers import digest
from scipy.stats import wasserstein_distance
from torch import nn
from torch.nn import functional as F

from common.config import ConfigError
from common.datasets import ArrayDataset
from common.models import build_from_config
from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.splits import load_dataset
from common.training import LocalRecipe, accuracy_of, evaluate, train
from hybridfl.engine.inprocess import run_inprocess
from server_app.config import load_config
from strategies import FedDual
from strategies.base import Unusable, Update
from strategies.feddual import (
    LOSS_GRADIENT,
    AdaptiveLoss,
    AdaptiveLossConfig,
    loss_gradient,
    w1,
    wasserstein_barycenter,
)

SPEC = ParamSpec(("body", "head.weight", "head.bias"), ((6,), (2, 3), (2,)))  # 14 numbers, 2 dynamic arrays
TINY = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "num-rounds": 3, "local-epochs": 1,
        "batch-size": 16, "optimizer": "adam", "lr": 0.01}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the Wasserstein distance and barycenter --------------------------------------------------------


def test_w1_is_the_sorted_difference_and_equals_pot_and_scipy():
    u = torch.randn(640, generator=gen(0), dtype=torch.float64)
    v = torch.randn(5, 640, generator=gen(1), dtype=torch.float64) * torch.arange(1, 6)[:, None]
    ours = w1(u, torch.sort(v, 1).values)
    closed = torch.stack([(torch.sort(u).values - torch.sort(row).values).abs().mean() for row in v])
    torch.testing.assert_close(ours, closed)
    torch.testing.assert_close(ours, ot.wasserstein_1d(u[:, None].expand(-1, 5), v.T, p=1))  # POT, column-wise
    np.testing.assert_allclose(ours.numpy(), [wasserstein_distance(u.numpy(), row) for row in v.numpy()])
    assert w1(u, torch.sort(u[torch.randperm(640, generator=gen(2))], 0).values[None]) == 0  # order-free


@pytest.mark.parametrize("stable", [True, False])
def test_the_barycenter_of_identical_vectors_is_that_vector(stable):
    v = torch.randn(50, generator=gen(3))
    bary, lam, underflow = wasserstein_barycenter(v.expand(4, -1), eps=1e-5, iters=150, stable=stable)
    torch.testing.assert_close(bary, v)
    torch.testing.assert_close(lam, torch.full((4,), 0.25, dtype=torch.float64))
    assert not underflow


def test_a_large_epsilon_gives_the_mean_and_a_small_one_picks_the_client_nearest_the_mean():
    v = torch.randn(5, 200, generator=gen(4)) * torch.tensor([1.0, 0.3, 2.0, 1.5, 0.8])[:, None]
    bary, lam, _ = wasserstein_barycenter(v, eps=1e9, iters=3)
    torch.testing.assert_close(bary, v.mean(0))
    torch.testing.assert_close(lam, torch.full((5,), 0.2, dtype=torch.float64))
    nearest = int(torch.argmin(w1(v.double().mean(0), torch.sort(v.double(), 1).values)))
    bary, lam, _ = wasserstein_barycenter(v, eps=1e-5, iters=150)
    assert int(lam.argmax()) == nearest and lam.max() > 0.999  # ε → 0: a medoid-like selection
    torch.testing.assert_close(bary, v[nearest])


def test_raw_exponentials_underflow_to_a_zero_barycenter_where_the_log_domain_does_not():
    """The reference code: exp(−W/ε) is exactly 0 in float64 once W/ε > ~745 for every client."""
    v = torch.randn(10, 640, generator=gen(5)) * 1e-2 * (1 + 0.3 * torch.arange(10))[:, None]
    bary, lam, underflow = wasserstein_barycenter(v, eps=1e-5, iters=150, stable=False)
    assert underflow and torch.equal(bary, torch.zeros(640)) and torch.equal(lam, torch.zeros(10, dtype=torch.float64))
    bary, lam, underflow = wasserstein_barycenter(v, eps=1e-5, iters=150, stable=True)
    assert not underflow and bary.abs().sum() > 0 and abs(float(lam.sum()) - 1) < 1e-9
    small = v * 1e-3  # every W well below 745 ε: no underflow in raw mode either
    bary, _, underflow = wasserstein_barycenter(small, eps=1e-5, iters=150, stable=False)
    assert not underflow and bary.abs().sum() > 0


# --- the server step -------------------------------------------------------------------------------


def strategy(**options) -> FedDual:
    s = FedDual(**options)
    s.initialize(torch.randn(SPEC.numel, generator=gen(6)), SPEC)
    return s


def round_of(s: FedDual, deltas: dict[int, torch.Tensor], examples: dict[int, int],
             arrays: dict[int, dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
    before = s.params.clone()
    for c in (2, 0, 1):  # arrival order must not matter
        u = Update(c, s.version, deltas[c], examples[c], arrays=(arrays or {}).get(c, {}), sent=s.model_for(c))
        s.check(u)
        s.receive(u)
    s.close_round()
    assert s.ready()
    s.step()
    return before


DELTAS = {c: 0.1 * torch.randn(SPEC.numel, generator=gen(10 + c)) for c in range(3)}
EXAMPLES = {0: 5, 1: 50, 2: 12}


def test_naive_arrays_are_the_clients_unweighted_mean_and_dynamic_ones_their_barycenter():
    s = strategy()
    theta = round_of(s, DELTAS, EXAMPLES)
    clients = torch.stack([theta + DELTAS[c] for c in range(3)])  # θ_k, synchronously
    torch.testing.assert_close(s.params[:6], clients[:, :6].mean(0))  # Alg. 1, line 22
    for part in (slice(6, 12), slice(12, 14)):  # each dynamic array on its own
        bary, _, _ = wasserstein_barycenter(torch.stack([DELTAS[c][part] for c in range(3)]), 1e-5, 150)
        torch.testing.assert_close(s.params[part], theta[part] + bary)
    assert s.version == 1


def test_with_no_dynamic_arrays_and_example_weights_the_step_is_fedavgs():
    from strategies import FedAvg

    s, f = strategy(dynamic_arrays=0, naive_weighting="examples"), FedAvg()
    f.initialize(s.params, SPEC)
    round_of(s, DELTAS, EXAMPLES)
    round_of(f, DELTAS, EXAMPLES)
    assert torch.equal(s.params, f.params)


def test_with_no_dynamic_arrays_and_example_weights_a_run_is_fedavgs_byte_for_byte(tmp_path):
    """Through the runtime too, asynchronously, with the adaptive loss on the clients of both."""
    common = {**TINY, "clients-per-round": 2, "delay-sigma": 1.0, "local-objective": "feddual",
              "output-dir": str(tmp_path)}
    a = run_inprocess({**common, "strategy": "feddual", "dynamic-arrays": 0, "naive-weighting": "examples",
                       "run-name": "feddual"})
    b = run_inprocess({**common, "strategy": "fedavg", "run-name": "fedavg"})
    assert digest(a / "model.pt") == digest(b / "model.pt")


def test_a_large_epsilon_makes_the_delta_barycenter_plain_averaging():
    s = strategy(wb_eps=1e9)
    theta = round_of(s, DELTAS, EXAMPLES)
    torch.testing.assert_close(s.params, theta + sum(DELTAS.values()) / 3)


def test_loss_gradient_mode_steps_the_dynamic_arrays_along_the_gradients_barycenter():
    s = strategy(dynamic_source="loss-gradient", wb_eps=1e9)  # ε large: the barycenter is the mean
    assert s.client_options() == {"dynamic-source": "loss-gradient", "dynamic-arrays": 2}
    grads = {c: torch.randn(8, generator=gen(20 + c)) for c in range(3)}
    theta = round_of(s, DELTAS, EXAMPLES, {c: {LOSS_GRADIENT: g} for c, g in grads.items()})
    torch.testing.assert_close(s.params[:6], theta[:6] + sum(d[:6] for d in DELTAS.values()) / 3)
    torch.testing.assert_close(s.params[6:], theta[6:] - sum(grads.values()) / 3)  # the trained head is discarded
    with pytest.raises(Unusable, match="loss-gradient"):
        s.check(Update(0, s.version, DELTAS[0], 5, sent=s.model_for(0)))
    with pytest.raises(Unusable, match="8 gradients"):
        s.check(Update(0, s.version, DELTAS[0], 5, arrays={LOSS_GRADIENT: torch.zeros(7)}, sent=s.model_for(0)))


def test_reference_mode_leaves_an_underflowed_array_unchanged_and_says_so():
    s = strategy(dynamic_source="loss-gradient", wb_stable=False, wb_iters=1000)
    grads = {c: torch.randn(8, generator=gen(30 + c)) * (1 + c) for c in range(3)}  # W ≫ 745 ε
    before = s.params.clone()
    for c in range(3):
        s.receive(Update(c, 0, DELTAS[c], EXAMPLES[c], arrays={LOSS_GRADIENT: grads[c]}, sent=s.model_for(c)))
    s.close_round()
    metrics = s.step()
    assert torch.equal(s.params[6:], before[6:]) and metrics["wb-underflow"] == 2
    assert not torch.equal(s.params[:6], before[:6])


def test_more_dynamic_arrays_than_the_model_has_fail_naming_the_key():
    with pytest.raises(ConfigError, match="dynamic-arrays"):
        strategy(dynamic_arrays=4)


# --- the client objective ------------------------------------------------------------------------


def client(seed: int = 0) -> tuple[nn.Module, ArrayDataset]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    x = torch.randn(40, 1, 2, 2, generator=gen(seed))
    y = torch.randint(0, 3, (40,), generator=gen(seed + 1))
    return model, ArrayDataset(x.numpy(), y.numpy(), 3)


def received(model: nn.Module, data: ArrayDataset) -> Received:
    return Received(model, [p.detach().clone() for p in model.parameters()], accuracy=accuracy_of(model, data))


def test_the_kl_term_is_the_papers_and_its_gradient_is_p_times_the_centred_drift():
    model, data = client()
    r = received(model, data)
    loss = AdaptiveLoss(r, AdaptiveLossConfig())
    assert float(loss.kl()) == 0  # KL(q ‖ q) at the received model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen(7)))
    a = torch.cat([p.reshape(-1) for p in model.parameters()]).detach()
    b = torch.cat([w.reshape(-1) for w in r.start])
    p, q = torch.softmax(a, 0), torch.softmax(b, 0)  # Eq. 6
    torch.testing.assert_close(loss.kl(), (p * (p.log() - q.log())).sum())  # Eq. 7: KL(p_local ‖ q_global)
    grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss.kl(), list(model.parameters()))])
    delta = a - b
    torch.testing.assert_close(grad, p * (delta - (p * delta).sum()))
    assert grad.abs().sum() > 0


def test_beta_zero_is_cross_entropy_and_reference_mode_is_half_of_it_with_no_kl_gradient():
    model, data = client()
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    with torch.no_grad():
        model[1].weight.add_(0.5)  # away from the received model: the KL term and its gradient are non-zero
    paper = build_loss("feddual", {}, received_with_start(model, data, shift=-0.5))
    paper.beta = 0.0
    assert torch.equal(paper(x, y, model(x)), F.cross_entropy(model(x), y))
    paper.beta = 0.5
    grads = torch.autograd.grad(paper(x, y, model(x)), list(model.parameters()))
    half_ce = torch.autograd.grad(0.5 * F.cross_entropy(model(x), y), list(model.parameters()))
    assert any(not torch.allclose(g, h) for g, h in zip(grads, half_ce))  # paper mode: the KL term pulls
    reference = build_loss("feddual", {"beta-mode": "reference"}, received_with_start(model, data, shift=-0.5))
    assert reference.beta == 0.5 and torch.equal(reference(x, y, model(x)), 0.5 * F.cross_entropy(model(x), y))


def received_with_start(model: nn.Module, data: ArrayDataset, shift: float) -> Received:
    start = [p.detach().clone() for p in model.parameters()]
    start[0] = start[0] + shift
    return Received(model, start, accuracy=accuracy_of(model, data))


def test_beta_follows_the_local_and_global_accuracies_epoch_by_epoch():
    model, data = client(3)
    global_acc = evaluate(model, data)["accuracy"]
    r = received(model, data)
    loss = build_loss("feddual", {}, r)
    seen = []
    orig = loss.epoch_end

    def spy() -> None:
        orig()
        seen.append((loss.a_local, loss.beta))

    loss.epoch_end = spy
    train(model, data, LocalRecipe(local_epochs=3, batch_size=8, lr=0.05, optimizer="adam"), seed=0, loss=loss)
    assert len(seen) == 3 and model.training
    assert r.metrics["feddual-a-global"] == global_acc
    for a_local, beta in seen:
        assert beta == pytest.approx(1 / (1 + np.exp(-(a_local - global_acc))))  # Eq. 9, accuracies as fractions
    assert seen[-1][0] == evaluate(model, data)["accuracy"] == r.metrics["feddual-a-local"]
    assert r.metrics["feddual-beta"] == pytest.approx((0.5 + seen[0][1] + seen[1][1]) / 3)  # the β trained with


def test_the_loss_gradient_is_autograd_of_the_summed_cross_entropy_over_all_local_data():
    model, data = client(4)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    ce = F.cross_entropy(model(x), y, reduction="sum")
    expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(ce, [model[1].weight, model[1].bias])])
    torch.testing.assert_close(loss_gradient(model, data, 2, batch_size=7), expected)
    torch.testing.assert_close(loss_gradient(model, data, 1), expected[-3:])


def test_a_reference_run_keeps_the_final_layer_at_its_initialisation(tmp_path):
    """The released code's behaviour end to end: loss gradients, raw exponentials, ε = 1e-5; every round
    underflows, the last layer never moves while the rest trains, and no reply is rejected."""
    out = run_inprocess({**TINY, "lr": 1e-3, "strategy": "feddual", "local-objective": "feddual",
                         "beta-mode": "reference",
                         "dynamic-source": "loss-gradient", "wb-stable": False, "output-dir": str(tmp_path),
                         "run-name": "reference"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["wb-underflow"] for r in rows] == [2, 2, 2] and all(r["rejected"] == 0 for r in rows)
    assert all(r["client-beta"] == 0.5 for r in rows)
    final = torch.load(out / "model.pt", weights_only=True)
    full = load_dataset("synthetic", "data")
    first = build_from_config(load_config(TINY).to_dict(), full.x.shape[1:], full.num_classes,
                              seed=0).state_dict()
    assert all(torch.equal(final[k], first[k]) for k in ("head.weight", "head.bias"))
    assert not torch.equal(final["body.0.weight"], first["body.0.weight"])
