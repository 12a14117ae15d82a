"""Replies a broken or hostile device may send, the server's defences against them, and the robust options.

Every value a reply carries is checked (server_app/wire.py): a bad one is a rejected reply, counted and logged,
never a dead ServerApp. A step that leaves the model non-finite is refused (server_app/runtime.py). The norm bound
and the trimmed mean / median (strategies/robust.py) keep scaled or flipped updates from taking the model over.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict

from client_app.app import app as client_app
from common.config import ConfigError
from common.params import ParamSpec
from common.protocol import ARRAYS, BASE_VERSION, CONFIG, EXTRAS, METRICS, NUM_EXAMPLES, PARTITION_ID, VERSION
from hybridfl.engine.inprocess import InProcessGrid
from server_app.config import load_config
from server_app.wire import RejectedReply, parse_metrics, parse_reply
from strategies import build_strategy
from strategies.aggregation import fedavg_step, weighted_sum
from strategies.base import Update
from strategies.robust import RobustConfig, clip
from tests.test_runtime import events, wrap

SPEC = ParamSpec(("params",), ((3,),))


def reply(delta=None, extras=None, **metrics) -> Message:
    """A train reply of client 2 at version 1 with 10 examples, any of it replaced."""
    values = {NUM_EXAMPLES: 10, PARTITION_ID: 2, BASE_VERSION: 1, **metrics}
    content = RecordDict({ARRAYS: delta if isinstance(delta, ArrayRecord) else
                          ArrayRecord({"params": torch.ones(3) if delta is None else delta}),
                          METRICS: MetricRecord(values)})
    if extras is not None:
        content[EXTRAS] = extras
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


@pytest.fixture(autouse=True)
def task_identity():
    InProcessGrid(client_app, num_nodes=1)  # sets the process's task identity, needed to build Messages


def test_a_well_formed_reply_is_read_whole():
    update = parse_reply(reply(**{"train-loss": 0.5}), SPEC, max_examples=10)
    assert (update.client, update.base_version, update.num_examples) == (2, 1, 10)
    assert torch.equal(update.delta, torch.ones(3)) and update.metrics == {"train-loss": 0.5}


@pytest.mark.parametrize(("metrics", "reason"), [
    ({NUM_EXAMPLES: float("nan")}, "'num-examples' = nan"),
    ({NUM_EXAMPLES: float("inf")}, "'num-examples' = inf"),
    ({NUM_EXAMPLES: -float("inf")}, "'num-examples' = -inf"),
    ({NUM_EXAMPLES: [1, 2]}, "'num-examples' is a list"),
    ({NUM_EXAMPLES: 1e300}, "'num-examples' = 1e\\+300"),
    ({NUM_EXAMPLES: 11}, "whole number in \\[1, 10\\]"),  # more than the client holds
    ({NUM_EXAMPLES: 0}, "'num-examples' = 0"),
    ({NUM_EXAMPLES: -5}, "'num-examples' = -5"),
    ({NUM_EXAMPLES: 2.5}, "'num-examples' = 2.5"),
    ({PARTITION_ID: float("nan")}, "'partition-id' = nan"),
    ({PARTITION_ID: -1}, "'partition-id' = -1"),
    ({BASE_VERSION: [1.0]}, "'base-version' is a list"),
    ({BASE_VERSION: 1e300}, "'base-version' = 1e\\+300"),
    ({"train-loss": float("nan")}, "'train-loss' = nan"),
    ({"train-loss": [0.1, 0.2]}, "'train-loss' is a list"),
])
def test_every_bad_value_in_a_reply_is_rejected_naming_it(metrics, reason):
    with pytest.raises(RejectedReply, match=reason):
        parse_reply(reply(**metrics), SPEC, max_examples=10)


@pytest.mark.parametrize(("delta", "reason"), [
    (torch.tensor([1.0, float("nan"), 0.0]), "non-finite"),
    (torch.tensor([1.0, float("inf"), 0.0]), "non-finite"),
    (torch.tensor([1e300, 0.0, 0.0], dtype=torch.float64), "non-finite"),  # past float32: inf once cast
    (torch.ones(4), "shape \\(4,\\)"),
    (torch.ones(3, dtype=torch.int64), "dtype int64"),
    (ArrayRecord({"other": torch.ones(3)}), "expected one array 'params'"),
    # bytes that are not the array they claim to be: numpy cannot read them, and that is a rejection too
    (ArrayRecord({"params": Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"\x00" * 5)}),
     "malformed reply"),
])
def test_arrays_that_are_not_the_models_layout_in_finite_floats_are_rejected(delta, reason):
    with pytest.raises(RejectedReply, match=reason):
        parse_reply(reply(delta), SPEC)


def test_a_query_or_evaluation_reply_with_a_bad_value_is_rejected_not_raised():
    good = Message(RecordDict({METRICS: MetricRecord({PARTITION_ID: 3, "eval-accuracy": 0.5})}), dst_node_id=1,
                   message_type=MessageType.QUERY)
    assert parse_metrics(good) == (3, {"eval-accuracy": 0.5})
    for metrics in ({PARTITION_ID: float("nan")}, {PARTITION_ID: [3]}, {"eval-accuracy": 0.5},
                    {PARTITION_ID: 3, "eval-accuracy": float("inf")}):
        bad = Message(RecordDict({METRICS: MetricRecord(metrics)}), dst_node_id=1, message_type=MessageType.QUERY)
        with pytest.raises(RejectedReply):
            parse_metrics(bad)
    with pytest.raises(RejectedReply, match="lacks"):
        parse_metrics(Message(RecordDict({}), dst_node_id=1, message_type=MessageType.QUERY))


# What the hostile client of the run below sends, one kind per train message, in this order
ATTACKS = [
    {NUM_EXAMPLES: float("nan")}, {NUM_EXAMPLES: float("inf")}, {NUM_EXAMPLES: [1, 2]}, {NUM_EXAMPLES: 1e300},
    {NUM_EXAMPLES: 10**6}, {PARTITION_ID: 1}, {BASE_VERSION: 10**6}, {"train-loss": float("nan")},
]


def test_a_hostile_client_cannot_stop_a_run_and_each_bad_reply_is_rejected_and_counted(small_run):
    sent: list[dict] = []

    def hostile(msg: Message, context: Context) -> Message:
        honest = client_app(msg, context)
        if context.node_config["partition-id"] != 0:
            return honest
        attack = ATTACKS[len(sent) % len(ATTACKS)]
        sent.append(attack)
        metrics = {**dict(honest.content[METRICS]), **attack}
        return Message(RecordDict({ARRAYS: honest.content[ARRAYS], METRICS: MetricRecord(metrics)}), reply_to=msg)

    out, summary = small_run("hostile", client_app=wrap(hostile), **{"num-rounds": 10, "max-failed-fraction": 1.0})
    lost = [e for e in events(out) if e["outcome"] != "accepted"]
    assert summary["final-version"] == 10 and len(sent) >= len(ATTACKS)
    assert [e["outcome"] for e in lost] == ["rejected"] * len(sent) and {e["client"] for e in lost} == {0}
    # each kind was named in its rejection, in the order it was sent
    names = ["num-examples"] * 5 + ["reply is for client 1", "at version 1000000", "train-loss"]
    assert all(names[i % len(ATTACKS)] in e["reason"] for i, e in enumerate(lost))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["rejected"] for r in rows) == len(sent) == summary["total-rejected"]
    assert summary["final-test-accuracy"] > 0.5  # the honest three trained: the synthetic set is easy


def huge(msg: Message, context: Context) -> Message:
    """A client whose delta is finite, 3e38 everywhere: accepted, but a few of them summed pass float32's range."""
    honest = client_app(msg, context)
    delta = torch.full_like(torch.from_numpy(honest.content[ARRAYS]["params"].numpy()), 3e38)
    return Message(RecordDict({ARRAYS: ArrayRecord({"params": delta}), METRICS: honest.content[METRICS]}),
                   reply_to=msg)


def test_a_step_that_makes_a_non_finite_model_is_refused_and_the_run_goes_on_from_the_last_good_one(small_run):
    seen = Counter()

    def partly_huge(msg: Message, context: Context) -> Message:
        # three of the four clients, on the first two messages that carry version 1 (rounds 2 and 3, the second
        # after the first step was refused): η_g Σ Δ/K = 2 · 3 · 3e38 / 4 = inf
        client = context.node_config["partition-id"]
        seen[client, msg.content[CONFIG][VERSION]] += 1
        big = client < 3 and msg.content[CONFIG][VERSION] == 1 and seen[client, 1] <= 2
        return huge(msg, context) if big else client_app(msg, context)

    # max-update-ratio 0: the huge updates pass the runner's size check, to reach the step
    keys = {"strategy": "fedbuff", "buffer-size": 4, "server-lr": 2.0, "num-rounds": 6, "max-update-ratio": 0.0}
    out, summary = small_run("refused", client_app=wrap(partly_huge), **keys)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    refused = [e for e in events(out) if e["outcome"] == "refused-step"]
    assert [r["refused-steps"] for r in rows] == [0, 1, 1, 0, 0, 0] and len(refused) == 2
    assert all("non-finite model: global" in e["reason"] for e in refused)
    # rounds 2 and 3 went back to version 1; the steps after them make versions 2, 3, 4
    assert [r["version"] for r in rows] == [1, 1, 1, 2, 3, 4] and summary["final-version"] == 4
    final = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in final.values())
    assert math.isfinite(summary["final-test-accuracy"])
    # with a norm bound the same updates are clipped and every step is kept (absolute: a median of three hostile
    # updates in four is theirs)
    seen.clear()
    out, summary = small_run("bounded", client_app=wrap(partly_huge), **keys, **{"update-norm-bound": 10.0})
    assert summary["final-version"] == 6 and not [e for e in events(out) if e["outcome"] == "refused-step"]
    # by default they are rejected as they arrive: over max-update-ratio x the model they started from
    seen.clear()
    out, summary = small_run("default", client_app=wrap(partly_huge), **{**keys, "max-update-ratio": 100.0})
    rejected = [e for e in events(out) if e["outcome"] == "rejected"]
    assert len(rejected) == 6 and all("over max-update-ratio 100" in e["reason"] for e in rejected)
    assert not [e for e in events(out) if e["outcome"] == "refused-step"]


# -- the robust options (strategies/robust.py) ------------------------------------------------------------------

def deltas_of(*rows: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(r) for r in rows]


def test_the_norm_bound_clips_to_the_absolute_bound_and_to_a_multiple_of_the_recent_median():
    d = deltas_of([3.0, 4.0], [0.3, 0.4], [30.0, 40.0])  # norms 5, 0.5, 50
    out = clip(d, RobustConfig(update_norm_bound=1.0), [])
    assert [round(float(x.norm()), 6) for x in out] == [1.0, 0.5, 1.0]
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8]))  # the direction is kept
    recent = [1.0] * 5  # the median of the last norms and the step's own: 1, so the bound is 2
    out = clip(d, RobustConfig(update_norm_multiple=2.0), recent)
    assert [round(float(x.norm()), 6) for x in out] == [2.0, 0.5, 2.0]
    assert recent[-3:] == pytest.approx([5.0, 0.5, 50.0])
    assert clip(d, RobustConfig(), []) == d  # both keys 0: nothing changes


@pytest.mark.parametrize("aggregation", ["trimmed-mean", "median"])
def test_the_robust_means_are_coordinate_wise_and_keep_only_the_steps_length(aggregation):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(7, 5))
    values[0] *= 100  # one scaled update
    config = RobustConfig(aggregation=aggregation, trim_fraction=0.2)
    weights = [0.1, 0.3, 0.05, 0.15, 0.2, 0.1, 0.1]
    got = weighted_sum([torch.tensor(v, dtype=torch.float32) for v in values], weights, torch.zeros(5), config, [])
    ordered = np.sort(values.astype(np.float32), axis=0)
    expected = np.median(ordered, axis=0) if aggregation == "median" else ordered[1:6].mean(axis=0)  # ⌊0.2·7⌋ = 1
    # the weights set only the length: they sum to 1 here
    assert np.allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)
    even = weighted_sum(deltas_of([1.0], [2.0], [10.0], [4.0]), [0.25] * 4, torch.zeros(1),
                        RobustConfig(aggregation="median"), [])
    assert float(even) == pytest.approx(3.0)  # the median of an even count: its two middle values' mean


def test_a_liar_about_its_examples_or_a_scaled_update_does_not_take_fedavg_over_with_a_robust_mean():
    honest = [Update(c, 0, torch.full((4,), 0.1), 100) for c in range(9)]
    liar = Update(9, 0, torch.full((4,), -0.1), 10**9)  # sign-flipped, and claims a billion examples
    scaled = Update(9, 0, torch.full((4,), 0.1 * -100), 100)
    params = torch.zeros(4)
    assert float(fedavg_step(params, [*honest, liar])[0]) < -0.09  # plain FedAvg: the liar's update is the step
    assert float(fedavg_step(params, [*honest, scaled])[0]) < -0.8
    for config in (RobustConfig(aggregation="median"), RobustConfig(aggregation="trimmed-mean")):
        for bad in (liar, scaled):
            assert float(fedavg_step(params, [*honest, bad], config, [])[0]) == pytest.approx(0.1)
    bounded = fedavg_step(params, [*honest, scaled], RobustConfig(update_norm_multiple=1.0), [])
    assert float(bounded[0]) == pytest.approx(0.9 * 0.1 - 0.1 * 0.1, abs=1e-6)  # clipped to the median norm 0.2


def test_the_robust_keys_belong_to_the_averaging_methods_and_a_method_they_do_not_fit_refuses_them():
    for strategy in ("fedavg", "fedbuff", "fedft", "hfcl"):
        assert load_config({"strategy": strategy, "aggregation": "median"}).options["aggregation"] == "median"
    for strategy in ("fedasync", "ca2fl", "feddle"):
        assert load_config({"strategy": strategy, "update-norm-bound": 1.0}).options["update-norm-bound"] == 1.0
    with pytest.raises(ConfigError, match="'aggregation'.*fedasync"):
        load_config({"strategy": "fedasync", "aggregation": "median"})  # one update a step: nothing to trim
    with pytest.raises(ConfigError, match="'update-norm-bound'.*fedmerge"):
        load_config({"strategy": "fedmerge", "update-norm-bound": 1.0})
    with pytest.raises(ConfigError, match="'aggregation' = 'median'.*whole anchors"):
        build_strategy("feddle", {"aggregation": "median"})


def test_the_norm_history_is_state_a_checkpoint_keeps():
    strategy = build_strategy("fedbuff", {"update-norm-multiple": 2.0, "buffer-size": 2})
    strategy.initialize(torch.zeros(3), SPEC)
    for c in range(2):
        strategy.receive(Update(c, 0, torch.ones(3) * (c + 1), 1))
    strategy.step()
    assert len(strategy.state_dict()["recent_norms"]) == 2
    assert Counter(round(n, 4) for n in strategy.recent_norms) == Counter([round(math.sqrt(3), 4),
                                                                         round(2 * math.sqrt(3), 4)])
