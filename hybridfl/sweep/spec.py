"""A sweep spec (the package's docstring): its blocks of presets, candidates and seeds, parsed and checked, and
the jobs they make."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import ConfigError
from common.user_code import resolve
from hybridfl.sweep.executors import IMPORTABLE, record
from hybridfl.sweep.store import Job, config_digest

SELECT_RULES = ("one-se", "best", "none")


def job(preset: str, seed: int, point: Mapping[str, Any] | None = None, run_dir: str | Path = "outputs/sweeps",
        overrides: Mapping[str, Any] | None = None) -> Job:
    """The job of `preset` at `seed` and grid `point`: its name ``<preset>/s<seed>[/k=v,...]`` and its run-config
    overrides (`overrides`, then the point), run in ``<run_dir>/<name with _ for />``."""
    point = dict(point or {})
    tail = ",".join(f"{k}={v}" for k, v in sorted(point.items()))
    key = f"{preset}/s{seed}" + (f"/{tail}" if tail else "")
    return key, {"preset": preset, "seed": seed, **(overrides or {}), **point,
                 "output-dir": str(Path(run_dir).resolve()), "run-name": key.replace("/", "_")}


@dataclass(frozen=True)
class Block:
    """Presets (a name, or a template filled from `vars`) × candidates × `seeds`; a candidate is each listed point
    combined with each combination of `grid`. `select` is the block's own rule (None: the spec's); `label` names its
    candidates in reports (a family's table finds its rows by it)."""

    presets: tuple[str, ...]
    grid: dict[str, list[Any]]
    seeds: tuple[int, ...]
    select: str | None = None
    listed: tuple[dict[str, Any], ...] = ({},)
    label: str = ""

    def points(self) -> list[dict[str, Any]]:
        """The candidates, in order: the listed points, each through the grid (its first key varies slowest)."""
        return [{**point, **dict(zip(self.grid, values))}
                for point in self.listed for values in itertools.product(*self.grid.values())]


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep spec (module docstring)."""

    name: str
    blocks: tuple[Block, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    metric: str = "max-last-5-evals"
    val_metric: str = "val-max-last-5-evals"
    select: str = "one-se"
    validation_samples: int = 0
    results: Path = Path("outputs/sweeps/runs.jsonl")
    report: Path = Path("outputs/sweeps/runs.md")
    run_dir: Path = Path("outputs/sweeps")
    record: str | None = None
    table: str | None = None

    def jobs(self) -> list[Job]:
        """Every block's jobs, in order; in a block, seed by seed (an interrupted sweep has each candidate's first
        seed before any second one)."""
        return [job(preset, seed, point, self.run_dir, self.job_overrides())
                for block in self.blocks for seed in block.seeds for preset in block.presets
                for point in block.points()]

    def rows(self) -> list[tuple[Block, str, dict[str, Any], list[Job]]]:
        """Each block's presets and candidates in spec order, with their jobs (one per seed)."""
        return [(block, preset, point, [job(preset, s, point, self.run_dir, self.job_overrides())
                                        for s in block.seeds])
                for block in self.blocks for preset in block.presets for point in block.points()]

    def job_overrides(self) -> dict[str, Any]:
        """What every job gets: the spec's overrides; a tracked sweep is one experiment, named after the sweep."""
        tracked = self.overrides.get("tracking") and not self.overrides.get("experiment")
        return {**self.overrides, "experiment": self.name} if tracked else dict(self.overrides)

    def worker(self) -> Callable[..., dict[str, Any]]:
        """What a worker process runs for one job (picklable)."""
        return functools.partial(record, metric=self.metric, val_metric=self.val_metric, extra=self.record)


SPEC_KEYS = ("runs", "overrides", "metric", "val-metric", "select", "validation-samples", "results", "report",
             "run-dir", "record", "table")
BLOCK_KEYS = ("presets", "vars", "points", "grid", "seeds", "select", "label")


def _mapping(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key, value, "a mapping of keys to values")
    return value


def _values(key: str, value: Any) -> list[Any]:
    """A grid's or a template's list of values (a single value is a list of one)."""
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(key, value, "one value or a non-empty list")
    return values


def _block(i: int, raw: Any) -> Block:
    where = f"runs[{i}]"
    raw = _mapping(where, raw)
    unknown = sorted(set(raw) - set(BLOCK_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", raw[unknown[0]], f"a block key: {', '.join(BLOCK_KEYS)}")
    if "presets" not in raw:
        raise ConfigError(f"{where}.presets", None, "a preset name, a template over `vars`, or a list of them")
    variables = {k: _values(f"{where}.vars.{k}", v) for k, v in _mapping(f"{where}.vars", raw.get("vars", {})).items()}
    presets = []
    for template in _values(f"{where}.presets", raw["presets"]):
        if not isinstance(template, str):
            raise ConfigError(f"{where}.presets", template, "a preset name (`hybridfl presets`) or a template")
        for values in itertools.product(*variables.values()):
            try:
                presets.append(template.format(**dict(zip(variables, values))))
            except (KeyError, IndexError) as err:
                raise ConfigError(f"{where}.presets", template,
                                  f"a template whose {{names}} are keys of `vars` ({', '.join(variables) or 'none'})"
                                  ) from err
    seeds = _values(f"{where}.seeds", raw.get("seeds", [0]))
    if not all(type(s) is int and s >= 0 for s in seeds):
        raise ConfigError(f"{where}.seeds", raw.get("seeds"), "seeds: integers ≥ 0")
    grid = {k: _values(f"{where}.grid.{k}", v) for k, v in _mapping(f"{where}.grid", raw.get("grid", {})).items()}
    listed = [_mapping(f"{where}.points", p) for p in _values(f"{where}.points", raw.get("points", [{}]))]
    label = raw.get("label", "")
    if not isinstance(label, str):
        raise ConfigError(f"{where}.label", label, "a string")
    return Block(tuple(dict.fromkeys(presets)), grid, tuple(dict.fromkeys(seeds)),
                 _rule(f"{where}.select", raw["select"]) if "select" in raw else None, tuple(listed), label)


def _rule(key: str, value: Any) -> str:
    if value not in SELECT_RULES:
        raise ConfigError(key, value, "one of " + ", ".join(repr(r) for r in SELECT_RULES))
    return value


def parse(raw: Any, name: str) -> Sweep:
    """A :class:`Sweep` from a spec's mapping; every job's configuration is resolved and checked (a bad preset, key
    or value is the run config's own error, naming the job), and :class:`ConfigError` names a bad spec key."""
    raw = _mapping(name, raw)
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(unknown[0], raw[unknown[0]], f"a sweep spec key: {', '.join(SPEC_KEYS)}")
    if not isinstance(raw.get("runs"), list) or not raw["runs"]:
        raise ConfigError("runs", raw.get("runs"), "a non-empty list of blocks (presets, vars, grid, seeds)")
    for key in ("metric", "val-metric", "record", "table", "results", "report", "run-dir"):
        if key in raw and not isinstance(raw[key], str):
            raise ConfigError(key, raw[key], "a string")
    for key in ("record", "table"):
        if key in raw:
            resolve(key, raw[key], IMPORTABLE)
    samples = raw.get("validation-samples", 0)
    if type(samples) is not int or samples < 0:
        raise ConfigError("validation-samples", samples, "an integer ≥ 0")
    metric = raw.get("metric", Sweep.metric)
    results = Path(raw.get("results", f"outputs/sweeps/{name}/runs.jsonl"))
    sweep = Sweep(name=name, blocks=tuple(_block(i, b) for i, b in enumerate(raw["runs"])),
                  overrides=_mapping("overrides", raw.get("overrides", {})), metric=metric,
                  val_metric=raw.get("val-metric", f"val-{metric}"),
                  select=_rule("select", raw.get("select", "one-se")), validation_samples=samples, results=results,
                  report=Path(raw.get("report", results.with_suffix(".md"))),
                  run_dir=Path(raw.get("run-dir", results.parent)), record=raw.get("record"), table=raw.get("table"))
    for key, overrides in sweep.jobs():  # every job's configuration checked before anything runs
        try:
            config_digest(overrides)
        except ConfigError as err:
            raise ConfigError(err.key, err.value, err.allowed, f"sweep {name}, job {key}: {err}") from err
    return sweep


def load(path: str | Path) -> Sweep:
    """The sweep spec in the YAML file `path`, parsed and checked (:func:`parse`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("spec", str(path), "a sweep spec file (YAML)")
    return parse(yaml.safe_load(path.read_text()), path.stem)
