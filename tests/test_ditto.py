"""Ditto (strategies/ditto.py): the personal model's objective, kept in the node's Context.state across rounds, and
evaluated in place of the global model — in-process, under `flwr run` and on a local deployment
(tests/test_e2e_deploy.py)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict
from helpers import DITTO_TWO_NODES, flower_threads, personal_accuracies, simulated

from client_app.app import app as client_app
from common.config import options_dict, part_of
from common.models import build_from_config
from common.objectives import Received, build_loss
from common.params import ParamSpec
from common.protocol import TRAIN_SEED
from common.splits import client_partition, data_spec
from common.training import LocalRecipe, derive_seed, evaluate, train
from hybridfl.engine.inprocess import InProcessGrid, run_inprocess
from server_app.config import load_config
from strategies.client import LocalTask
from strategies.ditto import LAMBDA, PERSONAL, DittoClient

JOB = {"preset": "ditto-digits", "num-rounds": 4, "eval-every": 2}


def _task(state: RecordDict, w: torch.Tensor, seed: int, lam: float = 0.5) -> tuple[LocalTask, ParamSpec]:
    cfg = load_config({"preset": "ditto-digits", "ditto-lambda": lam})
    spec = data_spec(cfg)
    parts = {p: client_partition(spec, 3, p) for p in ("train", "validation", "test")}
    model = build_from_config(cfg.to_dict(), parts["train"].x.shape[1:], 10, seed=0)
    pspec = ParamSpec.of(model)
    pspec.load_into(model, w)
    config = {**options_dict(part_of(LocalRecipe, cfg)), LAMBDA: lam, TRAIN_SEED: seed}
    return LocalTask(model, pspec, parts, {}, config, cfg.seed, 3, state), pspec


def _personal_run(task: LocalTask, start: torch.Tensor, w_t: torch.Tensor, lam: float, seed: int) -> torch.Tensor:
    """Eq. 2 by hand: from `start`, the recipe on F_k(v) + λ/2 ‖v − w^t‖², seeded apart from the global run."""
    model = task.model
    task.spec.load_into(model, w_t)
    anchor = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    task.spec.load_into(model, start)
    loss = build_loss("proximal", {"proximal-mu": lam}, Received(model, anchor))
    train(model, task.parts["train"], task.recipe, seed=derive_seed(seed, 1), loss=loss)
    return task.spec.flatten(model)


def test_the_personal_model_is_eq2s_run_from_the_kept_model_and_the_global_update_is_fedavgs():
    state = RecordDict()
    initial = build_from_config(load_config({"preset": "ditto-digits"}).to_dict(), (1, 8, 8), 10, 0)
    w0 = ParamSpec.of(initial).flatten(initial)
    task, pspec = _task(state, w0, seed=11)
    delta = DittoClient().train(task)
    plain, _ = _task(RecordDict(), w0, seed=11)  # the default client side: FedAvg's local update
    plain_start = pspec.flatten(plain.model)
    train(plain.model, plain.parts["train"], plain.recipe, seed=11)
    torch.testing.assert_close(delta, pspec.flatten(plain.model) - plain_start, rtol=0, atol=0)
    v1 = pspec.from_record(state[PERSONAL])
    check, _ = _task(RecordDict(), w0, seed=11)
    torch.testing.assert_close(v1, _personal_run(check, w0, w0, 0.5, 11), rtol=0, atol=0)  # v^0 = the first w
    # the next round: from the kept v1, pulled toward the new global model
    w1 = w0 + delta
    task2, _ = _task(state, w1, seed=12)
    DittoClient().train(task2)
    check2, _ = _task(RecordDict(), w1, seed=12)
    torch.testing.assert_close(pspec.from_record(state[PERSONAL]), _personal_run(check2, v1, w1, 0.5, 12), rtol=0,
                               atol=0)
    # λ pulls: a larger λ keeps v closer to w^t
    far, near = (_personal_run(_task(RecordDict(), w0, 11)[0], w0 + delta, w0, lam, 11) for lam in (0.0, 5.0))
    assert (near - w0).norm() < (far - w0).norm()


def test_an_evaluation_evaluates_the_kept_personal_model_or_the_received_one_before_any():
    state = RecordDict()
    cfg = load_config({"preset": "ditto-digits"})
    model = build_from_config(cfg.to_dict(), (1, 8, 8), 10, 0)
    w0 = ParamSpec.of(model).flatten(model)
    task, pspec = _task(state, w0, seed=5)
    side = DittoClient()
    side.prepare(task, evaluating=True)
    torch.testing.assert_close(pspec.flatten(task.model), w0, rtol=0, atol=0)
    side.train(task)
    fresh, _ = _task(state, w0, seed=5)
    DittoClient().prepare(fresh, evaluating=True)
    torch.testing.assert_close(pspec.flatten(fresh.model), pspec.from_record(state[PERSONAL]), rtol=0, atol=0)
    received, _ = _task(RecordDict(), w0, seed=5)
    assert evaluate(fresh.model, fresh.parts["test"]) != evaluate(received.model, received.parts["test"])


def test_in_process_every_node_keeps_its_personal_model_across_rounds_and_it_beats_the_global_one(tmp_path):
    cfg = load_config(JOB)
    grid = InProcessGrid(client_app, cfg.num_clients)
    out = run_inprocess({**JOB, "output-dir": str(tmp_path), "run-name": "ditto"}, grid=grid)
    kept = [ctx.state[PERSONAL] for ctx in grid.contexts.values()]
    assert len(kept) == cfg.num_clients  # every node trained and kept one
    fedavg = run_inprocess({**JOB, "strategy": "fedavg", "output-dir": str(tmp_path), "run-name": "fedavg"})
    # clusters of 2 classes: the personal models fit them
    assert personal_accuracies(out)[-1] > personal_accuracies(fedavg)[-1]


@pytest.mark.e2e
def test_personal_models_persist_under_flwr_run_as_in_process(tmp_path):
    """The personalised accuracies equal the in-process run's, where the nodes' states are known to persist: under
    `flwr run` too each node's Context.state carries its personal model from round to round (a lost state would
    evaluate the received global model instead). On a deployment: tests/test_e2e_deploy.py's TLS run."""
    job = {**DITTO_TWO_NODES, "output-dir": str(tmp_path)}
    with flower_threads():
        ref = personal_accuracies(run_inprocess({**job, "run-name": "ref"}))
        sim = simulated({**job, "run-name": "sim"}, tmp_path / "flwr-home")
    assert len(ref) == 2
    assert personal_accuracies(sim) == pytest.approx(ref, abs=1e-6)
