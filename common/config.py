"""Run configuration: one typed schema, loaded from a YAML preset plus `flwr run -c` overrides.

A run's configuration is built in three layers, each overriding the one before:

1. the defaults of :class:`RunConfig` (mirrored in ``[tool.flwr.app.config]`` of pyproject.toml),
2. the YAML preset named by ``preset`` (``configs/<preset>.yaml``),
3. the keys the user gave explicitly (``flwr run -c 'k=v'``, or a dict in the in-process engine).

Keys are spelled the same everywhere: YAML, pyproject and ``-c`` use ``num-rounds``; the
dataclass field is ``num_rounds`` (hyphens become underscores, nothing else changes).
Every value is checked at start-up; a bad one raises :class:`ConfigError` naming the key,
the value and what is allowed.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key, value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config key '{key}' = {value!r} is not allowed: expected {allowed}")


@dataclass(frozen=True)
class Range:
    """A numeric interval; `low_open` excludes the lower bound."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False

    def ok(self, v: float) -> bool:
        return (v > self.low if self.low_open else v >= self.low) and v <= self.high

    def describe(self) -> str:
        lo = "(" if self.low_open else "["
        return f"a value in {lo}{self.low}, {self.high}]"


@dataclass(frozen=True)
class OneOf:
    """A name from a registry; `names` is called lazily so registries can live in other packages."""

    names: Callable[[], Iterable[str]]

    def ok(self, v: str) -> bool:
        return v in set(self.names())

    def describe(self) -> str:
        return "one of " + ", ".join(repr(n) for n in sorted(self.names()))


def _datasets() -> Iterable[str]:
    from common.data import DATASETS, IMAGEFOLDER

    return [*DATASETS, f"{IMAGEFOLDER}<folder>"]


@dataclass(frozen=True)
class DatasetName(OneOf):
    """A registered dataset, or ``imagefolder:<folder>`` (class sub-folders below data-root)."""

    def ok(self, v: str) -> bool:
        from common.data import is_dataset

        return is_dataset(v) or (v == "" and "" in set(self.names()))


def _models() -> Iterable[str]:
    from common.models import MODELS

    return MODELS


def _strategies() -> Iterable[str]:
    from strategies import STRATEGIES

    return STRATEGIES


def _partitioners() -> Iterable[str]:
    from common.data import PARTITIONERS

    return PARTITIONERS


def _presets() -> Iterable[str]:
    """Preset names: paths under configs/ without ``.yaml`` (``feddle-animal/feddle-id-dir0.1-n20``)."""
    return sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.yaml"))


def _opt(default: Any, check: Range | OneOf | None = None, doc: str = "") -> Any:
    return field(default=default, metadata={"check": check, "doc": doc})


POSITIVE = Range(0, math.inf, low_open=True)
COUNT = Range(1)


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs to know; see README "Configuration" for what each key does."""

    preset: str = _opt("fedavg-digits", OneOf(_presets), "YAML preset in configs/ applied before overrides")
    seed: int = _opt(0, Range(0), "fixes partitions, sampling, initialisation and local shuffling")
    dataset: str = _opt("digits", DatasetName(_datasets), "dataset name (common/data.py)")
    partitioner: str = _opt("dirichlet", OneOf(_partitioners), "how client data is split")
    dirichlet_alpha: float = _opt(0.5, POSITIVE, "Dirichlet concentration (smaller = more skewed)")
    num_clients: int = _opt(10, COUNT, "number of client partitions (= SuperNodes)")
    classes_per_client: int = _opt(2, COUNT, "pathological: classes each client holds (#C=k)")
    num_clusters: int = _opt(5, COUNT, "clusters: class groups, each owned by a block of clients (FedMerge Cluster)")
    cluster_alpha: float = _opt(0.0, Range(0), "clusters: Dirichlet α within a group (FedMerge code: 10); 0 = IID")
    cluster_sizes: str = _opt("equal", OneOf(lambda: ("equal", "fedmerge")),
                              "clusters: clients per group, equal or FedMerge's random uneven sizes")
    label_noise: float = _opt(0.0, Range(0, 1), "fraction of client training labels set to a random other class")
    test_fraction: float = _opt(0.2, Range(0, 0.9, low_open=True), "fraction of the data kept as the server's test split")
    central_size: int = _opt(0, Range(0), "samples moved from the test split to the server's in-domain central split "
                             "(held out with server-dataset too, so ID and OOD runs test on the same split)")
    validation_size: int = _opt(0, Range(0), "samples moved from the test split to a validation split, evaluated "
                                "beside it (val-accuracy), for tuning")
    server_dataset: str = _opt("", DatasetName(lambda: ("", *_datasets())),
                               "empty: the server holds the ID central split; a dataset name: OOD server data")
    server_dataset_size: int = _opt(0, Range(0), "with server-dataset: how many of its samples the server holds "
                                    "(0 = all)")
    data_root: str = _opt("data", None, "folder with the datasets' files (a node may override it in node_config)")
    device: str = _opt("auto", OneOf(lambda: ("auto", "cpu", "cuda")), "where server-side training runs")
    model: str = _opt("cnn", OneOf(_models), "model name (common/models.py)")
    pretrained_weights: str = _opt("", None, "local torchvision-format state_dict for resnet18 / vit-b16 (\"\" = none)")
    input_size: int = _opt(0, Range(0), "model input size; 0 = the model's default (cnn: the data's, 224, vit-small 32)")
    lora_rank: int = _opt(4, Range(0), "ViTs: LoRA rank (0 = full fine-tuning)")
    lora_alpha: float = _opt(8.0, POSITIVE, "ViTs: LoRA alpha (scaling alpha / rank)")
    lora_targets: str = _opt("q,v", None, "ViTs: comma-separated layers with adapters, from q, k, v, out_proj, mlp")
    normalize: str = _opt("", OneOf(lambda: ("", "none", "imagenet", "half")), "input normalisation; \"\" = model default")
    batch_norm: str = _opt("batch", OneOf(lambda: ("batch", "running")),
                           "resnet18: batch statistics always (batch), or running statistics (running; they do not travel)")
    cnn_width: int = _opt(32, COUNT, "cnn: channels of the first convolution (2x in the others, 4x in the hidden layer)")
    strategy: str = _opt("fedavg", OneOf(_strategies), "aggregation strategy (strategies/)")
    num_rounds: int = _opt(20, COUNT, "server rounds (steps of the asynchronous runtime)")
    clients_per_round: int = _opt(10, COUNT, "clients sampled per step (virtual clock); arrivals per step (wall)")
    loop: str = _opt("hybridfl", OneOf(lambda: ("hybridfl", "flower")),
                     "hybridfl: the runtime below; flower: Flower's own strategy.start() rounds (for comparison)")
    clock: str = _opt("virtual", OneOf(lambda: ("virtual", "wall")), "virtual: seeded delays in steps; wall: real arrival order")
    delay_sigma: float = _opt(0.0, Range(0), "σ of the half-normal client delay in server steps (0 = synchronous)")
    concurrency: int = _opt(10, COUNT, "clients kept busy by the wall clock")
    buffer_size: int = _opt(10, COUNT, "FedBuff / CA2FL: updates per server step (K)")
    server_lr: float = _opt(1.0, POSITIVE, "FedBuff / CA2FL: server learning rate η_g")
    staleness_weight: str = _opt("none", OneOf(lambda: ("none", "polynomial")), "FedBuff: weight (1+τ)^-a or none")
    staleness_exponent: float = _opt(0.5, Range(0), "FedBuff / FedAsync: staleness exponent a")
    mixing_alpha: float = _opt(0.4, Range(0, 1, low_open=True), "FedAsync: mixing weight α")
    weighting: str = _opt("uniform", OneOf(lambda: ("uniform", "examples")), "FedBuff: buffer weights 1/K or by examples")
    atlas_size: int = _opt(20, COUNT, "Feddle: M, anchors in the model atlas (papers: 2 x clients per step)")
    search_lr: float = _opt(1e-3, POSITIVE, "Feddle: learning rate of the coefficient search")
    server_epochs: int = _opt(1, Range(0), "Feddle: E_g, passes over the server data per search (0 = FedBuff step)")
    search_batch_size: int = _opt(64, COUNT, "Feddle: mini-batch of the coefficient search")
    fallback_lambda: float = _opt(0.0, Range(0), "Feddle: λ pulling c to FedBuff's c' (papers: 0 ID, 0.01 OOD)")
    fallback_init: bool = _opt(True, None, "Feddle: start the search at FedBuff's coefficients (else 0)")
    anchor_normalization: bool = _opt(True, None, "Feddle: rescale anchors to the median norm (Eq. 5)")
    importance_score: bool = _opt(True, None, "Feddle: evict the anchor with the smallest |c| (else FIFO)")
    search_diagnostics: bool = _opt(True, None, "Feddle: log the server loss before/after each search (2 passes)")
    server_train_lr: float = _opt(1e-3, POSITIVE, "Center / Fed+FT / FedDF: server training lr (grid 1e-5, 1e-4, 1e-3)")
    server_train_epochs: int = _opt(1, COUNT, "Center / Fed+FT / FedDF: server epochs per step (grid 1, 10, 20)")
    distill_temperature: float = _opt(1.0, POSITIVE, "FedDF: temperature T of the distillation's softmax")
    local_epochs: int = _opt(1, COUNT, "local epochs per client update")
    batch_size: int = _opt(32, COUNT, "local mini-batch size")
    optimizer: str = _opt("sgd", OneOf(lambda: ("sgd", "adam")), "local optimizer")
    lr: float = _opt(0.05, POSITIVE, "local learning rate")
    momentum: float = _opt(0.9, Range(0, 1), "SGD momentum (ignored by adam)")
    eval_every: int = _opt(1, COUNT, "evaluate the global model on the test split every this many rounds")
    reply_timeout_s: float = _opt(600.0, POSITIVE, "seconds a dispatched update may take before it is given up")
    poll_interval_s: float = _opt(0.05, Range(0, 1, low_open=True), "seconds between pulls for replies")
    wait_nodes_s: float = _opt(120.0, POSITIVE, "seconds to wait for num-clients nodes at start, or any node later")
    output_dir: str = _opt("outputs", None, "where outputs/<run>/ is written (absolute in deployment)")
    run_name: str = _opt("", None, "run folder; empty = <preset>-s<seed>-<timestamp>[-k], never an existing one")

    @staticmethod
    def keys() -> list[str]:
        return [to_key(f.name) for f in dataclasses.fields(RunConfig)]

    def to_dict(self) -> dict[str, Any]:
        return {to_key(k): v for k, v in dataclasses.asdict(self).items()}


def to_key(name: str) -> str:
    return name.replace("_", "-")


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:  # bool is not an int here, and "3" is not 3
        raise ConfigError(key, value, _KIND[kind])
    if kind is float and not math.isfinite(value):
        raise ConfigError(key, value, "a finite number")
    return value


def read_preset(name: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The key/value mapping of ``configs/<name>.yaml``.

    A preset may build on others: ``base: <preset>`` or ``base: [<preset>, ...]`` applies those first
    (in order, each with its own bases), then the file's own keys. So a family of presets shares one
    protocol file and each member states only what differs.
    """
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file() or ".." in Path(name).parts:
        raise ConfigError("preset", name, OneOf(_presets).describe())
    if name in _seen:
        raise ConfigError("base", name, f"a preset that does not include itself (cycle {' -> '.join(_seen + (name,))})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError("preset", name, f"a YAML mapping in {path}")
    bases = data.pop("base", [])
    layered: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        layered.update(read_preset(base, _seen + (name,)))
    return {**layered, **data}


def load_config(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Build and validate the run configuration: defaults <- preset <- `overrides`.

    `overrides` are the keys the user set explicitly (Flower's ``Run.override_config``).
    """
    overrides = dict(overrides or {})
    fields = {to_key(f.name): f for f in dataclasses.fields(RunConfig)}
    preset = overrides.get("preset", RunConfig.preset)
    _coerce("preset", preset, str)
    layered = {**read_preset(preset), **overrides, "preset": preset}
    values: dict[str, Any] = {}
    for key, value in layered.items():
        if key not in fields:
            raise ConfigError(key, value, "a known key: " + ", ".join(sorted(fields)))
        f = fields[key]
        value = _coerce(key, value, f.type)
        check = f.metadata["check"]
        if check is not None and not check.ok(value):
            raise ConfigError(key, value, check.describe())
        values[f.name] = value
    cfg = RunConfig(**values)
    if cfg.clients_per_round > cfg.num_clients:
        raise ConfigError("clients-per-round", cfg.clients_per_round, f"at most num-clients = {cfg.num_clients}")
    return cfg
