"""Flat parameters: model <-> flat tensor <-> ArrayRecord, and what a bad record is rejected for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from common.models import build_model
from common.params import BadArrays, ParamSpec


@pytest.fixture
def model():
    return build_model("cnn", 1, 8, 10, seed=0)


def test_round_trip_model_flat_record(model):
    spec = ParamSpec.of(model)
    flat = spec.flatten(model)
    assert flat.dtype == torch.float32 and flat.numel() == spec.numel == sum(p.numel() for p in model.parameters())
    back = spec.from_record(spec.to_record(flat))
    assert torch.equal(back, flat)
    other = build_model("cnn", 1, 8, 10, seed=1)
    assert not torch.equal(spec.flatten(other), flat)
    spec.load_into(other, flat)
    assert torch.equal(spec.flatten(other), flat)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n


def test_only_trainable_parameters_travel(model):
    for p in model.body.parameters():
        p.requires_grad_(False)
    spec = ParamSpec.of(model)
    assert spec.names == ("head.weight", "head.bias")
    assert spec.numel == model.head.weight.numel() + model.head.bias.numel()


def test_record_is_keyed_by_parameter_name(model):
    spec = ParamSpec.of(model)
    record = spec.to_record(spec.flatten(model))
    assert list(record.keys()) == [n for n, _ in model.named_parameters()]
    np.testing.assert_array_equal(record["head.bias"].numpy(), model.head.bias.detach().numpy())


def _tamper(spec: ParamSpec, flat: torch.Tensor, name: str, fn) -> ArrayRecord:
    arrays = {n: a.numpy() for n, a in spec.to_record(flat).items()}
    arrays = fn(arrays)
    return ArrayRecord([arrays[n] for n in arrays]) if name == "unnamed" else \
        ArrayRecord({n: torch.from_numpy(np.asarray(a)) for n, a in arrays.items()})


@pytest.mark.parametrize(
    ("case", "fn", "message"),
    [
        ("shape", lambda a: {**a, "head.bias": np.zeros(11, np.float32)}, "shape"),
        ("nan", lambda a: {**a, "head.bias": np.full(10, np.nan, np.float32)}, "non-finite"),
        ("inf", lambda a: {**a, "head.weight": a["head.weight"] * np.inf}, "non-finite"),
        ("missing", lambda a: {k: v for k, v in a.items() if k != "head.bias"}, "missing"),
        ("dtype", lambda a: {**a, "head.bias": np.zeros(10, np.int64)}, "dtype"),
        ("unnamed", lambda a: a, "names"),
    ],
)
def test_bad_records_are_rejected_with_a_reason(model, case, fn, message):
    spec = ParamSpec.of(model)
    with pytest.raises(BadArrays, match=message):
        spec.from_record(_tamper(spec, spec.flatten(model), case, fn))
