"""FedAvg: the same arrays as Flower's own FedAvg given the same replies; robust to reply order and bad replies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from common.params import ParamSpec
from common.protocol import ARRAYS, BASE_VERSION, METRICS, NUM_EXAMPLES, PARTITION_ID
from server_app.inprocess import InProcessGrid
from strategies import FedAvg
from strategies.base import Update


@pytest.fixture(scope="module")
def spec() -> ParamSpec:
    InProcessGrid(client_app=None, num_nodes=1)  # sets the process's task identity, needed to build Messages
    return ParamSpec(("w", "b"), ((3, 4), (4,)))


def reply(arrays_flat: torch.Tensor, spec: ParamSpec, n: int, client: int, node: int = 7) -> Message:
    ins = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node, message_type="train")
    ins.metadata.__dict__["_message_id"] = f"ins-{client}"
    metrics = MetricRecord({NUM_EXAMPLES: n, PARTITION_ID: client, BASE_VERSION: 0, "train-loss": float(client)})
    return Message(RecordDict({ARRAYS: spec.to_record(arrays_flat), METRICS: metrics}), reply_to=ins)


def setup(spec: ParamSpec, k: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    omega = torch.randn(spec.numel, generator=g)
    models = [omega + 0.1 * torch.randn(spec.numel, generator=g) for _ in range(k)]
    sizes = [int(s) for s in torch.randint(1, 500, (k,), generator=g)]
    return omega, models, sizes


def ours(spec: ParamSpec, omega: torch.Tensor) -> FedAvg:
    s = FedAvg(clients_per_round=5)
    s.initialize(omega, spec)
    return s


def test_same_arrays_as_flower_fedavg(spec):
    omega, models, sizes = setup(spec)
    flower_arrays, flower_metrics = FlowerFedAvg().aggregate_train(
        1, [reply(w, spec, n, i) for i, (w, n) in enumerate(zip(models, sizes))])
    # Our clients send deltas; Flower's send weights. Same models, so the same average.
    our_arrays, our_metrics = ours(spec, omega).aggregate_train(
        1, [reply(w - omega, spec, n, i) for i, (w, n) in enumerate(zip(models, sizes))])
    assert list(our_arrays.keys()) == list(flower_arrays.keys())
    for name in our_arrays.keys():
        np.testing.assert_allclose(our_arrays[name].numpy(), flower_arrays[name].numpy(), rtol=0, atol=1e-6)
    assert our_metrics["train-loss"] == pytest.approx(flower_metrics["train-loss"])
    # ...and both equal the textbook formula.
    expected = sum(n * w for w, n in zip(models, sizes)) / sum(sizes)
    np.testing.assert_allclose(spec.from_record(our_arrays).numpy(), expected.numpy(), atol=1e-6)


def test_result_does_not_depend_on_arrival_order(spec):
    omega, models, sizes = setup(spec, k=6, seed=1)
    updates = [Update(i, 0, w - omega, n) for i, (w, n) in enumerate(zip(models, sizes))]
    results = []
    for order in (updates, updates[::-1], updates[3:] + updates[:3]):
        s = ours(spec, omega)
        for u in order:
            s.receive(u)
        s.close_round()
        assert s.ready()
        results.append(s.aggregate().numpy().tobytes())
        assert s.version == 1
    assert results[0] == results[1] == results[2]


def test_not_ready_until_the_round_is_closed_and_empty_round_keeps_the_model(spec):
    omega, models, sizes = setup(spec)
    s = ours(spec, omega)
    s.close_round()
    assert not s.ready()  # nothing arrived: no new version
    s.receive(Update(0, 0, models[0] - omega, sizes[0]))
    assert not s.ready()
    s.close_round()
    assert s.ready()
    np.testing.assert_allclose(s.aggregate().numpy(), models[0].numpy(), atol=1e-6)
    s.receive(Update(1, 1, models[1] - omega, sizes[1]))
    assert not s.ready()  # the next round starts open


def test_bad_replies_are_skipped_and_the_round_goes_on(spec):
    omega, models, sizes = setup(spec)
    good = [reply(w - omega, spec, n, i) for i, (w, n) in enumerate(zip(models[:3], sizes[:3]))]
    nan = reply(torch.full_like(omega, float("nan")), spec, 10, 3)
    wrong_shape = reply(omega[:-1], ParamSpec(("w",), ((spec.numel - 1,),)), 10, 4)
    ins = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=9, message_type="train")
    ins.metadata.__dict__["_message_id"] = "ins-err"
    error = Message(Error(code=2, reason="boom on device"), reply_to=ins)
    s = ours(spec, omega)
    arrays, _ = s.aggregate_train(1, good + [nan, wrong_shape, error])
    expected = sum(n * w for w, n in zip(models[:3], sizes[:3])) / sum(sizes[:3])
    np.testing.assert_allclose(spec.from_record(arrays).numpy(), expected.numpy(), atol=1e-6)
    assert s.rejected_replies == 3
