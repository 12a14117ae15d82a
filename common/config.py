"""Run configuration: the option machinery, the run-level keys, and YAML presets.

A run's configuration is built in three layers, each overriding the one before:

1. the defaults (mirrored in ``[tool.flwr.app.config]`` of pyproject.toml),
2. the YAML preset named by ``preset`` (``configs/<preset>.yaml``),
3. the keys the user gave explicitly (``flwr run -c 'k=v'``, or a dict in the in-process engine).

Two kinds of keys share one flat namespace. :class:`RunConfig` holds the *run-level* keys (data,
model, runtime, local recipe, outputs). A method's hyperparameters are *options*, declared by the
method itself as a dataclass of :func:`option` fields next to its class (a strategy's ``Config``,
a client objective's ``Config``); ``server_app.config.load_config`` gathers them all and puts
their values in ``RunConfig.options``. A key is spelled the same everywhere: YAML, pyproject,
``-c`` and the README use ``num-rounds``, the dataclass field is ``num_rounds`` (hyphens become
underscores, nothing else changes). Every value is checked at start-up; a bad one raises
:class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.datasets import class_ids
from common.devices import DEVICES
from common.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


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

    def short(self) -> str:
        """The README's spelling: ``> 0``, ``≥ 1``, ``[0, 1]``."""
        low = int(self.low) if float(self.low).is_integer() else self.low
        if self.high == math.inf:
            return f"{'>' if self.low_open else '≥'} {low}"
        high = int(self.high) if float(self.high).is_integer() else self.high
        return f"{'(' if self.low_open else '['}{low}, {high}]"


@dataclass(frozen=True)
class OneOf:
    """A name from a fixed tuple or a registry (`names` called lazily, so registries load late)."""

    names: Callable[[], Iterable[str]] | tuple[str, ...]

    def allowed(self) -> list[str]:
        return sorted(self.names() if callable(self.names) else self.names)

    def ok(self, v: str) -> bool:
        return v in set(self.allowed())

    def describe(self) -> str:
        return "one of " + ", ".join(repr(n) for n in self.allowed())

    def short(self) -> str:
        return ", ".join(f"`{n}`" if n else '`""`' for n in self.allowed())


@dataclass(frozen=True)
class ClassList:
    """Comma-separated class ids (``"7,8,9"``), each at most once; ``""`` = none."""

    def ok(self, v: str) -> bool:
        try:
            ids = class_ids(v)
        except ValueError:
            return False
        return len(set(ids)) == len(ids)

    def describe(self) -> str:
        return "comma-separated distinct class ids such as '7,8,9', or '' for none"

    def short(self) -> str:
        return "class ids `7,8,9`; `\"\"` = none"


def _datasets() -> Iterable[str]:
    from common.data import DATASETS, IMAGEFOLDER

    return [*DATASETS, f"{IMAGEFOLDER}<folder>"]


@dataclass(frozen=True)
class DatasetName(OneOf):
    """A registered dataset, or ``imagefolder:<folder>`` (class sub-folders below data-root)."""

    def ok(self, v: str) -> bool:
        from common.data import is_dataset

        return is_dataset(v) or (v == "" and "" in set(self.allowed()))

    def describe(self) -> str:
        return super().describe() + ", or your own loader 'module:function'"

    def short(self) -> str:
        return "see [Data](#data)"


@dataclass(frozen=True)
class ModelName(OneOf):
    """A built-in model, or a user's model factory ``module:function``."""

    def ok(self, v: str) -> bool:
        from common.user_code import is_import_path

        return v in set(self.allowed()) or is_import_path(v)

    def describe(self) -> str:
        return super().describe() + ", or your own model factory 'module:function'"

    def short(self) -> str:
        return super().short() + ", or `module:function` (your own)"


def _models() -> Iterable[str]:
    from common.models import MODELS

    return MODELS


def _cnn_norms() -> Iterable[str]:
    from common.models import CNN_NORMS

    return CNN_NORMS


def _partitioners() -> Iterable[str]:
    from common.data import PARTITIONERS

    return PARTITIONERS


def _presets() -> Iterable[str]:
    """Preset names: paths under configs/ without ``.yaml`` (``feddle-animal/feddle-id-dir0.1-n20``)."""
    return sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.yaml"))


def preset_path(name: str) -> Path | None:
    """The YAML file of preset `name`: ``configs/<name>.yaml``, or for ``package:path`` (a user's own preset)
    ``<path>.yaml`` inside that installed package; None for a package that cannot be imported."""
    if ":" not in name:
        return CONFIG_DIR / f"{name}.yaml"
    import importlib.resources

    package, _, rel = name.partition(":")
    try:
        return Path(str(importlib.resources.files(package) / f"{rel}.yaml"))
    except (ModuleNotFoundError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class PresetName(OneOf):
    """A preset under configs/, or a user's ``package:path`` (``mytask:presets/fedavg``)."""

    def ok(self, v: str) -> bool:
        path = preset_path(v)
        return path is not None and path.is_file() and ".." not in Path(v.partition(":")[2] or v).parts

    def describe(self) -> str:
        return super().describe() + ", or your own 'package:path' (a YAML file inside an installed package)"


Check = Range | OneOf | ClassList | None


def option(default: Any, check: Check = None, doc: str = "", allowed: str = "") -> Any:
    """A configuration field: its default, the check its values must pass, one line of documentation, and
    (where the check does not say it well) how the README states what is allowed."""
    return field(default=default, metadata={"check": check, "doc": doc, "allowed": allowed})


@dataclass(frozen=True)
class Option:
    """An option defined once and declared by several configs (FedBuff's and CA2FL's ``buffer-size``),
    so that the key has one default, one check and one meaning everywhere."""

    default: Any
    check: Check = None
    doc: str = ""

    def field(self) -> Any:
        return option(self.default, self.check, self.doc)


@dataclass(frozen=True)
class OptionSpec:
    """One key of a config dataclass: what :func:`validate` and the README's key table need."""

    key: str
    name: str
    type: type
    default: Any
    check: Check
    doc: str
    allowed: str = ""

    def same_as(self, other: OptionSpec) -> bool:
        return (self.type, self.default, self.check, self.doc) == (other.type, other.default, other.check, other.doc)

    def allowed_text(self, check: Check = None) -> str:
        """What the README's key table says is allowed."""
        check = check or self.check
        return self.allowed or (check.short() if check else {bool: "bool", str: "text"}.get(self.type, ""))


def to_key(name: str) -> str:
    return name.replace("_", "-")


def specs_of(cls: type) -> dict[str, OptionSpec]:
    """The options of config dataclass `cls`, by key (types resolved even under postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {to_key(f.name): OptionSpec(to_key(f.name), f.name, hints[f.name], f.default, f.metadata["check"],
                                       f.metadata["doc"], f.metadata["allowed"])
            for f in dataclasses.fields(cls) if "check" in f.metadata}


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def validate(spec: OptionSpec, value: Any, check: Check = None) -> Any:
    """`value` coerced to the key's type (an int is a float) and checked, or :class:`ConfigError`."""
    kind = spec.type
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:  # bool is not an int here, and "3" is not 3
        raise ConfigError(spec.key, value, _KIND[kind])
    if kind is float and not math.isfinite(value):
        raise ConfigError(spec.key, value, "a finite number")
    check = check or spec.check
    if check is not None and not check.ok(value):
        raise ConfigError(spec.key, value, check.describe())
    return value


def make_options(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of config dataclass `cls` from hyphenated `values` (keys it does not own are ignored),
    every value validated."""
    specs = specs_of(cls)
    return cls(**{spec.name: validate(spec, values[key]) for key, spec in specs.items() if key in values})


def check_options(instance: Any) -> None:
    """Validate a config dataclass built in code (``FedBuff(buffer_size=0)``): :class:`ConfigError` if bad."""
    for spec in specs_of(type(instance)).values():
        validate(spec, getattr(instance, spec.name))


def options_dict(instance: Any) -> dict[str, Any]:
    """A config dataclass as ``{key: value}`` with hyphenated keys (logs, summary.json)."""
    return {key: getattr(instance, spec.name) for key, spec in specs_of(type(instance)).items()}


@dataclass(frozen=True)
class NoOptions:
    """The options of a method that has none."""


POSITIVE = Range(0, math.inf, low_open=True)
COUNT = Range(1)


@dataclass(frozen=True)
class RunConfig:
    """The run-level keys (see README "Configuration"), plus ``options``: every method option's value."""

    preset: str = option("fedavg-digits", PresetName(_presets), "YAML preset applied before overrides",
                         "a file in `configs/`, without `.yaml` (`feddle-animal/fedbuff-dir0.1-n20`), or "
                         "`package:path` in your own package")
    seed: int = option(0, Range(0), "fixes partitions, sampling, delays, initialisation and local shuffling")
    dataset: str = option("digits", DatasetName(_datasets), "the clients' dataset")
    partitioner: str = option("dirichlet", OneOf(_partitioners), "how client data is split (common/partitions.py)")
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
                                "(Feddle 000 Table 4)")
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
    server_dataset: str = option("", DatasetName(lambda: ("", *_datasets())),
                                 "empty: the server holds the in-domain central split; a dataset name: "
                                 "out-of-domain server data with its own labels", '`""` or a dataset')
    server_dataset_size: int = option(0, Range(0), "with `server-dataset`: how many of its samples the server holds "
                                      "(a seeded sample; 0 = all)")
    data_root: str = option("data", None, "folder with the datasets' files (a SuperNode may set its own with "
                            "`--node-config 'data-root=\"/path\"'`)", "path")
    device: str = option("auto", OneOf(DEVICES),
                         "where server-side training runs (`auto`: CUDA, else MPS, when there is one; the clients "
                         "choose their own with the node setting `device`)")
    model: str = option("cnn", ModelName(_models), "see [Models](#models); `module:function`: your own model factory "
                        "(see [Your own model and data](#your-own-model-and-data))")
    pretrained_weights: str = option("", None, "resnet18 / vit-b16: a local torchvision-format `state_dict` "
                                     "(present on every node); `\"\"` = random init", "path")
    input_size: int = option(0, Range(0), "model input size; 0 = the model's default (cnn: the data's own, "
                             "resnet18 / vit-b16: 224, vit-small: 32)")
    lora_rank: int = option(4, Range(0), "ViTs: LoRA rank (Feddle: 4); 0 = full fine-tuning")
    lora_alpha: float = option(8.0, POSITIVE, "ViTs: LoRA alpha; scaling = alpha / rank (Feddle's \"adaptation "
                               "scale 8\" read as alpha = 8)")
    lora_targets: str = option("q,v", None, "ViTs: comma-separated layers that get adapters",
                               "subset of `q,k,v,out_proj,mlp`")
    normalize: str = option("", OneOf(("", "none", "imagenet", "half")),
                            "input normalisation; `\"\"` = the model's default (none for cnn, ImageNet otherwise)")
    batch_norm: str = option("batch", OneOf(("batch", "running")),
                             "resnet18: normalise with batch statistics always, or keep running statistics (they "
                             "are buffers and do not travel, so federated runs use `batch`)")
    cnn_width: int = option(32, COUNT, "cnn: channels of the first convolution (2× in the other two, 4× in the "
                            "hidden layer; the papers do not state widths)")
    cnn_norm: str = option("none", OneOf(_cnn_norms),
                           "cnn: a GroupNorm after each convolution (`group`), so merges of independently "
                           "initialised models keep their scale (FedMerge on FMNIST)")
    strategy: str = option("fedavg", None, "the method: a registered strategy (strategies/)")
    num_rounds: int = option(20, COUNT, "server rounds (steps of the runtime)")
    clients_per_round: int = option(10, COUNT, "clients sampled per step (virtual clock); arrivals per step "
                                    "(wall clock)", "1 … `num-clients`")
    loop: str = option("hybridfl", OneOf(("hybridfl", "flower")),
                       "the hybridfl runtime, or Flower's own `Strategy.start()` rounds (a barrier: needs the "
                       "virtual clock with `delay-sigma = 0`)")
    clock: str = option("virtual", OneOf(("virtual", "wall")),
                        "virtual: seeded delays in steps; wall: real arrival order (see above)")
    delay_sigma: float = option(0.0, Range(0), "σ of the half-normal client delay, in server steps "
                                "(0 = synchronous)")
    concurrency: int = option(10, COUNT, "clients kept busy by the wall clock")
    local_epochs: int = option(1, COUNT, "local epochs per client update")
    batch_size: int = option(32, COUNT, "local mini-batch size")
    optimizer: str = option("sgd", OneOf(("sgd", "adam")), "local optimizer")
    lr: float = option(0.05, POSITIVE, "local learning rate")
    momentum: float = option(0.9, Range(0, 1), "SGD momentum (ignored by adam)")
    local_objective: str = option("cross-entropy", None,
                                  "the clients' loss: a registered client objective (common/objectives.py)")
    eval_every: int = option(1, COUNT, "evaluate on the server's test split every this many steps (and at the end)")
    checkpoint_every: int = option(10, Range(0), "write `checkpoint.pt` every this many steps and at the end "
                                   "(0 = never)")
    resume: str = option("", None, "a run folder with a `checkpoint.pt`: continue that run there (the other keys "
                         "come from the checkpoint; see [Checkpoints](#checkpoints-and-resume))", "a run folder")
    reply_timeout_s: float = option(600.0, POSITIVE, "seconds a dispatched update may take before it is given up")
    poll_interval_s: float = option(0.05, Range(0, 1, low_open=True), "seconds between pulls for replies")
    wait_nodes_s: float = option(120.0, POSITIVE,
                                 "seconds to wait for `num-clients` nodes at start, or for any node later")
    output_dir: str = option("outputs", None, "where `<run>/` is written (absolute under `flwr run`)", "path")
    run_name: str = option("", None, "run folder; empty = `<preset>-s<seed>-<timestamp>` (`-2`, `-3`… when that "
                           "folder exists)", "name")
    options: dict[str, Any] = field(default_factory=dict, compare=True, hash=False)

    @staticmethod
    def specs() -> dict[str, OptionSpec]:
        return specs_of(RunConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value: run-level keys, then the method options."""
        return {**{key: getattr(self, spec.name) for key, spec in self.specs().items()}, **self.options}


def read_preset(name: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The key/value mapping of ``configs/<name>.yaml``.

    A preset may build on others: ``base: <preset>`` or ``base: [<preset>, ...]`` applies those first
    (in order, each with its own bases), then the file's own keys. So a family of presets shares one
    protocol file and each member states only what differs.
    """
    check = PresetName(_presets)
    if not check.ok(name):
        raise ConfigError("preset", name, check.describe())
    path = preset_path(name)
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
