"""The complete run configuration: the run-level keys (:class:`RunConfig`, here, from the specs that declare them) and
every method option — each strategy's and each client objective's ``Config`` dataclass — in one flat namespace,
loaded as defaults <- preset <- the user's keys, every value checked at start.

A key declared by several methods (``buffer-size`` by FedBuff and CA2FL) must mean the same in all
of them; :func:`option_specs` refuses two different declarations. A method key that the run's strategy and
client objective do not use is refused (:func:`check_used`): it would be ignored.
A ``resume`` run takes its configuration from the checkpoint (:func:`resumed_config`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from common.codecs import WireCodecs, wire_refusal
from common.config import (
    COUNT,
    ConfigError,
    OneOf,
    OptionSpec,
    Range,
    make_options,
    option,
    options_dict,
    part_of,
    specs_of,
    validate,
)
from common.devices import DEVICES
from common.fleet import load_fleet
from common.models import ModelSpec
from common.objectives import OBJECTIVES
from common.splits import DatasetName, DataSpec, dataset_names
from common.training import LocalRecipe
from common.user_code import is_import_path, resolve
from server_app.checkpoint import read_config
from server_app.presets import PresetName, preset_names, read_preset, unpack_method_options
from server_app.runtime import RuntimeConfig
from server_app.tracking import TrackingConfig, check_tracking
from strategies import STRATEGIES, MethodChoice, strategy_class


@dataclass(frozen=True, kw_only=True)
class RunConfig(MethodChoice, DataSpec, ModelSpec, LocalRecipe, WireCodecs, RuntimeConfig, TrackingConfig):
    """Every key of a run: the method, the data spec, the model, the clients' local recipe, the wire's codecs, the
    runtime and the tracking (each declared in the dataclass that carries it, inherited here), the run's own keys
    below, and ``options``: every method option's value (docs/reference/configuration.md)."""

    preset: str = option("fedavg-digits", PresetName(preset_names), "YAML preset applied before overrides",
                         "a file in `configs/`, without `.yaml` (`feddle-animal/fedbuff-dir0.1-n20`), or "
                         "`package:path` in your own package")
    num_rounds: int = option(20, COUNT, "server rounds (steps of the runtime)")
    loop: str = option("hybridfl", OneOf(("hybridfl", "flower")),
                       "the hybridfl runtime, or Flower's own `Strategy.start()` rounds (a barrier: needs the "
                       "virtual clock with `delay-sigma = 0`)")
    server_dataset: str = option("", DatasetName(lambda: ("", *dataset_names())),
                                 "empty: the server holds the in-domain central split; a dataset name: "
                                 "out-of-domain server data with its own labels", '`""` or a dataset')
    server_dataset_size: int = option(0, Range(0), "with `server-dataset`: how many of its samples the server holds "
                                      "(a seeded sample; 0 = all)")
    device: str = option("auto", OneOf(DEVICES),
                         "where server-side training runs (`auto`: CUDA, else MPS, when there is one; the clients "
                         "choose their own with the node setting `device`)")
    cohort_training: str = option("auto", OneOf(("auto", "on", "off")),
                                  "in-process runs: train the clients in flight together as one batched computation "
                                  "where their method and model allow (`auto`: when the clients train on CUDA; "
                                  "see [GPU](../tutorials/gpu.md))")
    cohort_size: int = option(32, COUNT, "with `cohort-training`: at most this many in-flight messages trained "
                              "together, besides those due at the step")
    eval_every: int = option(1, COUNT, "evaluate on the server's test split every this many steps (and at the end)")
    checkpoint_every: int = option(10, Range(0), "write `checkpoint.pt` every this many steps and at the end "
                                   "(0 = never)")
    plots: bool = option(True, None, "draw the run's plots when it ends (`accuracy.png`, `staleness.png`, the "
                         "method's own); false for runs read only as numbers (a sweep's many: about half a CPU "
                         "second each)")
    max_failed_fraction: float = option(0.8, Range(0, 1), "the run stops with an error (exit 1), quoting the first "
                                        "loss, once more than this fraction of its dispatches failed, were rejected "
                                        "or timed out, judged from `clients-per-round` dispatches on; 1 = never "
                                        "(a run that accepts no update at all fails whatever this is)")
    resume: str = option("", None, "a run folder with a `checkpoint.pt`: continue that run there (the other keys "
                         "come from the checkpoint; see [Checkpoints](../how-to/resume.md))", "a run folder")
    output_dir: str = option("outputs", None, "where `<run>/` is written (absolute under `flwr run`)", "path")
    run_name: str = option("", None, "run folder; empty = `<preset>-s<seed>-<timestamp>` (`-2`, `-3`… when that "
                           "folder exists)", "name")
    method_options: str = option("", None, "a method's own keys as one TOML inline table (`{ clip-norm = 0.1 }`), "
                                 "taken as if given one by one: how a user's own method's keys pass `flwr run -c`, "
                                 "which accepts only the keys a Flower app declares (hybridfl's launchers pack them "
                                 "so)", "TOML inline table")
    options: dict[str, Any] = field(default_factory=dict, compare=True, hash=False)

    @staticmethod
    def specs() -> Mapping[str, OptionSpec]:
        return specs_of(RunConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value: run-level keys, then the method options."""
        return {**{key: getattr(self, spec.name) for key, spec in self.specs().items()}, **self.options}


# The parts a run's keys are declared in, in the reference's order (the run's own keys are the rest); data, model,
# local recipe and wire travel in every message to the clients (client_config).
PARTS: dict[str, type] = {"method": MethodChoice, "data": DataSpec, "model": ModelSpec, "local recipe": LocalRecipe,
                          "wire": WireCodecs, "runtime": RuntimeConfig, "tracking": TrackingConfig}


def run_key_groups() -> list[tuple[str, type, list[OptionSpec]]]:
    """The run's keys by the dataclass that declares them: the run's own, then each part's (the reference's and
    pyproject's order)."""
    parts = {key for cls in PARTS.values() for key in specs_of(cls)}
    return [("The run", RunConfig, [s for k, s in RunConfig.specs().items() if k not in parts]),
            *((f"The {name}", cls, list(specs_of(cls).values())) for name, cls in PARTS.items())]


def run_key_defaults() -> dict[str, Any]:
    """Every key a run accepts, run keys and method options, with its default (pyproject's config table)."""
    return {**{s.key: s.default for _, _, specs in run_key_groups() for s in specs},
            **{k: s.default for k, s in option_specs().items()}}


def client_config(cfg: RunConfig) -> dict[str, Any]:
    """What every message to hybridfl's ClientApp carries: the data spec (a node rebuilds its partition from it),
    the model, the local recipe, the wire's codecs and the client objective's own options. A Flower user's own
    ServerApp passes it as ``train_config`` to ``FlowerStrategy.start`` (examples/tabular)."""
    parts = (options_dict(part_of(part, cfg)) for part in (DataSpec, ModelSpec, LocalRecipe, WireCodecs))
    objective = specs_of(OBJECTIVES[objective_of(cfg)].Config)
    return {**{k: v for part in parts for k, v in part.items()}, **{key: cfg.options[key] for key in objective}}


# Keys a resumed run may change: they do not touch what is computed (or, `device` and `cohort-training`, where and
# how, to float rounding).
MAY_CHANGE_ON_RESUME = frozenset({"num-rounds", "checkpoint-every", "eval-every", "max-failed-fraction",
                                  "reply-timeout-s", "poll-interval-s", "poll-max-interval-s", "wait-nodes-s",
                                  "data-root", "device", "cohort-training", "cohort-size", "resume", "output-dir",
                                  "run-name",
                                  *specs_of(TrackingConfig)})


def method_classes(strategy: str = "") -> dict[str, type]:
    """Every registered strategy by name, and `strategy` when it is a user's own (by its import path)."""
    return {**STRATEGIES, **({strategy: strategy_class(strategy)} if strategy and strategy not in STRATEGIES else {})}


def option_owners(strategy: str = "") -> dict[str, list[str]]:
    """Every option key -> the methods that declare it (``fedbuff``, ``objective proximal``); with a user's own
    `strategy`, its keys too."""
    owners: dict[str, list[str]] = {}
    for name, cls in sorted(method_classes(strategy).items()):
        for key in specs_of(cls.Config):
            owners.setdefault(key, []).append(name)
    for name, entry in sorted(OBJECTIVES.items()):
        for key in specs_of(entry.Config):
            owners.setdefault(key, []).append(f"objective {name}")
    return owners


def option_specs(strategy: str = "") -> dict[str, OptionSpec]:
    """Every method option by key; a key declared twice must be declared identically, except by a user's own
    `strategy` (an import path), whose declarations are the run's: its keys mean what its author says."""
    run = RunConfig.specs()
    specs: dict[str, OptionSpec] = {}
    configs = [cls.Config for cls in STRATEGIES.values()] + [entry.Config for entry in OBJECTIVES.values()]
    for config in configs:
        for key, spec in specs_of(config).items():
            if key in run:
                raise ValueError(f"{config.__qualname__} declares '{key}', a run-level key")
            if key in specs and not specs[key].same_as(spec):
                raise ValueError(f"option '{key}' is declared twice with different types, defaults, checks or "
                                 f"docs ({config.__qualname__}); define it once as a common.config.Option")
            specs[key] = spec
    if strategy and strategy not in STRATEGIES:
        own = specs_of(strategy_class(strategy).Config)
        if clash := sorted(set(own) & set(run)):
            raise ConfigError("strategy", strategy, f"a strategy whose Config declares no run-level key; it declares "
                              f"{', '.join(clash)}")
        specs.update(own)
    return dict(sorted(specs.items()))


def make_config(values: Mapping[str, Any]) -> RunConfig:
    """A validated :class:`RunConfig` from a flat key -> value mapping (missing keys take their defaults)."""
    run = RunConfig.specs()
    strategy = validate(run["strategy"], values.get("strategy", RunConfig.strategy))
    strategy_class(strategy)  # a user's own imported here, at start (with the client objectives it declares)
    options = option_specs(strategy)
    given_run, given_options = {}, {key: spec.default for key, spec in options.items()}
    for key, value in values.items():
        if key in run:
            given_run[run[key].name] = validate(run[key], value)
        elif key in options:
            given_options[key] = validate(options[key], value)
        else:
            close = difflib.get_close_matches(str(key), [*run, *options], n=3)
            raise ConfigError(key, value, "a known key" + (f"; did you mean {' or '.join(map(repr, close))}?"
                                                           if close else "") + " (every key: README, 'Configuration')")
    cfg = RunConfig(**given_run, options=given_options)
    for key, value, what in (("model", cfg.model, "a model factory 'module:function'"),
                             ("dataset", cfg.dataset, "a data loader 'module:function'"),
                             ("server-dataset", cfg.server_dataset, "a data loader 'module:function'")):
        if is_import_path(value):
            resolve(key, value, what)  # importable here, at start: else the error says why
    if cfg.clients_per_round > cfg.num_clients:
        raise ConfigError("clients-per-round", cfg.clients_per_round, f"at most num-clients = {cfg.num_clients}")
    if cfg.loop == "flower" and (cfg.delay_sigma > 0 or cfg.clock != "virtual"):
        bad = ("delay-sigma", cfg.delay_sigma) if cfg.delay_sigma > 0 else ("clock", cfg.clock)
        raise ConfigError(*bad, "no delay on the virtual clock with loop = 'flower' (Flower's rounds end with a "
                                "barrier); use loop = 'hybridfl' for asynchrony")
    if cfg.loop == "flower" and cfg.time_budget_s:
        raise ConfigError("time-budget-s", cfg.time_budget_s, "0 with loop = 'flower' (Flower's loop runs num-rounds)")
    fleet = load_fleet(cfg.fleet, cfg.num_clients, cfg.seed)  # a bad fleet file fails here, at start
    if cfg.clock == "device" and fleet.ideal:
        raise ConfigError("clock", cfg.clock, f"a fleet whose devices cost time with clock = 'device' (fleet = "
                                              f"{cfg.fleet!r} is ideal): fleet = 'lognormal', or a fleet file")
    method = strategy_class(cfg.strategy)
    wire = part_of(WireCodecs, cfg)
    if refusal := wire_refusal(wire):
        raise ConfigError(refusal[0], getattr(cfg, specs_of(WireCodecs)[refusal[0]].name), refusal[1])
    if refusal := method.codec_refusal(make_options(method.Config, cfg.options), wire):
        key, allowed = refusal
        raise ConfigError(key, getattr(cfg, specs_of(WireCodecs)[key].name), f"{allowed} (strategy {cfg.strategy})")
    check_tracking(cfg)
    return cfg


def load_config(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Build and validate the run configuration: defaults <- preset <- `overrides`, or, with ``resume``,
    the checkpoint's configuration <- `overrides` (:func:`resumed_config`).

    `overrides` are the keys the user set explicitly (Flower's ``Run.override_config``).
    """
    overrides = unpack_method_options(dict(overrides or {}))
    if overrides.get("resume"):
        return resumed_config(overrides)
    preset = overrides.get("preset", RunConfig.preset)
    validate(RunConfig.specs()["preset"], preset)
    from_preset = read_preset(preset)
    given = {**from_preset, **overrides, "preset": preset}
    cfg = make_config(given)
    chosen = {key: overrides[key] for key in METHOD_KEYS if key in overrides}
    if chosen:  # another method than the preset's: drop the preset's options of its own method
        dropped = sorted(unused_options(cfg, {k: v for k, v in from_preset.items() if k not in overrides}))
        if dropped:
            log(WARNING, "%s on preset %s: its options %s are not this method's and are left out",
                ", ".join(f"{k} = {v}" for k, v in chosen.items()), preset, ", ".join(dropped))
            given = {k: v for k, v in given.items() if k not in dropped}
            cfg = make_config(given)
    check_used(cfg, given)
    return cfg


# The keys that choose the method, and so which method options a run uses
METHOD_KEYS = ("strategy", "local-objective")


def unused_options(cfg: RunConfig, given: Mapping[str, Any]) -> dict[str, list[str]]:
    """The method options in `given`, set to another value than their default, that `cfg`'s strategy and objective
    do not use: {key: the methods it belongs to}."""
    used, owners, specs = used_keys(cfg), option_owners(cfg.strategy), option_specs(cfg.strategy)
    return {key: owners[key] for key, value in given.items()
            if key in owners and key not in used and value != specs[key].default}


def objective_of(cfg: RunConfig) -> str:
    """The client objective `cfg`'s clients train with: the one its strategy's client side fixes (SCAFFOLD's), else
    the run's ``local-objective``."""
    return strategy_class(cfg.strategy).client_side.objective or cfg.local_objective


def used_keys(cfg: RunConfig) -> set[str]:
    """The method keys `cfg`'s strategy and client objective read."""
    return set(specs_of(strategy_class(cfg.strategy).Config)) | set(specs_of(OBJECTIVES[objective_of(cfg)].Config))


def check_used(cfg: RunConfig, given: Mapping[str, Any]) -> None:
    """Refuse a method key (a strategy's or a client objective's option) set to another value than its default that
    the run's strategy and objective do not use: a preset or an override that sets it would otherwise be silently
    ignored. A key at its default changes nothing either way (a resolved configuration lists every key so). The same
    for ``local-objective`` where the strategy's client side fixes the objective."""
    fixed = strategy_class(cfg.strategy).client_side.objective
    if fixed and given.get("local-objective", fixed) not in (fixed, RunConfig.specs()["local-objective"].default):
        raise ConfigError("local-objective", given["local-objective"],
                          f"'{fixed}' or unset: strategy '{cfg.strategy}' trains its clients with objective '{fixed}'")
    for key, methods in unused_options(cfg, given).items():
        raise ConfigError(key, given[key], f"a key the run uses: '{key}' is an option of {', '.join(methods)}, "
                          f"not of strategy '{cfg.strategy}' with objective '{objective_of(cfg)}'")


class ResumeMismatch(ConfigError):
    """Keys given with ``resume`` that differ from the configuration the checkpoint was written with."""

    def __init__(self, folder: Path, diffs: dict[str, tuple[Any, Any]]) -> None:
        key, (then, now) = next(iter(diffs.items()))
        super().__init__(key, now, repr(then), f"cannot resume {folder}: " + "; ".join(
            f"'{k}' = {n!r} here but {t!r} in its checkpoint" for k, (t, n) in diffs.items())
            + f". A resumed run keeps its configuration; only {', '.join(sorted(MAY_CHANGE_ON_RESUME))} may change")


def resumed_config(overrides: Mapping[str, Any]) -> RunConfig:
    """The configuration of the run in folder ``overrides["resume"]`` (read from its checkpoint), with the
    keys of :data:`MAY_CHANGE_ON_RESUME` taken from `overrides`. Any other key given that differs from the
    checkpoint's fails with :class:`ResumeMismatch` naming every difference."""
    folder = Path(str(overrides["resume"])).expanduser().resolve()
    then = read_config(folder)
    cfg = make_config({**then, **overrides, "resume": str(folder), "output-dir": str(folder.parent),
                       "run-name": folder.name})
    now = cfg.to_dict()
    diffs = {k: (then[k], now[k]) for k in now if k in then and k not in MAY_CHANGE_ON_RESUME and then[k] != now[k]}
    if diffs:
        raise ResumeMismatch(folder, diffs)
    return cfg
