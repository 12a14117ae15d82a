"""Cohort training (hybridfl/engine/cohort.py): a pull's clients trained as one batched computation give the updates
that training them one after another gives, within float rounding, for every method it serves; everything else runs
one message at a time, as before."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from helpers import digest

from client_app.app import app as client_app
from common import cohort_step
from common.config import options_dict, part_of
from common.models import build_from_config
from common.params import WIRE_KEY, ParamSpec
from common.protocol import ARRAYS, TRAIN_SEED
from common.splits import client_partition, data_spec
from common.training import LocalRecipe
from hybridfl.engine import cohort
from hybridfl.engine.inprocess import InProcessGrid, cohort_training, run_inprocess
from server_app.config import load_config
from strategies.client import ClientSide, LocalTask

# Relative L2 distance between a cohort-trained and a sequentially trained update, in float32. A batched
# convolution sums in another order than a lone one, and each CPU kernel (AVX-512, AVX2, default) in its own: a
# K-term float32 sum is off by at most K * 1.2e-7 relative, K <= a few hundred (batch x positions) here, ~5e-5 per
# SGD step, not amplified by SGD (lr times the loss's curvature < 1) over a run of a few steps: 1e-3 holds on every
# kernel (measured 1e-6 to 5e-5). Adam has no such bound: it divides each coordinate's step by its gradient's RMS,
# so a coordinate whose gradient is rounding noise takes a step of lr whatever the noise (4.6e-3 under AVX2 against
# 1e-5 under AVX-512, 2026-11): its unit test trains in float64 (below).
UPDATE_TOL = 1e-3
# ... and between the final models of two short runs whose server steps are sums of the updates
MODEL_TOL = 1e-3
# The same comparison in float64: a rounding of 1.1e-16 amplified as float32's 1.2e-7 was to 4.6e-3 (4e4 times)
# stays below 1e-11 (measured: at most 1e-13 under AVX2 and default); 1e-6 leaves five orders of magnitude more
UPDATE_TOL_64 = 1e-6

# the server trains or searches on its own data, many small steps that amplify the updates' rounding
SERVER_TRAINS = ("feddle", "fedft", "feddf")
SERVED = ["fedavg", "fedbuff", "fedasync", "ca2fl", "feddle", "fedft", "hfcl", "feddf", "fedmerge",
          "parallel-training"]
NOT_SERVED = [{"strategy": "ditto", "num-clusters": 2}, {"strategy": "scaffold"}, {"strategy": "feddual"},
              {"strategy": "fedavg", "local-objective": "proximal"}]
# whole runs train 1 epoch (the unit test below covers 2 epochs, epoch boundaries and unequal sizes)
JOB = {"dataset": "synthetic", "num-clients": 6, "clients-per-round": 4, "num-rounds": 3, "local-epochs": 1,
       "batch-size": 8, "eval-every": 3, "central-size": 40}
SHORT = {"feddle": {"buffer-size": 2}, "fedbuff": {"buffer-size": 2, "delay-sigma": 1.0},
         "fedasync": {"delay-sigma": 1.0}, "ca2fl": {"buffer-size": 2, "delay-sigma": 1.0}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _tasks(sizes: list[int], optimizer: str, seeds: list[int], dtype: torch.dtype = torch.float32, **model: object
           ) -> list[LocalTask]:
    """Tasks on one shared model (as load_task makes them, in `dtype`), each with its own data of `sizes` rows."""
    cfg = load_config({**JOB, "optimizer": optimizer, "lr": 0.01 if optimizer == "adam" else 0.05,
                       "batch-size": 16, "local-epochs": 2, **model})
    spec = data_spec(cfg)
    part = client_partition(spec, 0, "train")
    model = build_from_config(cfg.to_dict(), part.x.shape[1:], part.num_classes, seed=0).to(dtype)
    part = dataclasses.replace(part, x=part.x.astype(torch.empty(0, dtype=dtype).numpy().dtype))
    pspec = ParamSpec.of(model)
    rng = np.random.default_rng(0)
    tasks = []
    for size, seed in zip(sizes, seeds):
        data = part.subset(rng.choice(len(part), size, replace=size > len(part)))
        config = {**options_dict(part_of(LocalRecipe, cfg)), TRAIN_SEED: seed}
        tasks.append(LocalTask(model, pspec, {"train": data}, {}, config, cfg.seed, seed, RecordDict()))
    return tasks


# Adam in float32 has no rounding bound (UPDATE_TOL): its claim is tested in float64
@pytest.mark.parametrize(("optimizer", "dtype"), [("sgd", torch.float32), ("sgd", torch.float64),
                                                  ("adam", torch.float64)], ids=["sgd-32", "sgd-64", "adam-64"])
def test_a_cohort_of_unequal_clients_trains_each_as_alone(optimizer, dtype):
    """Clients of 5, 33 (a lone trailing sample each epoch, skipped), 70 and 16 rows, each from its own start and
    seed: the deltas and training metrics of one batched run are those of four runs of ClientSide.train, within
    float32's rounding (SGD), or float64's (SGD and Adam, whose float32 updates no tolerance bounds)."""
    tol = UPDATE_TOL if dtype == torch.float32 else UPDATE_TOL_64
    tasks = _tasks([5, 33, 70, 16], optimizer, seeds=[11, 12, 13, 14], dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    params = lambda model: torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
    starts = [params(tasks[0].model) + 0.05 * torch.randn(tasks[0].spec.numel, generator=gen, dtype=dtype)
              for _ in tasks]
    members = [cohort.Member(None, task, start) for task, start in zip(tasks, starts)]
    deltas, metrics = cohort.train_together(members)
    for task, start, delta, stats in zip(tasks, starts, deltas, metrics):
        task.spec.load_into(task.model, start)
        ClientSide().train(task)
        alone = params(task.model) - start  # in the model's dtype (the wire's flatten rounds to float32)
        assert rel(delta, alone) < tol
        assert stats["train-loss"] == pytest.approx(task.metrics["train-loss"], rel=1e-4)
        assert stats["train-accuracy"] == pytest.approx(task.metrics["train-accuracy"], abs=1e-9)
    assert len({round(float(d.norm()), 6) for d in deltas}) == 4  # four different runs, not one repeated


class Recorded(InProcessGrid):
    """The in-process grid, recording each pull's train messages (``due``), the messages the cohort trained
    (``trained``), and with ``shadow`` the relative distance of each cohort update from the same message trained
    alone by the ClientApp."""

    def __init__(self, use_cohort: bool, shadow: list[float] | None = None, cohort_size: int = 32) -> None:
        super().__init__(client_app, JOB["num-clients"], cohort=self.train if use_cohort else None,
                         cohort_size=cohort_size)
        self.shadow, self.served, self.trained, self.due = shadow, [], set(), []

    def train(self, messages, contexts):
        replies = cohort.train_cohort(messages, contexts)
        self.served.append(len(replies))
        self.trained.update(replies)
        for msg in messages if self.shadow is not None else ():
            if msg.metadata.message_id in replies:
                alone = client_app(msg, contexts[msg.metadata.dst_node_id])
                self.shadow.append(rel(*(torch.from_numpy(r.content[ARRAYS][WIRE_KEY].numpy().copy())
                                         for r in (replies[msg.metadata.message_id], alone))))
        return replies

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        self.due.append([i for i in ids
                         if i in self._pending and self._pending[i].metadata.message_type == MessageType.TRAIN])
        return super().pull_messages(ids)


def _run(tmp_path, name: str, overrides: dict, use_cohort: bool, shadow: list[float] | None = None,
         cohort_size: int = 32) -> tuple[dict, Recorded]:
    grid = Recorded(use_cohort, shadow, cohort_size)
    out = run_inprocess({**JOB, **overrides, "output-dir": str(tmp_path), "run-name": name}, grid=grid)
    return {"out": out, "summary": json.loads((out / "summary.json").read_text()),
            "events": [(e["client"], e["round"], e["outcome"]) for e in
                       map(json.loads, (out / "events.jsonl").read_text().splitlines())]}, grid


def model_distance(a: dict, b: dict) -> float:
    a, b = (torch.load(run["out"] / "model.pt") for run in (a, b))
    return rel(torch.cat([a[k].flatten() for k in a]), torch.cat([b[k].flatten() for k in b]))


@pytest.mark.parametrize("strategy", SERVED)
def test_every_served_method_gets_the_updates_of_one_client_at_a_time(tmp_path, strategy):
    """Every update the cohort trains, from the method's own payloads (FedMerge's per-client merges, Feddle's
    searched models), is within UPDATE_TOL of the ClientApp's for the same message; the cohort trained every
    accepted update (and ahead of time those still in flight at the end, which the run discards); the runs have the
    same events in the same order and steps. Where the server's step is a fixed sum of the updates, the final models
    agree within MODEL_TOL; a server that trains or searches on its own data (Feddle, Fed+FT, FedDF) amplifies
    rounding over its many steps, so there the updates are the claim."""
    overrides, shadow = {"strategy": strategy, **SHORT.get(strategy, {})}, []
    together, grid = _run(tmp_path, "cohort", overrides, use_cohort=True, shadow=shadow)
    alone, _ = _run(tmp_path, "alone", overrides, use_cohort=False)
    pulled = {i for due in grid.due for i in due}
    assert len(shadow) == sum(grid.served) == len(grid.trained) >= together["summary"]["total-accepted"] > 0
    assert len(grid.trained & pulled) == together["summary"]["total-accepted"]
    assert max(shadow) < UPDATE_TOL
    assert together["events"] == alone["events"] and len(alone["events"]) >= 6
    assert together["summary"]["final-version"] == alone["summary"]["final-version"] > 0
    if strategy not in SERVER_TRAINS:
        assert model_distance(together, alone) < MODEL_TOL


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff"])
def test_the_cohort_is_every_message_in_flight_not_only_those_due(tmp_path, strategy):
    """An asynchronous run's pull asks for the replies due at its step (one or two here) while more messages are in
    flight (four dispatched a step, up to all six clients): the cohort trains every one in flight at the first pull
    that needs one, and later pulls take the replies trained ahead (fewer cohorts than pulls of train replies);
    `cohort-size` caps a cohort, beside the messages due."""
    overrides = {"strategy": strategy, **SHORT[strategy], "delay-sigma": 3.0, "num-rounds": 4}
    _, grid = _run(tmp_path, "in-flight", overrides, use_cohort=True)
    pulls = [due for due in grid.due if due]
    most_due = max(len(due) for due in pulls)
    assert max(grid.served) >= JOB["clients-per-round"] > most_due
    assert len(grid.served) < len(pulls)
    _, capped = _run(tmp_path, "capped", overrides, use_cohort=True, cohort_size=2)
    assert max(capped.served) == max(2, most_due) < max(grid.served)


def test_a_node_gone_after_its_message_was_trained_ahead_gets_the_error_reply():
    """The cohort trains the three messages in flight at the first pull; the node of the second then leaves: its
    pull is NODE_UNAVAILABLE, as without the cohort, and the third's is the reply trained ahead."""
    calls: list[list[str]] = []

    def fake_cohort(messages, contexts):
        calls.append([m.metadata.message_id for m in messages])
        return {m.metadata.message_id: Message(RecordDict({"ahead": ConfigRecord({"of": m.metadata.message_id})}),
                                               reply_to=m) for m in messages}

    grid = InProcessGrid(client_app, 3, cohort=fake_cohort)
    nodes = list(grid.get_node_ids())
    ids = list(grid.push_messages([Message(RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN)
                                   for n in nodes]))
    [first] = grid.pull_messages(ids[:1])
    assert calls == [ids] and first.content["ahead"]["of"] == ids[0]
    grid.disconnect(nodes[1])
    [second] = grid.pull_messages(ids[1:2])
    assert second.has_error() and second.error.code == ErrorCode.NODE_UNAVAILABLE
    [third] = grid.pull_messages(ids[2:])
    assert third.content["ahead"]["of"] == ids[2] and len(calls) == 1


def test_models_whose_training_step_is_not_a_function_of_parameters_and_input_are_not_served():
    """BatchNorm's running statistics (ResNet-18) and active dropout change the model's state or draw randomness in
    a training step: such models run one message at a time; the CNN and the ViT are served."""
    assert cohort.served(_tasks([8], "sgd", [1])[0])
    assert cohort.served(_tasks([8], "sgd", [1], model="vit-small")[0])
    assert not cohort.served(_tasks([8], "sgd", [1], **{"model": "resnet18", "input-size": 32})[0])
    task = _tasks([8], "sgd", [1])[0]
    task.model.body.append(torch.nn.Dropout(0.1))
    assert not cohort.served(task)
    empty = _tasks([8], "sgd", [1])[0]
    empty.parts = {"train": empty.parts["train"].subset(np.arange(0))}  # the ClientApp's error reply says why
    assert not cohort.served(empty)


def test_a_recipe_key_the_batched_step_does_not_name_is_served_only_at_its_default(monkeypatch):
    """served() derives its checks from LocalRecipe's keys: one that REPRODUCED does not name (as a key added to the
    recipe later would be) is served at its default only; the named ones at the values they list."""
    task = _tasks([8], "sgd", [1], momentum=0.5)[0]
    assert cohort.served(task)
    monkeypatch.setattr(cohort, "REPRODUCED", {k: v for k, v in cohort.REPRODUCED.items() if k != "momentum"})
    assert not cohort.served(task) and cohort.served(_tasks([8], "sgd", [1])[0])  # 0.5, then the default 0.9
    monkeypatch.setattr(cohort, "REPRODUCED", {**cohort.REPRODUCED, "optimizer": ("adam",)})
    assert not cohort.served(_tasks([8], "sgd", [1])[0]) and cohort.served(_tasks([8], "adam", [1])[0])


@pytest.mark.parametrize("overrides", NOT_SERVED, ids=lambda o: o.get("local-objective", o["strategy"]))
def test_a_method_with_its_own_client_side_or_objective_runs_one_at_a_time(tmp_path, overrides):
    """Its own client side (Ditto) or objective (SCAFFOLD, FedDUAL, FedProx): the cohort serves none of its
    messages, and the run is byte for byte the sequential one."""
    overrides = {**overrides, "num-rounds": 2, "local-epochs": 1}
    together, grid = _run(tmp_path, "cohort", overrides, use_cohort=True)
    alone, _ = _run(tmp_path, "alone", overrides, use_cohort=False)
    assert grid.served and sum(grid.served) == 0
    assert digest(together["out"] / "model.pt") == digest(alone["out"] / "model.pt")


def test_a_failing_batched_run_falls_back_to_one_message_at_a_time(tmp_path, monkeypatch):
    def broken(members):
        raise RuntimeError("CUDA out of memory")

    logged: list[str] = []
    monkeypatch.setattr(cohort, "train_together", broken)
    monkeypatch.setattr(cohort_step, "log", lambda level, fmt, *args: logged.append(fmt % args))
    together, grid = _run(tmp_path, "cohort", {"num-rounds": 2}, use_cohort=True)
    alone, _ = _run(tmp_path, "alone", {"num-rounds": 2}, use_cohort=False)
    served = grid.served
    assert served and sum(served) == 0 and together["summary"]["total-failures"] == 0
    assert digest(together["out"] / "model.pt") == digest(alone["out"] / "model.pt")
    # every pull failed: said once, with the reason, and what happens instead
    assert len(served) > 1 and len(logged) == 1 and re.fullmatch(
        r"a cohort's batched training failed \(RuntimeError: CUDA out of memory\); its \d clients train one at a "
        r"time \(said once per run\)", logged[0]), logged


def test_a_runs_cohort_steps_are_freed_when_it_ends(tmp_path):
    """A cohort step holds the model, C copies of the parameters and optimizer state (and on CUDA a graph and its
    memory pool): none outlives its run, over several runs in one process."""
    import gc
    import weakref

    made: list[weakref.ref] = []
    original = cohort_step.CohortStep.__init__

    def tracked(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    cohort_step.CohortStep.__init__ = tracked
    try:
        for seed in range(3):
            _, grid = _run(tmp_path, f"cohort-{seed}", {"num-rounds": 2, "seed": seed}, use_cohort=True)
            gc.collect()
            assert sum(grid.served) > 0 and made and cohort_step._STEPS == {}
            assert [ref for ref in made if ref() is not None] == []
    finally:
        cohort_step.CohortStep.__init__ = original


def test_the_key_chooses_cohort_training_on_cuda_only_unless_told(tmp_path):
    """``auto`` is on where the nodes train on CUDA; a CPU run's default is the sequential run, byte for byte."""
    assert cohort_training("auto") is torch.cuda.is_available()
    assert cohort_training("on") and not cohort_training("off")
    if torch.cuda.is_available():
        pytest.skip("auto is on here")
    job = {**JOB, "num-rounds": 1, "output-dir": str(tmp_path)}
    default = run_inprocess({**job, "run-name": "default"})
    off = run_inprocess({**job, "cohort-training": "off", "run-name": "off"})
    on = run_inprocess({**job, "cohort-training": "on", "run-name": "on"})
    assert digest(default / "model.pt") == digest(off / "model.pt") != digest(on / "model.pt")


@pytest.fixture
def full_fp32():
    """cuDNN's convolutions in full FP32: its default TF32 (10-bit mantissa) put the cohort's CUDA updates 2e-3 to
    3e-2 from the sequential ones on an H100 (2026-11-27), TF32's rounding, not the cohort's."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on the project's machines)")
@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff", "feddle"])
def test_on_cuda_the_cohort_gets_the_updates_of_one_client_at_a_time(tmp_path, strategy, full_fp32):
    shadow: list[float] = []
    together, grid = _run(tmp_path, "cohort", {"strategy": strategy, **SHORT.get(strategy, {})}, use_cohort=True,
                          shadow=shadow)
    assert len(shadow) == sum(grid.served) >= together["summary"]["total-accepted"] > 0
    assert max(shadow) < UPDATE_TOL
