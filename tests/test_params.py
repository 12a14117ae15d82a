"""Flat parameters: model <-> flat tensor <-> ArrayRecord, and what a bad record is rejected for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from common.models import build_model
from common.params import WIRE_KEY, BadArrays, ParamSpec


@pytest.fixture
def model():
    return build_model("cnn", 1, 8, 10, seed=0)


def test_round_trip_model_flat_record(model):
    spec = ParamSpec.of(model)
    flat = spec.flatten(model)
    assert flat.dtype == torch.float32 and flat.numel() == spec.numel == sum(p.numel() for p in model.parameters())
    record = spec.to_record(flat)
    back = spec.from_record(record)
    assert torch.equal(back, flat)
    back += 1  # the decoded tensor is ours to change; the record is untouched
    assert torch.equal(spec.from_record(record), flat)
    other = build_model("cnn", 1, 8, 10, seed=1)
    assert not torch.equal(spec.flatten(other), flat)
    spec.load_into(other, flat)
    assert torch.equal(spec.flatten(other), flat)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n


def test_flat_layout_follows_named_parameters(model):
    spec = ParamSpec.of(model)
    flat = spec.flatten(model)
    np.testing.assert_array_equal(flat[-10:].numpy(), model.head.bias.detach().numpy())
    assert ParamSpec.of_record(spec.to_record(flat)).numel == spec.numel


def test_only_trainable_parameters_travel(model):
    for p in model.body.parameters():
        p.requires_grad_(False)
    spec = ParamSpec.of(model)
    assert spec.names == ("head.weight", "head.bias")
    assert spec.numel == model.head.weight.numel() + model.head.bias.numel()
    assert spec.to_record(spec.flatten(model))[WIRE_KEY].shape == (spec.numel,)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (lambda n: ArrayRecord({WIRE_KEY: torch.zeros(n + 1)}), "shape"),
        (lambda n: ArrayRecord({WIRE_KEY: torch.zeros(1, n)}), "shape"),
        (lambda n: ArrayRecord({WIRE_KEY: torch.full((n,), float("nan"))}), "non-finite"),
        (lambda n: ArrayRecord({WIRE_KEY: torch.zeros(n).index_fill_(0, torch.tensor([3]), float("inf"))}),
         "non-finite"),
        (lambda n: ArrayRecord({WIRE_KEY: torch.zeros(n, dtype=torch.int64)}), "dtype"),
        (lambda n: ArrayRecord({"weights": torch.zeros(n)}), "one array"),
        (lambda n: ArrayRecord({WIRE_KEY: torch.zeros(n), "extra": torch.zeros(1)}), "one array"),
    ],
)
def test_bad_records_are_rejected_with_a_reason(model, record, message):
    spec = ParamSpec.of(model)
    with pytest.raises(BadArrays, match=message):
        spec.from_record(record(spec.numel))
