"""Feddle's pieces against the paper: projection (Eq. 16-17), search (Eq. 6/11), fallback, atlas, OOD head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import stepped
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from common.config import ConfigError
from common.models import build_model
from common.params import ParamSpec
from common.server_data import ServerData
from common.splits import ArrayDataset
from strategies import FedBuff, Feddle
from strategies.base import Update
from strategies.feddle import median_normalize


def server(x: torch.Tensor, y: torch.Tensor, in_domain: bool = True) -> ServerData:
    return ServerData(ArrayDataset(x.numpy(), y.numpy(), int(y.max()) + 1 if y.dtype == torch.int64 else 1),
                      in_domain, torch.device("cpu"), "" if in_domain else "digits")


def cnn_setup(n_anchors: int = 3, seed: int = 0):
    model = build_model("cnn", 1, 8, 4, seed=seed)
    spec = ParamSpec.of(model)
    g = torch.Generator().manual_seed(seed)
    anchors = [0.01 * torch.randn(spec.numel, generator=g) * (i + 1) for i in range(n_anchors)]
    x = torch.randn(40, 1, 8, 8, generator=g)
    y = torch.randint(0, 4, (40,), generator=g)
    return model, spec, anchors, x, y


def feddle_with(model, spec, anchors, cls=Feddle, **kw) -> Feddle:
    """Feddle after the given anchors arrived, its FedBuff buffer just full (buffer-size = their number)."""
    s = cls(**{"buffer_size": len(anchors), **kw})
    s.initialize(spec.flatten(model), spec, model)
    for i, a in enumerate(anchors):
        s.receive(Update(i, 0, a, 10))
    return s


def test_projected_gradient_equals_autograd_through_the_combination():
    model, spec, anchors, x, y = cnn_setup()
    s = feddle_with(model, spec, anchors)
    bar, _ = median_normalize(torch.stack(anchors))
    c = torch.tensor([0.3, -0.7, 1.1], requires_grad=True)
    omega = s.params.clone()
    projected = s.projected_grad(omega + c.detach() @ bar, bar, x, y, ood=False)
    flat = omega + c @ bar
    params = dict(zip(spec.names, (t.reshape(sh) for t, sh in zip(torch.split(flat, spec.sizes), spec.shapes))))
    model.eval()
    loss = F.cross_entropy(functional_call(model, params, (x,)), y)
    (autograd,) = torch.autograd.grad(loss, c)
    torch.testing.assert_close(projected, autograd, rtol=1e-4, atol=1e-6)


class RegressionFeddle(Feddle):
    """Feddle with a squared loss: the search then has a closed-form optimum."""

    criterion = staticmethod(F.mse_loss)


class Linear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_search_reaches_the_closed_form_best_combination_including_a_negative_coefficient():
    d, g = 6, torch.Generator().manual_seed(1)
    anchors = [torch.randn(d, generator=g) for _ in range(3)]
    c_star = torch.tensor([2.0, -1.5, 0.5])
    w_star = c_star @ torch.stack(anchors)
    x = torch.randn(200, d, generator=g)
    model = Linear(d)
    spec = ParamSpec.of(model)
    s = feddle_with(model, spec, anchors, RegressionFeddle, anchor_normalization=False, fallback_init=False,
                    server_epochs=400, search_lr=0.05, search_batch_size=200)
    found = stepped(s, server(x, x @ w_star))
    torch.testing.assert_close(s.params, w_star, rtol=0, atol=2e-3)  # ω = 0 + Σ ĉ a
    assert found["c-negative"] > 0 and found["loss-after"] < 1e-4 < found["loss-before"]
    assert s.scores == pytest.approx(c_star.abs().tolist(), abs=2e-3)


@pytest.mark.parametrize("fedbuff_keys", [
    {"buffer_size": 3, "server_lr": 0.5},
    {"buffer_size": 4, "server_lr": 0.8, "weighting": "examples", "staleness_weight": "polynomial",
     "staleness_exponent": 0.5},
])
def test_without_search_feddle_is_its_fallback_fedbuff_step_for_step(fedbuff_keys):
    """The fallback is FedBuff with the same keys: same steps at the same arrivals, same models, while the
    atlas (6 anchors) holds older updates outside FedBuff's buffer and evicts some."""
    model, spec, _, _, _ = cnn_setup()
    feddle, fedbuff = Feddle(server_epochs=0, atlas_size=6, **fedbuff_keys), FedBuff(**fedbuff_keys)
    feddle.initialize(spec.flatten(model), spec, model)
    fedbuff.initialize(spec.flatten(model), spec)
    g = torch.Generator().manual_seed(3)
    for n in range(23):
        base = max(0, fedbuff.version - int(torch.randint(0, 3, (1,), generator=g)))  # stale by 0-2 versions
        update = Update(n, base, 0.01 * torch.randn(spec.numel, generator=g), int(torch.randint(5, 50, (1,),
                                                                                                generator=g)))
        feddle.receive(update)
        fedbuff.receive(update)
        assert feddle.ready() == fedbuff.ready()
        if fedbuff.ready():
            feddle.step()  # no search: no server data needed
            fedbuff.step()
            torch.testing.assert_close(feddle.params, fedbuff.params, rtol=1e-5, atol=1e-7)
    assert feddle.version == fedbuff.version == 23 // fedbuff_keys["buffer_size"] and len(feddle.anchors) == 6


def test_searching_every_step_starts_from_the_mean_of_the_steps_arrivals():
    """search-every = step: one search per step that brought updates, never mid-step, from η_g × the mean of
    that step's updates (older anchors at 0), with more arrivals than buffer-size or fewer."""
    model, spec, _, _, _ = cnn_setup()
    feddle = Feddle(server_epochs=0, atlas_size=8, buffer_size=3, server_lr=0.7, search_every="step")
    feddle.initialize(spec.flatten(model), spec, model)
    g = torch.Generator().manual_seed(5)
    for arrivals in [2, 0, 5, 1, 4]:
        before = feddle.params.clone()
        deltas = [0.01 * torch.randn(spec.numel, generator=g) for _ in range(arrivals)]
        for n, delta in enumerate(deltas):
            feddle.receive(Update(n, feddle.version, delta, 10 + n))
            assert not feddle.ready()
        feddle.close_round()
        assert feddle.ready() == bool(arrivals)
        if arrivals:
            feddle.step()
            torch.testing.assert_close(feddle.params, before + 0.7 * torch.stack(deltas).mean(0), rtol=1e-5,
                                       atol=1e-7)
    assert feddle.version == 4 and len(feddle.anchors) == 8


def test_feddle_refuses_a_fallback_buffer_larger_than_its_atlas():
    with pytest.raises(ConfigError, match="'buffer-size' = 21 .*at most atlas-size \\(20\\)"):
        Feddle(buffer_size=21, atlas_size=20)


@pytest.mark.parametrize("in_domain", [True, False])
def test_search_without_diagnostics_moves_the_same_way_with_two_fewer_forward_passes(in_domain):
    model, spec, anchors, x, y = cnn_setup()
    results = {}
    for diagnostics in (True, False):
        s = feddle_with(model, spec, anchors, server_epochs=2, search_batch_size=20, search_lr=0.05,
                        search_diagnostics=diagnostics)
        calls, loss = [], s._loss
        s._loss = lambda *a: calls.append(1) or loss(*a)  # one forward pass over a batch or the whole data
        metrics = stepped(s, server(x, y, in_domain))
        results[diagnostics] = (s.params, metrics, len(calls))
    (with_p, with_m, with_calls), (without_p, without_m, without_calls) = results[True], results[False]
    torch.testing.assert_close(without_p, with_p, rtol=0, atol=0)
    assert {"loss-before", "loss-after"} <= set(with_m) and not {"loss-before", "loss-after"} & set(without_m)
    assert (with_calls, without_calls) == (2 * 2 + 2, 2 * 2)  # 2 epochs × 2 batches, + before and after


def test_median_normalisation():
    a = torch.stack([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([6.0, 8.0])])
    bar, norms = median_normalize(a)
    torch.testing.assert_close(norms, torch.tensor([1.0, 2.0, 10.0]))
    torch.testing.assert_close(bar.norm(dim=1), torch.full((3,), 2.0))
    torch.testing.assert_close(bar / bar.norm(dim=1, keepdim=True), a / norms.unsqueeze(1))  # directions kept


@pytest.mark.parametrize("importance", [True, False])
def test_eviction_replaces_the_least_important_anchor_and_new_ones_are_safe(importance):
    model, spec, anchors, x, y = cnn_setup(n_anchors=3)
    s = feddle_with(model, spec, anchors, atlas_size=3, server_epochs=0, importance_score=importance)
    stepped(s, server(x, y))
    s.scores = [0.5, 0.1, 0.9]  # as a search would have left them
    marks = [torch.full((spec.numel,), float(v)) for v in (7, 8)]
    s.receive(Update(7, 1, marks[0], 10))
    s.receive(Update(8, 1, marks[1], 10))  # same step: must not evict the just-arrived anchor
    kept = [int(a[0]) if float(a[0]) in (7.0, 8.0) else None for a in s.anchors]
    if importance:  # lowest |c| first: anchor 1 (0.1), then anchor 0 (0.5)
        assert kept == [8, 7, None]
    else:  # FIFO: oldest first
        assert kept == [7, 8, None]


def test_out_of_domain_head_is_fitted_first_then_frozen_while_c_moves(monkeypatch):
    model, spec, anchors, x, _ = cnn_setup()
    y_ood = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(5))  # its own 3 labels
    s = feddle_with(model, spec, anchors, server_epochs=3, search_lr=0.05, fallback_lambda=0.01)
    snapshots = {}
    fit = Feddle.fit_head

    def recording_fit(self, merged, xx, yy, seed):
        fit(self, merged, xx, yy, seed)
        snapshots["theta"] = [p.detach().clone() for p in self.theta.parameters()]

    monkeypatch.setattr(Feddle, "fit_head", recording_fit)
    omega = s.params.clone()
    bar, norms = median_normalize(torch.stack(anchors))
    c_prime = s.fallback(norms)
    stepped(s, server(x, y_ood, in_domain=False))
    assert s.theta.out_features == 3 and not any(p.requires_grad for p in s.theta.parameters())
    for before, after in zip(snapshots["theta"], s.theta.parameters()):
        assert torch.equal(before, after)  # frozen during the search
    c = torch.linalg.lstsq(bar.T, (s.params - omega).unsqueeze(1)).solution.squeeze(1)
    assert not torch.allclose(c, c_prime, atol=1e-4)  # the coefficients moved
    head = slice(spec.numel - sum(np.prod(sh) for sh in spec.shapes[-2:]), spec.numel)
    assert not torch.equal(s.params[head], omega[head])  # ...and the found c updates the whole model


def test_feddle_run_in_process_logs_and_plots_its_searches(small_run):
    import json

    out, summary = small_run("feddle", strategy="feddle", **{"central-size": 40, "server-epochs": 2,
                                                              "search-lr": 0.01, "num-rounds": 3,
                                                              "buffer-size": 2})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all({"c-min", "c-mean", "c-max", "c-negative", "loss-before", "loss-after", "search-seconds"} <= set(r)
               for r in rows)
    assert (out / "search.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["server-data"].startswith("40 in-domain samples")
    figure = Feddle.figures([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], [])
    searches = [st for r in rows for st in r["steps"]]
    coefficients, negative, loss = figure["search.png"].panels
    assert coefficients.lines["mean"] == ([st["version"] for st in searches], [st["c-mean"] for st in searches])
    assert negative.lines["negative"][1] == [st["c-negative"] for st in searches]
    assert loss.lines["loss-after"][1] == [st["loss-after"] for st in searches]
    assert len(searches) > len(rows)  # a round with two searches plots both (buffer-size 2), not its last one


def test_fine_tuning_after_the_search_is_fedft_server_pass_on_the_merged_model():
    """server-finetune-epochs: ω after Eq. 7, then the clients' recipe for E epochs at server-train-lr on the server
    data (train_on_server, seeded apart from the search); the step's model is exactly that, and it differs from
    the search alone."""
    import dataclasses

    from common.training import LocalRecipe, derive_seed, server_seed, train_on_server

    model, spec, anchors, x, y = cnn_setup()
    recipe = LocalRecipe(local_epochs=5, batch_size=16, lr=0.5, optimizer="adam")
    keys = {"server_epochs": 1, "search_batch_size": 20, "search_lr": 0.05}
    plain = feddle_with(model, spec, anchors, **keys)
    stepped(plain, server(x, y))
    tuned = feddle_with(model, spec, anchors, **keys, server_finetune_epochs=2, server_train_lr=1e-3)
    tuned.recipe = recipe
    metrics = stepped(tuned, server(x, y))
    finetune = dataclasses.replace(recipe, local_epochs=2, lr=1e-3)
    expected, _ = train_on_server(model, spec, plain.params, server(x, y), finetune, derive_seed(server_seed(0, 0), 1))
    torch.testing.assert_close(tuned.params, expected, rtol=0, atol=0)
    assert not torch.equal(tuned.params, plain.params) and "server-train-loss" in metrics


def test_fine_tuning_refuses_out_of_domain_server_data_at_start():
    model, spec, anchors, x, y = cnn_setup()
    s = feddle_with(model, spec, anchors, server_finetune_epochs=1)
    with pytest.raises(ConfigError, match="'server-dataset' = 'digits' .*strategy 'feddle'"):
        s.attach(server(x, y, in_domain=False))
    feddle_with(model, spec, anchors).attach(server(x, y, in_domain=False))  # the search alone takes OOD data


def test_step_length_fallback_keeps_the_searched_direction_at_fedbuffs_length():
    """step-length = fallback: the found step ĉ·ā rescaled to the ℓ2 length of FedBuff's c′·ā, in the search's
    direction, also where ĉ's signs cancel (Σĉ ≈ 0, which a rescaling of Σĉ to Σc′ blows up); a zero step
    gives c′ itself."""
    model, spec, anchors, x, y = cnn_setup()
    keys = {"server_epochs": 2, "search_batch_size": 20, "search_lr": 0.05, "server_lr": 0.3}
    searched = feddle_with(model, spec, anchors, **keys)
    start = searched.params.clone()
    stepped(searched, server(x, y))
    rescaled = feddle_with(model, spec, anchors, **keys, step_length="fallback")
    stepped(rescaled, server(x, y))
    bar, norms = median_normalize(torch.stack(anchors))
    fedbuff = feddle_with(model, spec, anchors, **keys).fallback(norms) @ bar  # before a step empties the buffer
    found, new = searched.params - start, rescaled.params - start
    torch.testing.assert_close(new.norm(), fedbuff.norm(), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(new, found * (fedbuff.norm() / found.norm()), rtol=1e-4, atol=1e-7)
    assert not torch.allclose(found.norm(), fedbuff.norm(), rtol=1e-2)  # the rescaling did something
    cancelling = feddle_with(model, spec, anchors, **keys, step_length="fallback")
    c_hat = torch.tensor([5.0, -5.0, 1e-6])  # Σĉ ≈ 0, a large step
    cancelling.search = lambda bar, c, c_prime, srv: (c_hat, {})
    stepped(cancelling, server(x, y))
    torch.testing.assert_close((cancelling.params - start).norm(), fedbuff.norm(), rtol=1e-4, atol=1e-7)
    zero = feddle_with(model, spec, anchors, **keys, step_length="fallback")
    zero.search = lambda bar, c, c_prime, srv: (torch.zeros_like(c), {})
    stepped(zero, server(x, y))
    torch.testing.assert_close(zero.params, start + fedbuff, rtol=1e-5, atol=1e-7)
