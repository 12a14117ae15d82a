"""FedMerge against its paper (App. D's gradients) and the reference code's steps (spec §1.3), by hand."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import digest
from torch import nn

from common.config import ConfigError
from common.models import build_from_config
from common.params import ParamSpec
from common.splits import client_partition, data_spec
from common.training import evaluate
from hybridfl.engine.inprocess import run_inprocess
from server_app.checkpoint import read_strategy_state
from server_app.config import load_config
from strategies import FedMerge
from strategies.base import Update
from strategies.fedmerge import MAX_QUANTA, QUANTUM, line_search, logit_gradient

# A toy model: a 3 → 4 → 2 MLP (the head is the last Linear: 4·2 + 2 = 10 numbers).
MODEL = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
SPEC = ParamSpec.of(MODEL)
HEAD = 10


def rnd(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def built(d: int = 3, m: int = 5, **options) -> FedMerge:
    s = FedMerge(global_models=d, num_clients=m, seed=7, **options)
    s.initialize(SPEC.flatten(MODEL), SPEC, MODEL)
    return s


def one_step(s: FedMerge, clients: dict[int, int], seed: int = 0) -> tuple[dict[int, torch.Tensor], dict]:
    """Every client in `clients` (id -> examples) answers its payload with a random delta; one step (its
    deltas and metrics)."""
    deltas = {}
    for c, n in clients.items():
        sent = s.model_for(c)
        deltas[c] = 0.1 * rnd(seed + c, SPEC.numel)
        s.receive(Update(c, s.version, deltas[c], n, sent=sent))
    s.close_round()
    return deltas, s.step()


def test_the_global_models_start_apart_and_every_client_starts_from_their_uniform_merge():
    s = built(d=4)
    assert s.theta.shape == (4, SPEC.numel) and torch.equal(s.theta[0], SPEC.flatten(MODEL))
    assert all(not torch.allclose(s.theta[j], s.theta[k]) for j in range(4) for k in range(j))
    torch.testing.assert_close(s.model_for(3).params, s.theta.mean(0))
    again = built(d=4)  # the seed fixes the draws
    assert torch.equal(again.theta, s.theta)


def test_each_client_is_sent_its_own_merge_and_the_weights_and_heads_it_was_merged_from():
    s = built(d=3)
    s.logits[1] = torch.tensor([2.0, 0.0, -1.0])
    s.logits[2] = torch.tensor([-1.0, 0.5, 3.0])
    p1, p2 = s.model_for(1), s.model_for(2)
    w1 = torch.softmax(s.logits[1], 0)
    torch.testing.assert_close(p1.params, w1 @ s.theta)
    assert not torch.allclose(p1.params, p2.params)
    torch.testing.assert_close(p1.memo["weights"], w1)
    torch.testing.assert_close(p1.memo["heads"], s.theta[:, -HEAD:])
    assert p1.arrays == {}  # the merge weights and Θ never travel


def test_the_logit_gradient_is_autograd_through_the_softmax_merge():
    """App. D: ∂ℓ/∂a_ij = w_ij ⟨∂ℓ/∂θ_i, Θ_j − θ_i⟩ for θ_i = Σ_j softmax(a_i)_j Θ_j."""
    theta, a, x = rnd(1, 4, 6), rnd(2, 4).requires_grad_(True), rnd(3, 6)
    merged = (torch.softmax(a, 0) @ theta).detach().requires_grad_(True)
    loss = lambda t: torch.tanh(t @ x) ** 2 + (t**3).sum()
    (grad_theta,) = torch.autograd.grad(loss(merged), merged)
    (expected,) = torch.autograd.grad(loss(torch.softmax(a, 0) @ theta), a)
    torch.testing.assert_close(logit_gradient(torch.softmax(a, 0).detach(), theta, grad_theta), expected)


def test_a_gradient_logit_step_is_minus_lr_times_p_times_the_gradient_on_the_head():
    s = built(d=3, logit_step="gradient", merge_lr=0.5, head_arrays=2)
    s.logits[0] = torch.tensor([0.3, -0.2, 0.1])
    sent = s.model_for(0)
    heads, w = s.theta[:, -HEAD:].clone(), torch.softmax(s.logits[0], 0)
    delta = rnd(4, SPEC.numel)
    for c, n, payload, dl in ((0, 30, sent, delta), (4, 10, s.model_for(4), rnd(5, SPEC.numel))):
        s.receive(Update(c, 0, dl, n, sent=payload))
    s.close_round()
    s.step()
    # p_0 = 30/40, ∂ℓ/∂θ ≈ −Δθ, only the head's 10 numbers count
    torch.testing.assert_close(s.logits[0] - torch.tensor([0.3, -0.2, 0.1]),
                               -0.5 * 0.75 * w * ((heads - w @ heads) @ -delta[-HEAD:]))
    assert torch.equal(s.logits[1:4], torch.zeros(3, 3))  # clients without an update keep their rows


def test_the_line_search_moves_the_largest_logit_just_past_the_merge_lr():
    s = built(d=4, m=6)
    for step in range(5):
        before = s.logits.clone()
        quanta = one_step(s, {0: 20, 2: 5, 3: 11}, seed=10 * step)[1]["line-search-quanta"]
        change = float((s.logits - before).abs().max())
        assert 0.01 < change <= 0.01 * (1 + 1 / (quanta - 1)) + 1e-7  # n = ⌊1/M⌋ + 1: n·M·0.01 ≤ 0.01 + 0.01·M
    # the closed form against the code's loop (repeat A ← A − 0.01 P until max|ΔA| > lr)
    P = rnd(8, 3, 4) / 50
    moved, n = torch.zeros_like(P), 0
    while moved.abs().max() <= 0.01 and n <= 10000:
        moved, n = moved - QUANTUM * P, n + 1
    change, quanta = line_search(P, 0.01)
    assert quanta == n
    torch.testing.assert_close(change, moved)
    # a tiny gradient hits the iteration cap: the change stays under lr
    change, quanta = line_search(torch.full((2, 2), 1e-7), 0.01)
    assert quanta == MAX_QUANTA and float(change.abs().max()) < 0.01


def test_while_the_weights_are_uniform_the_global_models_move_together():
    """Algorithm 1's order: the Θ step uses the weights sent (uniform before any logit step), so every Θ_j
    gets the same update and Θ_j − Θ_k is unchanged (spec §1.2)."""
    s = built(d=3, merge_order="models-first")
    gaps = s.theta - s.theta[0]
    one_step(s, {0: 10, 1: 7, 4: 3})
    torch.testing.assert_close(s.theta - s.theta[0], gaps, atol=1e-6, rtol=0)
    assert not torch.equal(s.logits, torch.zeros_like(s.logits))  # ... and only then the logits move


def test_the_code_order_averages_each_model_over_its_new_weights():
    s = built(d=3)
    theta0 = s.theta.clone()
    deltas = one_step(s, {1: 10, 3: 30})[0]
    w = torch.softmax(s.logits[[1, 3]], 1).double()  # W′: after the logit step
    C = torch.tensor([[10.0], [30.0]], dtype=torch.float64) * w
    C = C / C.sum(0)
    expected = theta0 + C.T.float() @ torch.stack([deltas[1], deltas[3]])
    torch.testing.assert_close(s.theta, expected)
    plain = built(d=3, model_step="plain")
    deltas = one_step(plain, {1: 10, 3: 30})[0]
    w = torch.softmax(plain.logits[[1, 3]], 1)
    torch.testing.assert_close(plain.theta, theta0 + (torch.tensor([[0.25], [0.75]]) * w).T @ torch.stack(
        [deltas[1], deltas[3]]))  # Eq. 8: Σ_i p_i w_ij Δθ_i


def test_a_stale_update_is_pushed_back_through_the_merge_it_started_from():
    s = built(d=3, logit_step="gradient", merge_lr=1.0)
    old = s.model_for(2)  # dispatched at version 0: uniform weights, the first heads
    one_step(s, {0: 10, 1: 10})  # Θ and row 0, 1 move meanwhile
    s.logits[2] = torch.tensor([1.0, -1.0, 0.0])  # (as if row 2 had moved too)
    delta = rnd(9, SPEC.numel)
    s.receive(Update(2, 0, delta, 10, sent=old))
    s.close_round()
    before = s.logits[2].clone()
    s.step()
    w0 = torch.full((3,), 1 / 3)
    torch.testing.assert_close(s.logits[2] - before, -logit_gradient(w0, old.memo["heads"], -delta[-HEAD:]))


def test_one_global_model_is_fedavg_byte_for_byte(tmp_path):
    """d = 1: the merge is the model, A has no gradient, the column weights are n_i / Σ n: FedAvg, with the
    proximal term on as in the reproduction preset, partial participation, and stale updates."""
    job = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 4, "local-epochs": 1,
           "batch-size": 16, "local-objective": "proximal", "proximal-mu": 0.02, "delay-sigma": 1.0,
           "output-dir": str(tmp_path)}
    merge = run_inprocess({**job, "strategy": "fedmerge", "global-models": 1, "run-name": "fedmerge"})
    avg = run_inprocess({**job, "strategy": "fedavg", "run-name": "fedavg"})
    assert digest(merge / "model.pt") == digest(avg / "model.pt")


def test_bad_options_name_the_key():
    with pytest.raises(ConfigError, match="global-models"):
        FedMerge(global_models=0, num_clients=3)
    with pytest.raises(ConfigError, match="merge-order"):
        FedMerge(merge_order="sideways", num_clients=3)
    with pytest.raises(ValueError, match="num_clients"):
        FedMerge(global_models=2)


def test_every_client_is_evaluated_on_its_own_split_with_its_own_merged_model(tmp_path):
    """Personalised evaluation end to end (in-process): the accuracy and loss each client reported at the last
    step are those of softmax(A_i) · Θ — the strategy's state at that step — on that client's own test split."""
    job = {"dataset": "synthetic", "num-clients": 6, "clients-per-round": 4, "num-rounds": 4, "local-epochs": 1,
           "batch-size": 16, "strategy": "fedmerge", "global-models": 3, "partitioner": "clusters",
           "num-clusters": 2, "client-test-fraction": 0.25, "client-validation-fraction": 0.1, "eval-every": 2,
           "checkpoint-every": 4, "output-dir": str(tmp_path), "run-name": "fm"}
    out = run_inprocess(job)
    cfg = load_config(job)
    state = read_strategy_state(out)
    last = json.loads((out / "clients.jsonl").read_text().splitlines()[-1])
    assert last["round"] == 4 and last["clients"] == list(range(6))
    model = build_from_config(cfg.to_dict(), (1, 8, 8), 4, seed=0)
    spec = ParamSpec.of(model)
    for c in range(6):
        spec.load_into(model, torch.softmax(state["logits"][c], 0) @ state["theta"])
        result = evaluate(model, client_partition(data_spec(cfg), c, "test"), seed=cfg.seed)
        assert result["accuracy"] == last["eval-accuracy"][c]
        assert result["loss"] == pytest.approx(last["eval-loss"][c], rel=1e-5)
    torch.testing.assert_close(torch.tensor(last["merge-weights"]), torch.softmax(state["logits"], 1))
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["personal-accuracy"] == pytest.approx(sum(last["eval-accuracy"]) / 6)
    assert row["personal-accuracy-min"] == min(last["eval-accuracy"]) and row["personal-clients"] == 6
    summary = json.loads((out / "summary.json").read_text())
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = min((r for r in evals if "personal-val-loss" in r), key=lambda r: r["personal-val-loss"])
    assert summary["personal-selected-round"] == best["round"]
    assert summary["personal-selected-accuracy"] == best["personal-accuracy"]
    assert (out / "merge-weights.png").exists() and (out / "personal.png").exists()
    reports = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
    panels = FedMerge.figures(evals, reports)["merge-weights.png"].panels
    assert panels[-1].image == last["merge-weights"] and panels[-1].title == f"round {reports[-1]['round']}"
    assert panels[0].image == reports[0]["merge-weights"] and 2 <= len(panels) <= 4  # first to last evaluation


def test_fixed_merges_use_k_random_models_with_equal_frozen_weights():
    s = built(d=5, m=4, fixed_models=2)
    w = torch.softmax(s.logits, 1)
    assert ((w > 0).sum(1) == 2).all() and torch.equal(w[w > 0], torch.full((8,), 0.5))
    assert len({tuple(row.tolist()) for row in (w > 0)}) > 1  # clients draw different models
    theta0 = s.theta.clone()
    one_step(s, {0: 10})  # only client 0 trains: the models it does not merge stay as they were
    assert torch.equal(torch.softmax(s.logits, 1), w)
    untouched = w[0] == 0
    assert torch.equal(s.theta[untouched], theta0[untouched]) and not torch.equal(s.theta[~untouched],
                                                                                 theta0[~untouched])
    with pytest.raises(ConfigError, match="fixed-models"):
        FedMerge(global_models=3, fixed_models=4, num_clients=2)


@pytest.mark.parametrize("d", [2, 4])
def test_payload_bytes_fedmerge_one_model_whatever_d_ifca_and_fedem_d_models(tmp_path, d):
    job = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 3, "num-rounds": 2, "local-epochs": 1,
           "batch-size": 16, "output-dir": str(tmp_path)}
    cfg = load_config(job)
    P = ParamSpec.of(build_from_config(cfg.to_dict(), (1, 8, 8), 4, seed=0)).numel
    expected = {"fedavg": (P, P), "fedmerge": (P, P), "ifca": (d * P, P), "fedem": (d * (P + 1), d * (P + 1))}
    for name, (down, up) in expected.items():
        models = {"global-models": d} if name != "fedavg" else {}
        out = run_inprocess({**job, "strategy": name, **models, "run-name": f"{name}-{d}"})
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["bytes-down-per-dispatch"], summary["bytes-up-per-update"]) == (4 * down, 4 * up)
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
        assert row["bytes-down"] == 4 * down * row["sampled"] and row["bytes-up"] == 4 * up * row["accepted"]
