"""The contract's wider cases end to end (what FedMerge, FedDUAL and data mixing build on): a model per
client, extra arrays both ways, a client objective fixed by the method's client side, several central models."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch.nn import functional as F

from client_app.app import app as client_app
from common.objectives import OBJECTIVES, objective
from common.params import ParamSpec
from common.protocol import ARRAYS, BASE_VERSION, EXTRAS, METRICS, NUM_EXAMPLES, PARTITION_ID
from hybridfl.engine.inprocess import InProcessGrid
from server_app.config import load_config
from server_app.run import build_run
from server_app.wire import RejectedReply, parse_reply
from strategies import STRATEGIES, FedAvg
from strategies.base import Payload, Update
from strategies.client import ClientSide


@pytest.fixture
def personal():
    """A FedAvg that sends client c the model (1 + c/10)·ω and the array hint = [c], with the objective
    `test-echo` (which sends back 2·hint and the norm of the model it received), and has two central models."""

    @objective("test-echo")
    def echo(received, options):
        received.reply["echo"] = 2 * received.arrays["hint"]
        received.reply["start-norm"] = torch.cat([p.reshape(-1) for p in received.start]).norm().reshape(1)
        return lambda x, y, logits: F.cross_entropy(logits, y)

    class EchoClient(ClientSide):
        objective = "test-echo"

    class Personal(FedAvg):
        name = "test-personal"
        client_side = EchoClient

        def __init__(self, config=None, **kwargs) -> None:
            super().__init__(config, **kwargs)
            self.seen: list[tuple[int, dict, float]] = []

        def model_for(self, client: int) -> Payload:
            return Payload(self.params * (1 + client / 10), {"hint": torch.tensor([float(client)])})

        def receive(self, update: Update) -> None:
            self.seen.append((update.client, update.arrays, float(update.sent.params.norm())))
            super().receive(update)

        def central_models(self) -> dict[str, torch.Tensor]:
            return {"global": self.params, "half": 0.5 * self.params}

    yield Personal
    STRATEGIES.pop("test-personal")
    OBJECTIVES.pop("test-echo")


def test_per_client_models_and_extra_arrays_travel_both_ways(tmp_path, personal):
    cfg = load_config({"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "num-rounds": 2,
                       "strategy": "test-personal", "output-dir": str(tmp_path), "run-name": "p"})
    run = build_run(InProcessGrid(client_app, 4), cfg)
    out = run.execute()
    seen = run.strategy.seen
    assert sorted(c for c, _, _ in seen) == [0, 0, 1, 1, 2, 2, 3, 3]
    for client, arrays, sent_norm in seen:
        assert torch.equal(arrays["echo"], torch.tensor([2.0 * client]))  # the objective read the payload's hint
        assert arrays["start-norm"].item() == pytest.approx(sent_norm, rel=1e-5)  # ...and trained from its model
    assert len({round(n, 3) for _, _, n in seen[:4]}) == 4  # four clients, four different models
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"test-accuracy", "test-half-accuracy"} <= set(r) for r in rows)
    models = torch.load(out / "models.pt")
    assert list(models) == ["global", "half"] and list(torch.load(out / "model.pt")) == list(models["global"])
    for name in models["global"]:
        if name.startswith(("body", "head")):
            torch.testing.assert_close(models["half"][name], 0.5 * models["global"][name])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client-eval"]["replies"] == 4 and summary["strategy"]["strategy"] == personal.reference()
    assert personal.reference().endswith(":personal.<locals>.Personal")  # not a built-in: named by its path


def test_a_reply_with_non_finite_extra_arrays_is_rejected():
    InProcessGrid(client_app, num_nodes=1)  # sets the process's task identity, needed to build Messages
    ins = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=3, message_type="train")
    metrics = MetricRecord({NUM_EXAMPLES: 5, PARTITION_ID: 0, BASE_VERSION: 0})

    def reply(extra: torch.Tensor) -> Message:
        return Message(RecordDict({ARRAYS: ArrayRecord({"params": torch.zeros(3)}), EXTRAS: ArrayRecord({"g": extra}),
                                   METRICS: metrics}), reply_to=ins)

    spec = ParamSpec(("w",), ((3,),))
    assert torch.equal(parse_reply(reply(torch.ones(2)), spec).arrays["g"], torch.ones(2))
    with pytest.raises(RejectedReply, match="'g' has 1 non-finite"):
        parse_reply(reply(torch.tensor([1.0, float("inf")])), spec)
