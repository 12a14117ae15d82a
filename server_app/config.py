"""The complete run configuration: the run-level keys (``common.config.RunConfig``) and every method
option — each strategy's and each client objective's ``Config`` dataclass — in one flat namespace,
loaded as defaults <- preset <- the user's keys, every value checked at start.

A key declared by several methods (``buffer-size`` by FedBuff and CA2FL) must mean the same in all
of them; :func:`option_specs` refuses two different declarations. A method key that the run's strategy and
client objective do not use is refused (:func:`check_used`): it would be ignored.
A ``resume`` run takes its configuration from the checkpoint (:func:`resumed_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config import ConfigError, OneOf, OptionSpec, RunConfig, read_preset, specs_of, validate
from common.objectives import OBJECTIVES
from common.user_code import is_import_path, resolve
from server_app.checkpoint import read_config
from strategies import STRATEGIES

REGISTRY_CHECKS = {"strategy": OneOf(lambda: STRATEGIES), "local-objective": OneOf(lambda: OBJECTIVES)}

# Keys a resumed run may change: they do not touch what is computed (or, `device`, where).
MAY_CHANGE_ON_RESUME = frozenset({"num-rounds", "checkpoint-every", "eval-every", "reply-timeout-s", "poll-interval-s",
                                  "wait-nodes-s", "data-root", "device", "resume", "output-dir", "run-name"})


def option_owners() -> dict[str, list[str]]:
    """Every option key -> the methods that declare it (``fedbuff``, ``objective proximal``)."""
    owners: dict[str, list[str]] = {}
    for name, cls in sorted(STRATEGIES.items()):
        for key in specs_of(cls.Config):
            owners.setdefault(key, []).append(name)
    for name, entry in sorted(OBJECTIVES.items()):
        for key in specs_of(entry.Config):
            owners.setdefault(key, []).append(f"objective {name}")
    return owners


def option_specs() -> dict[str, OptionSpec]:
    """Every method option by key; a key declared twice must be declared identically."""
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
    return dict(sorted(specs.items()))


def make_config(values: Mapping[str, Any]) -> RunConfig:
    """A validated :class:`RunConfig` from a flat key -> value mapping (missing keys take their defaults)."""
    run, options = RunConfig.specs(), option_specs()
    given_run, given_options = {}, {key: spec.default for key, spec in options.items()}
    for key, value in values.items():
        if key in run:
            given_run[run[key].name] = validate(run[key], value, REGISTRY_CHECKS.get(key))
        elif key in options:
            given_options[key] = validate(options[key], value)
        else:
            raise ConfigError(key, value, "a known key: " + ", ".join(sorted({*run, *options})))
    for key in REGISTRY_CHECKS.keys() - values.keys():  # defaults must name registered methods too
        validate(run[key], run[key].default, REGISTRY_CHECKS[key])
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
    return cfg


def load_config(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Build and validate the run configuration: defaults <- preset <- `overrides`, or, with ``resume``,
    the checkpoint's configuration <- `overrides` (:func:`resumed_config`).

    `overrides` are the keys the user set explicitly (Flower's ``Run.override_config``).
    """
    overrides = dict(overrides or {})
    if overrides.get("resume"):
        return resumed_config(overrides)
    preset = overrides.get("preset", RunConfig.preset)
    validate(RunConfig.specs()["preset"], preset)
    given = {**read_preset(preset), **overrides, "preset": preset}
    cfg = make_config(given)
    check_used(cfg, given)
    return cfg


def used_keys(cfg: RunConfig) -> set[str]:
    """The method keys `cfg`'s strategy and client objective read."""
    return set(specs_of(STRATEGIES[cfg.strategy].Config)) | set(specs_of(OBJECTIVES[cfg.local_objective].Config))


def check_used(cfg: RunConfig, given: Mapping[str, Any]) -> None:
    """Refuse a method key (a strategy's or a client objective's option) set to another value than its default that
    the run's strategy and objective do not use: a preset or an override that sets it would otherwise be silently
    ignored. A key at its default changes nothing either way (a resolved configuration lists every key so)."""
    used, owners, specs = used_keys(cfg), option_owners(), option_specs()
    for key, value in given.items():
        if key in owners and key not in used and value != specs[key].default:
            raise ConfigError(key, value, f"a key the run uses: '{key}' is an option of {', '.join(owners[key])}, "
                              f"not of strategy '{cfg.strategy}' with objective '{cfg.local_objective}'")


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
