"""Datasets, the server's splits and client partitions.

Every dataset is loaded into memory as float32 images ``(N, C, H, W)`` and int64 labels.
The data is then split, deterministically from the run's seed, into

* ``test``    — the server's test split (the evaluation set of the global model),
* ``central`` — the server's held-out central split (taken from the test split, as the papers do; with
  ``central-classes``, the training samples of those classes instead: a label shift, as the mixing paper),
* ``train``   — the decentralised data, partitioned over the clients; with ``client-test-fraction`` (and
  ``client-validation-fraction``) each client's partition is split again into its own train, validation
  and test parts, for personalised evaluation.

Client partitions come from flwr-datasets partitioners run on an in-memory ``datasets.Dataset``,
so a node computes its own partition from the same spec and its ``partition-id``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from common import datasets as _ds
from common import partitions
from common.config import COUNT, POSITIVE, ClassList, OneOf, Range, option, part_of
from common.datasets import ArrayDataset, class_ids
from common.errors import ConfigError
from common.user_code import is_import_path, load_user_dataset


def digits_file() -> Path | None:
    """scikit-learn's copy of the UCI digits (a CSV of 64 pixels and the label a row), found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def _digits(root: Path) -> ArrayDataset:
    # scikit-learn ships the UCI digits inside its wheel: real data, no download. Read from its file rather than
    # through load_digits, whose import (scipy with it) cost every process that loads digits ~1.4 CPU s: a device's
    # first message, a ServerApp, ten times more on an emulated arm64 device.
    if (path := digits_file()) is not None:
        table = np.loadtxt(path, delimiter=",")
        pixels, target = table[:, :-1], table[:, -1]
    else:  # a scikit-learn that moved the file
        from sklearn.datasets import load_digits

        d = load_digits()
        pixels, target = d.data, d.target
    x = pixels.reshape(-1, 1, 8, 8).astype(np.float32) / 16.0
    return ArrayDataset(x, target.astype(np.int64), 10)


def _synthetic(root: Path) -> ArrayDataset:
    """Four Gaussian classes of 8x8 images, fixed forever (its own seed), for fast unit tests."""
    rng = np.random.default_rng(1234)
    num_classes, per_class = 4, 100
    means = rng.normal(0.0, 1.0, size=(num_classes, 1, 8, 8)).astype(np.float32)
    y = np.repeat(np.arange(num_classes), per_class)
    x = means[y] + rng.normal(0.0, 0.7, size=(len(y), 1, 8, 8)).astype(np.float32)
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64), num_classes)


# name -> loader(root): the loader reads its files below `root` (the run's data-root) or says where
# to put them (common/datasets.py); digits and synthetic need no files. Any folder of class
# sub-folders below root is "imagefolder:<folder>".
DATASETS: dict[str, Callable[[Path], ArrayDataset]] = {
    "digits": _digits, "synthetic": _synthetic,
    "animal-mnist": _ds.animal_mnist, "fashion-mnist": _ds.fashion_mnist,
    "cifar10": _ds.cifar10, "cifar100": _ds.cifar100, "cifar100-coarse": _ds.cifar100_coarse,
    "femnist": _ds.femnist, "femnist40": _ds.femnist40,
    "celeba-smiling": _ds.celeba_smiling, "isic2019": _ds.isic2019,
}
IMAGEFOLDER = "imagefolder:"


def is_dataset(name: str) -> bool:
    """A registered dataset, ``imagefolder:<folder>``, or a user's loader ``module:function`` (common/user_code.py)."""
    if name.startswith(IMAGEFOLDER):
        return len(name) > len(IMAGEFOLDER)
    return name in DATASETS or is_import_path(name)


PARTITIONERS = tuple(partitions.PARTITIONERS)


@lru_cache(maxsize=4)
def load_dataset(name: str, root: str = "data") -> ArrayDataset:
    """The whole dataset `name` (files below `root`), cached per process."""
    if name.startswith(IMAGEFOLDER):
        return _ds.imagefolder(name.removeprefix(IMAGEFOLDER))(Path(root).expanduser())
    if name in DATASETS:
        return DATASETS[name](Path(root).expanduser())
    if is_import_path(name):
        return load_user_dataset(name, root)
    raise KeyError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}, '{IMAGEFOLDER}<folder>' or your own "
                   "'module:function'")


def dataset_names() -> list[str]:
    """The registered datasets and the image-folder form (what an error lists)."""
    return [*DATASETS, f"{IMAGEFOLDER}<folder>"]


@dataclass(frozen=True)
class DatasetName(OneOf):
    """A registered dataset, ``imagefolder:<folder>`` (class sub-folders below data-root), or a loader of yours."""

    def ok(self, v: str) -> bool:
        return is_dataset(v) or (v == "" and "" in set(self.allowed()))

    def describe(self) -> str:
        return super().describe() + ", or your own loader 'module:function'"

    def short(self) -> str:
        return "see [Data](data-and-models.md#data)"


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The data keys: what a node needs to rebuild the same splits and its own partition. Travels in every
    message's config under the same keys (a node may set its own ``data-root``)."""

    seed: int = option(0, Range(0), "fixes partitions, sampling, delays, initialisation and local shuffling")
    dataset: str = option("digits", DatasetName(dataset_names), "the clients' dataset")
    partitioner: str = option("dirichlet", OneOf(PARTITIONERS), "how client data is split (common/partitions.py)")
    dirichlet_alpha: float = option(0.5, POSITIVE, "Dirichlet concentration (smaller = more skewed)")
    num_clients: int = option(10, COUNT, "client partitions (= SuperNodes)")
    classes_per_client: int = option(2, COUNT, "pathological: classes each client holds (#C=k)")
    num_clusters: int = option(5, COUNT, "clusters: class groups, each owned by a block of clients (FedMerge Cluster)")
    cluster_alpha: float = option(0.0, Range(0), "clusters: Dirichlet α within a group (FedMerge code: 10); 0 = IID")
    cluster_sizes: str = option("equal", OneOf(("equal", "fedmerge")),
                                "clusters: clients per group, equal or FedMerge's random uneven sizes")
    cluster_classes: int = option(0, Range(0), "clusters: classes per group drawn as FedMerge's code does, later "
                                  "groups reusing classes (code: 30 of CIFAR-100's 100); 0 = disjoint equal groups")
    label_noise: float = option(0.0, Range(0, 1), "fraction of client training labels set to a random other class "
                                "(Zhu et al. 2025, Guided Model Merging for Hybrid Data Learning, Table 4)")
    data_fraction: float = option(1.0, Range(0, 1, low_open=True),
                                  "stratified, seeded share of the dataset in use, drawn before any split (fewer "
                                  "samples per client: FedMerge's per-class counts on Fashion-MNIST); 1 = all")
    test_fraction: float = option(0.2, Range(0, 0.9, low_open=True),
                                  "stratified fraction of the data kept as the server's test split")
    binary_positive: str = option("", ClassList(), "a two-class task: these classes become label 1, every other "
                                  "class label 0 (the mixing paper's smiling / not smiling); \"\" = the dataset's "
                                  "labels")
    central_classes: str = option("", ClassList(), "label shift (the mixing paper): the training samples of these "
                                  "classes leave the clients and become the server's central split (`central-size` of "
                                  "them, 0 = all); the test split keeps every class")
    central_size: int = option(0, Range(0), "samples moved from the test split to the server's in-domain central "
                               "split (held out with `server-dataset` too, so ID and OOD runs test on the same "
                               "samples)")
    validation_size: int = option(0, Range(0), "samples moved from the test split to a validation split, evaluated "
                                  "beside it (`val-accuracy`); tune on it, never on the test split")
    client_test_fraction: float = option(0.0, Range(0, 0.9), "share of each client's partition held out as its own "
                                         "test split, for personalised evaluation (FedMerge's code: 1/6); 0 = none")
    client_validation_fraction: float = option(0.0, Range(0, 0.9), "share of each client's partition held out as its "
                                               "own validation split (FedMerge's code: 1/12, a tenth of the rest)")
    data_root: str = option("data", None, "folder with the datasets' files (a SuperNode may set its own with "
                            "`--node-config 'data-root=\"/path\"'`)", "path")


@dataclass(frozen=True)
class Splits:
    train: ArrayDataset
    test: ArrayDataset
    central: ArrayDataset
    validation: ArrayDataset


def _stratified_split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Indices (rest, taken) with `fraction` of every class taken."""
    taken = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        taken.append(idx[: int(round(fraction * len(idx)))])
    taken_idx = np.sort(np.concatenate(taken))
    return np.setdiff1d(np.arange(len(y)), taken_idx), taken_idx


def binary(data: ArrayDataset, positive: str) -> ArrayDataset:
    """`data` as a two-class task: the classes in `positive` (``binary-positive``) are label 1, the others 0."""
    ids = class_ids(positive)
    if max(ids) >= data.num_classes:
        raise ConfigError("binary-positive", positive, f"class ids of the dataset, 0..{data.num_classes - 1}")
    return replace(data, y=np.isin(data.y, ids).astype(np.int64), num_classes=2, fine=None)


def task_data(spec: DataSpec) -> ArrayDataset:
    """The whole dataset as the run's task sees it (``binary-positive`` applied): its sample shape and class count
    size the model on the server and on every client."""
    full = load_dataset(spec.dataset, spec.data_root)
    return binary(full, spec.binary_positive) if spec.binary_positive else full


@lru_cache(maxsize=8)
def make_splits(spec: DataSpec) -> Splits:
    """Train / test / central / validation splits of the spec's dataset (its ``data-fraction`` of it), fixed by
    the spec's seed.

    Central and validation samples are taken from the test split (central first, so adding a
    validation split leaves the central split as it was). With ``central-classes`` (a label shift) the
    central split is instead the training samples of those classes (``central-size`` of them, 0 = all),
    which the clients no longer hold; test and validation keep every class."""
    full = task_data(spec)
    if spec.data_fraction < 1:  # its own stream: with every sample in use the splits are as before
        full = full.subset(_stratified_split(full.partition_labels, spec.data_fraction,
                                             np.random.default_rng([spec.seed, 7]))[1])
    rng = np.random.default_rng([spec.seed, 0])
    train_idx, test_idx = _stratified_split(full.y, spec.test_fraction, rng)
    shift = class_ids(spec.central_classes)
    c, v = (0 if shift else spec.central_size), spec.validation_size
    if c + v >= len(test_idx):
        raise ConfigError("central-size", c, f"fewer than the test split's {len(test_idx)} samples together with "
                          f"validation-size {v}, so some are left to test on (raise test-fraction or lower them)")
    test_idx = rng.permutation(test_idx)
    central_idx, val_idx, test_idx = np.split(test_idx, [c, c + v])
    if shift:
        if max(shift) >= full.num_classes:
            raise ConfigError("central-classes", spec.central_classes, f"class ids of the dataset, "
                              f"0..{full.num_classes - 1}")
        moved = np.isin(full.y[train_idx], shift)
        central_idx = np.random.default_rng([spec.seed, 6]).permutation(train_idx[moved])
        central_idx = central_idx[: spec.central_size or len(central_idx)]
        train_idx = train_idx[~moved]
    return Splits(full.subset(train_idx), full.subset(np.sort(test_idx)), full.subset(np.sort(central_idx)),
                  full.subset(np.sort(val_idx)))


@lru_cache(maxsize=8)
def partition_indices(spec: DataSpec) -> tuple[np.ndarray, ...]:
    """Indices into the train split for every partition (coverage per scheme: see common/partitions.py)."""
    train = make_splits(spec).train
    return partitions.partition(
        spec.partitioner, train.partition_labels, spec.num_clients, spec.seed, groups=train.groups,
        alpha=spec.dirichlet_alpha, classes_per_client=spec.classes_per_client, num_clusters=spec.num_clusters,
        cluster_alpha=spec.cluster_alpha, cluster_sizes=spec.cluster_sizes, cluster_classes=spec.cluster_classes)


@lru_cache(maxsize=8)
def client_labels(spec: DataSpec) -> np.ndarray:
    """The train labels as clients see them: with `label-noise`, that fraction of the samples in use
    (in any partition) carries a random other class. The server's splits are never touched."""
    train = make_splits(spec).train
    if spec.label_noise == 0:
        return train.y
    used = np.unique(np.concatenate(partition_indices(spec)))
    y = train.y.copy()
    y[used] = partitions.label_noise(train.y[used], spec.label_noise, train.num_classes, spec.seed)[0]
    return y


CLIENT_PARTS = ("train", "validation", "test")


def check_partitions(spec: DataSpec) -> int:
    """Cut every client's partition and holdout here, as each node will: a setting impossible for the data (more
    clusters than classes, a client left nothing to train on) stops the run at start with a ``ConfigError``, not
    on every client. Returns the fewest test samples a client holds out (0 without ``client-test-fraction``)."""
    return min(len(client_holdout(spec, i)["test"]) for i in range(spec.num_clients))


def client_holdout(spec: DataSpec, partition_id: int) -> dict[str, np.ndarray]:
    """Indices into the train split of client `partition_id`'s own train / validation / test parts: a seeded
    random split of its partition (stream ``[seed, 5, id]``; not stratified, as FedMerge's code), the held-out
    parts rounded to whole samples; with no holdout every sample is in ``train``."""
    if not 0 <= partition_id < spec.num_clients:
        raise ValueError(f"partition-id {partition_id} outside [0, {spec.num_clients})")
    idx = partition_indices(spec)[partition_id]
    n = len(idx)
    n_test, n_val = round(spec.client_test_fraction * n), round(spec.client_validation_fraction * n)
    if (spec.client_test_fraction or spec.client_validation_fraction) and n_test + n_val >= n:
        raise ConfigError("client-test-fraction", spec.client_test_fraction, f"with client-validation-fraction "
                          f"{spec.client_validation_fraction}, a holdout that leaves client {partition_id} ({n} "
                          "samples) something to train on")
    order = np.random.default_rng([spec.seed, 5, partition_id]).permutation(idx) if n_test + n_val else idx
    test, val, train = np.split(order, [n_test, n_test + n_val])
    return {"train": np.sort(train), "validation": np.sort(val), "test": np.sort(test)}


def client_sizes(spec: DataSpec) -> dict[int, dict[str, int]]:
    """The size of every client's parts, as each node cuts its own (the most ``num-examples`` its replies may
    claim): ``{client: {"train": n, "validation": v, "test": t}}``."""
    return {i: {part: len(idx) for part, idx in client_holdout(spec, i).items()} for i in range(spec.num_clients)}


def client_partition(spec: DataSpec, partition_id: int, part: str = "train") -> ArrayDataset:
    """The data of client `partition_id`: its training data, or its own held-out ``validation`` / ``test``
    part (true labels: label noise is on training labels only)."""
    if part not in CLIENT_PARTS:
        raise ValueError(f"client part {part!r}: expected one of {CLIENT_PARTS}")
    idx = client_holdout(spec, partition_id)[part]
    data = make_splits(spec).train.subset(idx)
    return data if spec.label_noise == 0 or part != "train" else replace(data, y=client_labels(spec)[idx])


def data_spec(cfg: Any) -> DataSpec:
    """The :class:`DataSpec` part of a run configuration (``server_app.config.RunConfig``)."""
    return part_of(DataSpec, cfg)
