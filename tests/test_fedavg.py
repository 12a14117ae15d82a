"""FedAvg: the same arrays as Flower's own FedAvg given the same client models; robust to reply order and
bad replies (through the Flower adapter, as a Flower user would drive it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from client_app.app import app as client_app
from common.params import ParamSpec
from common.protocol import ARRAYS, BASE_VERSION, CONFIG, METRICS, NUM_EXAMPLES, PARTITION_ID, VERSION
from hybridfl.engine.inprocess import InProcessGrid
from server_app.flower import FlowerStrategy
from strategies import FedAvg
from strategies.base import Update

SPEC = ParamSpec(("w", "b"), ((3, 4), (4,)))


def setup(k: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    omega = torch.randn(SPEC.numel, generator=g)
    models = [omega + 0.1 * torch.randn(SPEC.numel, generator=g) for _ in range(k)]
    sizes = [int(s) for s in torch.randint(1, 500, (k,), generator=g)]
    return omega, models, sizes


def clients(models: list[torch.Tensor], sizes: list[int], bad: dict[int, str] | None = None) -> ClientApp:
    """Client i trains to models[i] on sizes[i] examples and replies with its delta (or misbehaves: bad[i])."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        i = context.node_config["partition-id"]
        received = SPEC.from_record(msg.content[ARRAYS])
        kind = (bad or {}).get(i)
        if kind == "raise":
            raise RuntimeError("device out of memory")
        delta = {"nan": torch.full_like(received, float("nan")), "shape": (models[i] - received)[:-1]}.get(
            kind, models[i] - received)
        metrics = MetricRecord({NUM_EXAMPLES: sizes[i], PARTITION_ID: i, BASE_VERSION: msg.content[CONFIG][VERSION],
                                "train-loss": float(i)})
        return Message(RecordDict({ARRAYS: ArrayRecord({"params": delta}), METRICS: metrics}), reply_to=msg)

    app.query()(lambda msg, context: client_app(msg, context))
    return app


def one_round(models, sizes, omega, bad=None) -> tuple[FlowerStrategy, ArrayRecord, MetricRecord]:
    grid = InProcessGrid(clients(models, sizes, bad), num_nodes=len(models))
    adapter = FlowerStrategy(FedAvg(), clients_per_round=len(models))
    arrays = SPEC.to_record(omega)
    replies = grid.send_and_receive(adapter.configure_train(1, arrays, ConfigRecord({}), grid))
    out_arrays, metrics = adapter.aggregate_train(1, replies)
    return adapter, out_arrays, metrics


def test_same_arrays_as_flower_fedavg():
    omega, models, sizes = setup()
    _, our_arrays, our_metrics = one_round(models, sizes, omega)
    # Flower's FedAvg averages the weights the clients send; ours, the deltas: the same models, the same mean.
    ins = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=7, message_type="train")
    weights = [Message(RecordDict({ARRAYS: SPEC.to_record(w), METRICS: MetricRecord(
        {NUM_EXAMPLES: n, PARTITION_ID: i, BASE_VERSION: 0, "train-loss": float(i)})}), reply_to=ins)
        for i, (w, n) in enumerate(zip(models, sizes))]
    flower_arrays, flower_metrics = FlowerFedAvg().aggregate_train(1, weights)
    assert list(our_arrays.keys()) == list(flower_arrays.keys())
    for name in our_arrays:
        np.testing.assert_allclose(our_arrays[name].numpy(), flower_arrays[name].numpy(), rtol=0, atol=1e-6)
    assert our_metrics["train-loss"] == pytest.approx(flower_metrics["train-loss"])
    # ...and both equal the textbook formula.
    expected = sum(n * w for w, n in zip(models, sizes)) / sum(sizes)
    np.testing.assert_allclose(SPEC.from_record(our_arrays).numpy(), expected.numpy(), atol=1e-6)


def test_result_does_not_depend_on_arrival_order():
    omega, models, sizes = setup(k=6, seed=1)
    updates = [Update(i, 0, w - omega, n) for i, (w, n) in enumerate(zip(models, sizes))]
    results = []
    for order in (updates, updates[::-1], updates[3:] + updates[:3]):
        s = FedAvg()
        s.initialize(omega, SPEC)
        for u in order:
            s.receive(u)
        s.close_round()
        assert s.ready()
        s.step()
        results.append(s.params.numpy().tobytes())
        assert s.version == 1
    assert results[0] == results[1] == results[2]


def test_not_ready_until_the_round_is_closed_and_empty_round_keeps_the_model():
    omega, models, sizes = setup()
    s = FedAvg()
    s.initialize(omega, SPEC)
    s.close_round()
    assert not s.ready()  # nothing arrived: no new version
    s.receive(Update(0, 0, models[0] - omega, sizes[0]))
    assert not s.ready()
    s.close_round()
    assert s.ready()
    s.step()
    np.testing.assert_allclose(s.params.numpy(), models[0].numpy(), atol=1e-6)
    s.receive(Update(1, 1, models[1] - omega, sizes[1]))
    assert not s.ready()  # the next round starts open


def test_bad_replies_are_rejected_counted_and_the_round_goes_on():
    omega, models, sizes = setup(k=6)
    adapter, arrays, metrics = one_round(models, sizes, omega, bad={3: "nan", 4: "shape", 5: "raise"})
    expected = sum(n * w for w, n in zip(models[:3], sizes[:3])) / sum(sizes[:3])
    np.testing.assert_allclose(SPEC.from_record(arrays).numpy(), expected.numpy(), atol=1e-6)
    assert (metrics["accepted"], metrics["rejected"], metrics["failures"]) == (3, 2, 1)
    assert adapter.strategy.version == 1
