"""Splits and partitions: deterministic from the seed, every training sample in exactly one partition."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, from_keys, options_dict
from common.splits import DataSpec, client_holdout, client_partition, load_dataset, make_splits, partition_indices


def spec(**kw) -> DataSpec:
    base = dict(dataset="digits", seed=0, partitioner="dirichlet", dirichlet_alpha=0.5, num_clients=10,
                test_fraction=0.2, central_size=100)
    return DataSpec(**{**base, **kw})


def test_digits_is_the_real_uci_set():
    d = load_dataset("digits")
    assert d.x.shape == (1797, 1, 8, 8) and d.x.dtype == np.float32 and d.num_classes == 10
    assert d.x.min() >= 0.0 and d.x.max() <= 1.0 and np.bincount(d.y).min() >= 170


def test_digits_read_from_scikit_learns_file_are_load_digits_bit_for_bit(monkeypatch):
    from sklearn.datasets import load_digits

    import common.splits as splits

    ref = load_digits()
    expected = (ref.images.astype(np.float32) / 16.0)[:, None, :, :]
    assert splits.digits_file() is not None  # this scikit-learn's file is read, not its loader
    from_file = splits._digits(Path("."))
    monkeypatch.setattr(splits, "digits_file", lambda: None)  # a scikit-learn that moved the file: its loader
    for d in (from_file, splits._digits(Path("."))):
        assert d.x.tobytes() == expected.tobytes() and np.array_equal(d.y, ref.target) and d.y.dtype == np.int64


def test_loading_digits_does_not_import_scikit_learn():
    # its import (scipy with it) was most of a device's first message on digits
    code = ("import sys; from common.splits import load_dataset; load_dataset('digits'); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"


def test_splits_are_disjoint_stratified_and_central_comes_from_test():
    s = make_splits(spec())
    full = load_dataset("digits")
    assert len(s.train) + len(s.test) + len(s.central) == len(full)
    assert len(s.central) == 100
    # Row sets are disjoint (digits has a few duplicate images, so compare multisets by count).
    rows = lambda d: {r.tobytes() for r in d.x.reshape(len(d), -1)}
    assert len(rows(s.train) & rows(s.test)) < 5
    assert abs(len(s.test) + len(s.central) - 0.2 * len(full)) <= 10
    test_share = np.bincount(np.concatenate([s.test.y, s.central.y]), minlength=10) / (len(s.test) + len(s.central))
    np.testing.assert_allclose(test_share, np.bincount(full.y) / len(full), atol=0.01)
    without_central = make_splits(spec(central_size=0))
    assert len(without_central.test) == len(s.test) + len(s.central)


def test_central_larger_than_test_split_is_an_error():
    with pytest.raises(ValueError, match="central-size"):
        make_splits(spec(central_size=10_000))


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_every_training_sample_in_exactly_one_partition(partitioner):
    s = spec(partitioner=partitioner)
    parts = partition_indices(s)
    assert len(parts) == 10 and all(len(p) > 0 for p in parts)
    merged = np.concatenate(parts)
    assert len(merged) == len(make_splits(s).train) and len(np.unique(merged)) == len(merged)


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_partitions_are_fixed_by_the_seed(partitioner):
    a, b, c = (partition_indices(spec(partitioner=partitioner, seed=sd)) for sd in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def label_skew(s: DataSpec) -> float:
    """Mean total-variation distance between client label distributions and the global one."""
    y = make_splits(s).train.y
    glob = np.bincount(y, minlength=10) / len(y)
    return float(np.mean([0.5 * np.abs(np.bincount(y[p], minlength=10) / len(p) - glob).sum()
                          for p in partition_indices(s)]))


def test_lower_alpha_gives_more_skewed_labels_and_iid_is_balanced():
    iid, mild, strong = label_skew(spec(partitioner="iid")), label_skew(spec(dirichlet_alpha=5.0)), \
        label_skew(spec(dirichlet_alpha=0.1))
    assert iid < 0.1 < mild < strong


def test_client_partition_matches_indices_and_checks_its_id():
    s = spec()
    part = client_partition(s, 3)
    np.testing.assert_array_equal(part.y, make_splits(s).train.y[partition_indices(s)[3]])
    with pytest.raises(ValueError, match="partition-id 10"):
        client_partition(s, 10)


def test_a_client_holds_out_its_own_test_and_validation_parts_of_its_partition():
    s = spec(client_test_fraction=1 / 6, client_validation_fraction=1 / 12, label_noise=0.3)
    for pid in (0, 7):
        parts = client_holdout(s, pid)
        whole = partition_indices(s)[pid]
        np.testing.assert_array_equal(np.sort(np.concatenate(list(parts.values()))), whole)  # disjoint, complete
        assert len(parts["test"]) == round(len(whole) / 6) and len(parts["validation"]) == round(len(whole) / 12)
        for name, idx in parts.items():
            np.testing.assert_array_equal(client_partition(s, pid, name).x, make_splits(s).train.x[idx])
        # label noise is on training labels only: the held-out parts keep the true labels
        np.testing.assert_array_equal(client_partition(s, pid, "test").y, make_splits(s).train.y[parts["test"]])
    assert all(np.array_equal(a, b) for a, b in zip(client_holdout(s, 3).values(), client_holdout(s, 3).values()))
    moved = client_holdout(spec(client_test_fraction=1 / 6, client_validation_fraction=1 / 12, seed=1), 3)["test"]
    assert not np.array_equal(moved, client_holdout(spec(client_test_fraction=1 / 6, client_validation_fraction=1 / 12,
                                                         seed=2), 3)["test"])
    # no holdout: the partition is the training data, as before
    train = make_splits(spec()).train
    np.testing.assert_array_equal(client_partition(spec(), 3).y, train.y[partition_indices(spec())[3]])
    assert len(client_partition(spec(), 3, "test")) == 0
    with pytest.raises(ValueError, match=r"'client-test-fraction' = 0.9 .*leaves client 0 \(\d+ samples\) "
                                         r"something to train on"):
        client_holdout(spec(client_test_fraction=0.9, client_validation_fraction=0.9), 0)
    with pytest.raises(ValueError, match="client part 'val'"):
        client_partition(s, 0, "val")


def test_spec_round_trips_through_message_config():
    s = spec(dataset="synthetic", num_clients=3, label_noise=0.1, data_root="/elsewhere")
    config = options_dict(s)
    assert config["num-clients"] == 3 and config["data-root"] == "/elsewhere"  # the keys of the run config
    assert from_keys(DataSpec, config) == s
    with pytest.raises(ConfigError, match="'label-noise' = 2.0"):  # a node checks what it is sent too
        from_keys(DataSpec, {**config, "label-noise": 2.0})
    with pytest.raises(KeyError, match="DataSpec keys missing: data-root, seed"):  # and that it came whole
        from_keys(DataSpec, {k: v for k, v in config.items() if k not in ("seed", "data-root")})


def test_server_data_in_domain_is_the_central_split_and_out_of_domain_another_dataset():
    import torch

    from common.server_data import build_server_data, resolve_device
    from common.splits import data_spec
    from server_app.config import load_config

    cfg = load_config({"central-size": 50})
    splits = make_splits(data_spec(cfg))
    sd = build_server_data(cfg, splits)
    assert sd.in_domain and len(sd) == 50 and sd.device == torch.device("cpu")
    np.testing.assert_array_equal(sd.data.y, splits.central.y)
    x, y = sd.tensors()
    assert x.shape == (50, 1, 8, 8) and y.dtype == torch.int64
    assert build_server_data(load_config({}), make_splits(data_spec(load_config({})))) is None  # no central data

    ood_cfg = load_config({"dataset": "digits", "server-dataset": "synthetic", "server-dataset-size": 40,
                           "central-size": 50})
    ood_splits = make_splits(data_spec(ood_cfg))
    # The ID central split is held out anyway: ID and OOD runs test on the same samples.
    np.testing.assert_array_equal(ood_splits.test.y, splits.test.y)
    ood = build_server_data(ood_cfg, ood_splits)
    assert not ood.in_domain and len(ood) == 40 and ood.data.num_classes == 4
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_validation_split_comes_from_the_test_split_and_leaves_the_central_split_alone():
    without, with_val = make_splits(spec(central_size=60)), make_splits(spec(central_size=60, validation_size=40))
    np.testing.assert_array_equal(without.central.x, with_val.central.x)
    assert len(with_val.validation) == 40 and len(with_val.test) == len(without.test) - 40
    np.testing.assert_array_equal(with_val.train.y, without.train.y)  # clients keep their data
    rows = lambda d: {r.tobytes() for r in d.x.reshape(len(d), -1)}
    validation = rows(with_val.validation)
    assert not validation & rows(with_val.test) and not validation & rows(with_val.central)
    with pytest.raises(ValueError, match=r"'central-size' = 100 .*fewer than the test split's 359 "
                                         r"samples together with validation-size 400"):
        make_splits(spec(validation_size=400))


def test_data_fraction_keeps_a_stratified_seeded_share_and_every_split_comes_from_it():
    splits = lambda **kw: make_splits(spec(central_size=20, **kw))
    full, whole, part = load_dataset("digits"), splits(), splits(data_fraction=0.25)
    used = np.concatenate([part.train.y, part.test.y, part.central.y])
    np.testing.assert_array_equal(np.bincount(used, minlength=10), np.round(0.25 * np.bincount(full.y)))
    rows = lambda d: {r.tobytes() for r in d.x.reshape(len(d), -1)}
    assert len(rows(part.train) - rows(whole.train) - rows(whole.test) - rows(whole.central)) == 0
    assert len(rows(part.train) & rows(part.test)) < 5  # still disjoint (digits has a few duplicate images)
    np.testing.assert_array_equal(splits(data_fraction=0.25).train.x, part.train.x)  # seeded
    assert not np.array_equal(splits(data_fraction=0.25, seed=1).train.y[:50], part.train.y[:50])
    assert sum(len(p) for p in partition_indices(spec(data_fraction=0.25, central_size=20))) == len(part.train)
    np.testing.assert_array_equal(splits(data_fraction=1.0).train.x, whole.train.x)  # 1 = as before


def test_label_noise_touches_exactly_the_asked_fraction_of_client_labels_and_no_server_label():
    noisy, clean = spec(label_noise=0.3), spec()
    parts = [client_partition(noisy, i) for i in range(10)]
    clean_parts = [client_partition(clean, i) for i in range(10)]
    changed = sum(int((a.y != b.y).sum()) for a, b in zip(parts, clean_parts))
    assert changed == round(0.3 * sum(len(p) for p in parts))
    for a, b in zip(parts, clean_parts):
        np.testing.assert_array_equal(a.x, b.x)  # same samples, only labels differ
    s_noisy, s_clean = make_splits(noisy), make_splits(clean)
    np.testing.assert_array_equal(s_noisy.test.y, s_clean.test.y)
    np.testing.assert_array_equal(s_noisy.central.y, s_clean.central.y)
    np.testing.assert_array_equal(s_noisy.train.y, s_clean.train.y)


def test_ood_digits_feed_a_model_built_for_animal_mnist_clients():
    """The papers' offline OOD setting: Animal-MNIST (1×28×28) clients, scikit-learn digits (1×8×8)
    on the server; the model's input adapter upsamples the digits."""
    from common.models import build_from_config
    from common.server_data import build_server_data
    from common.splits import data_spec
    from server_app.config import load_config

    cfg = load_config({"dataset": "animal-mnist", "server-dataset": "digits", "server-dataset-size": 100})
    splits = make_splits(data_spec(cfg))
    clients = load_dataset("animal-mnist")
    assert clients.x.shape[1:] == (1, 28, 28) and len(clients) == 10_000
    server = build_server_data(cfg, splits)
    assert not server.in_domain and len(server) == 100 and server.data.x.shape[1:] == (1, 8, 8)
    model = build_from_config(cfg.to_dict(), (1, 28, 28), 10, seed=0)
    x, _ = server.tensors()
    assert model(x).shape == (100, 10) and model.features(x).shape[0] == 100


def test_a_label_shift_moves_the_central_classes_from_the_clients_to_the_server():
    """central-classes: their training samples leave the clients and become the central split (central-size of
    them, 0 = all); test and validation keep every class and are the splits the run would have without it."""
    plain = make_splits(spec(validation_size=50, central_size=0))
    shifted = make_splits(spec(validation_size=50, central_size=0, central_classes="7,9"))
    assert set(np.unique(shifted.train.y)) == set(range(10)) - {7, 9}
    assert set(np.unique(shifted.central.y)) == {7, 9}
    assert len(shifted.central) == int(np.isin(plain.train.y, [7, 9]).sum())  # every one of them
    assert len(shifted.train) + len(shifted.central) == len(plain.train)
    np.testing.assert_array_equal(shifted.test.y, plain.test.y)
    np.testing.assert_array_equal(shifted.validation.x, plain.validation.x)
    capped = make_splits(spec(central_classes="7,9", central_size=30))
    assert len(capped.central) == 30 and set(np.unique(capped.central.y)) <= {7, 9}
    held = np.concatenate([client_partition(spec(central_classes="7,9"), c).y for c in range(10)])
    assert len(held) == len(shifted.train) and not np.isin(held, [7, 9]).any()


def test_a_binary_task_maps_the_positive_classes_to_1_and_the_rest_to_0():
    full, binary = load_dataset("digits"), make_splits(spec(binary_positive="1,3,5"))
    label_of = {x.tobytes(): y for x, y in zip(full.x, full.y)}
    for split in (binary.train, binary.test, binary.central):
        original = np.array([label_of[x.tobytes()] for x in split.x])
        np.testing.assert_array_equal(split.y, np.isin(original, [1, 3, 5]).astype(np.int64))
    assert binary.train.num_classes == 2 and len(binary.train) + len(binary.test) + len(binary.central) == len(full)
    clients_positive = make_splits(spec(binary_positive="1,3,5", central_classes="0"))
    assert set(np.unique(clients_positive.train.y)) == {1} and set(np.unique(clients_positive.central.y)) == {0}


@pytest.mark.parametrize("key,value", [("central-classes", "7,x"), ("central-classes", "3,3"),
                                       ("binary-positive", "-1")])
def test_bad_class_lists_fail_at_start_naming_the_key(key, value):
    from common.config import ConfigError
    from server_app.config import load_config

    with pytest.raises(ConfigError, match=key):
        load_config({key: value})
    with pytest.raises(ValueError, match="central-classes"):
        make_splits(spec(central_classes="12"))
