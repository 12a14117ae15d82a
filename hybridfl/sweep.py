"""Sweeps: many runs of presets over a grid of keys and seeds, in parallel (``--jobs`` processes here, or tasks on a
Ray cluster: docs/tutorials/ray.md), resumable, and chosen on validation.

A sweep spec is a YAML file (docs/how-to/sweeps-and-tracking.md; paths are relative to the folder you run from):

    runs:                              # blocks; a sweep's jobs are every block's, in order
      - presets: fedmerge-fmnist/{method}-{setting}   # a preset name, or a template over `vars`
        vars: {method: [fedavg, fedmerge], setting: [cluster, personal]}
        points: [{}, {atlas-size: 40}] # optional: candidates as listed ({} is the preset as it is) ...
        grid: {lr: [0.03, 0.1]}        # ... each through every combination of the grid; simplest first
        seeds: [0, 1]
        select: best                   # optional: this block's own rule
    overrides: {eval-every: 10}        # every run gets these (not part of its name)
    metric: max-last-5-evals           # the summary.json entry that scores a run on test ...
    val-metric: val-max-last-5-evals   # ... and on validation (default: val-<metric>), the only one selection reads
    select: one-se                     # per preset, the candidate the rule takes: one-se, best or none
    validation-samples: 525            # one seed's standard error: the samples behind a validation score where
                                       # the run config's validation-size is 0 (the clients' own splits)
    results: outputs/sweeps/x/runs.jsonl     # one line per finished run (default: outputs/sweeps/<spec name>/)
    report: outputs/sweeps/x/runs.md         # the table (default: beside the results, .md)
    run-dir: outputs/sweeps/x                # the runs' folders (default: the results' folder)
    record: mypkg.sweeps:fields        # optional, `module:function`: (run folder, summary, metrics rows) -> more fields
    table: mypkg.sweeps:table          # optional, `module:function`: (results, sweep) -> the report's markdown

A job is named ``<preset>/s<seed>[/k=v,...]`` (its grid point) and runs in ``<run-dir>/<name with _ for />``. Its
result is appended to `results` when it finishes, with the digest of its resolved configuration
(:func:`config_digest`); a job whose result is there with the same digest is not run again, one whose preset changed
since is, and a job interrupted mid-way (the session ended, the process was killed) resumes at its last checkpoint.
Several processes may share a results file. The one-standard-error rule takes, among a preset's candidates, the
first (in grid order) whose mean validation score is within one standard error of the best candidate's: the spread
of the best's seeds (sample std / √seeds) when it has two or more, else the binomial error √(p(1 − p)/n) of one
accuracy on its ``validation-size`` samples. Test scores are reported, never used to choose.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import ConfigError
from common.user_code import resolve

Job = tuple[str, dict[str, Any]]
IMPORTABLE = "`module:function`, importable from here"  # what a spec's `record` and `table` name
Results = dict[str, dict[str, Any]]
SELECT_RULES = ("one-se", "best", "none")


# -- the results file and the configurations' digests ----------------------------------------------------------------


# where a run writes and what else watches it: never a different result
UNDIGESTED = frozenset({"output-dir", "run-name", "resume", "tracking", "experiment", "tracking-uri"})


def digest(config: Mapping[str, Any]) -> str:
    """A digest of the keys that differ from their defaults (:data:`UNDIGESTED` aside): an option added later, at
    a default that reproduces the old behaviour, leaves the digests of finished runs as they were."""
    from server_app.config import RunConfig, option_specs

    defaults = {k: spec.default for k, spec in {**RunConfig.specs(), **option_specs()}.items()}
    kept = {k: v for k, v in config.items()
            if k not in UNDIGESTED and (k not in defaults or v != defaults[k])}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_digest(overrides: Mapping[str, Any]) -> str:
    """A digest of the run's resolved configuration (presets applied), output folder aside."""
    from server_app.config import load_config

    return digest(load_config(overrides).to_dict())


def load_results(path: Path) -> Results:
    """Every result in `path` by job name (a later line of the same job wins)."""
    if not path.is_file():
        return {}
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines())}


def append(path: Path, result: dict[str, Any]) -> None:
    """One result line, appended under an exclusive lock: several invocations may share a results file."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(result) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def current(result: dict[str, Any] | None, overrides: Mapping[str, Any]) -> bool:
    """Whether `result` was made with the configuration `overrides` resolve to now (a record made before digests
    were kept, without "config", is taken as it is)."""
    return result is not None and result.get("config", "") in ("", config_digest(overrides))


def pending(jobs: Iterable[Job], done: Results) -> list[Job]:
    """The jobs without a current result."""
    todo, stale = [], []
    for key, overrides in jobs:
        if not current(done.get(key), overrides):
            todo.append((key, overrides))
            if key in done:
                stale.append(key)
    if stale:
        print(f"{len(stale)} runs again: their presets changed since they ran ({', '.join(stale)})", flush=True)
    return todo


# -- one job ---------------------------------------------------------------------------------------------------------


def job(preset: str, seed: int, point: Mapping[str, Any] | None = None, run_dir: str | Path = "outputs/sweeps",
        overrides: Mapping[str, Any] | None = None) -> Job:
    """The job of `preset` at `seed` and grid `point`: its name ``<preset>/s<seed>[/k=v,...]`` and its run-config
    overrides (`overrides`, then the point), run in ``<run_dir>/<name with _ for />``."""
    point = dict(point or {})
    tail = ",".join(f"{k}={v}" for k, v in sorted(point.items()))
    key = f"{preset}/s{seed}" + (f"/{tail}" if tail else "")
    return key, {"preset": preset, "seed": seed, **(overrides or {}), **point,
                 "output-dir": str(Path(run_dir).resolve()), "run-name": key.replace("/", "_")}


def interrupted(overrides: Mapping[str, Any]) -> Path | None:
    """The run folder of an earlier, interrupted run of this very configuration (picked up at its last checkpoint),
    else None. A checkpoint there that cannot be resumed, or that belongs to another configuration, is said on
    stderr before its run starts again from the beginning: a sweep never restarts a run silently."""
    from server_app.checkpoint import CHECKPOINT, read_config

    folder = Path(overrides["output-dir"]) / overrides["run-name"]
    if not (folder / CHECKPOINT).is_file() or (folder / "summary.json").is_file():
        return None
    try:
        if digest(read_config(folder)) == config_digest(overrides):
            return folder
        why = "its configuration is not this job's (the spec changed)"
    except ConfigError as err:
        why = str(err)
    print(f"warning: {folder}: an interrupted run's checkpoint that this job cannot resume ({why}); running the job "
          "again from its start", file=sys.stderr, flush=True)
    return None


def finished_run(overrides: Mapping[str, Any]) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """Run `overrides` in-process in this worker (one torch thread; an interrupted run of the same configuration
    is resumed) and return its folder, summary.json and metrics.jsonl rows."""
    import logging

    import torch

    from hybridfl.inprocess import run_inprocess

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = run_inprocess({"resume": str(folder)} if (folder := interrupted(overrides)) else dict(overrides))
    summary = json.loads((out / "summary.json").read_text())
    return out, summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def hardware() -> str:
    """Where a run's training ran: the GPU's name, or "cpu" (results made on either sit in one table)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def record(key: str, overrides: dict[str, Any], metric: str, val_metric: str, extra: str | None = None
           ) -> dict[str, Any]:
    """Run one job in this worker process and return its result line: the digest, the metric on test and
    validation, the final test accuracy, cost, the accuracy curves, and what the spec's `record` function adds."""
    out, summary, rows = finished_run(overrides)
    # the whole run's wall time over its resumes; this process's alone after a resume from an older checkpoint
    seconds = summary.get("run-wall-seconds")
    result = {"key": key, "config": config_digest(overrides), "test": summary[metric],
              "val": summary.get(val_metric), "final": summary.get("final-test-accuracy"),
              "seconds": summary["wall-seconds"] if seconds is None else seconds,
              "accepted": summary["total-accepted"], "hardware": hardware(),
              "curve": [[r["round"], r["test-accuracy"]] for r in rows if "test-accuracy" in r],
              "val-curve": [[r["round"], r["val-accuracy"]] for r in rows if "val-accuracy" in r],
              "folder": str(out)}
    return {**result, **(resolve("record", extra, IMPORTABLE)(out, summary, rows) if extra else {})}


Progress = Callable[..., None]  # (text, runs done, runs to do): hybridfl.progress.SweepProgress


def plain(text: str, done: int = 0, total: int = 0) -> None:
    print(text, flush=True)


Submit = Callable[[Callable[..., dict[str, Any]], str, dict[str, Any]], Future]


@dataclass(frozen=True)
class RayPlace:
    """Where a sweep's runs go on a Ray cluster: its address and what each run holds (Ray's num_cpus, num_gpus)."""

    address: str
    cpus: float = 1.0
    gpus: float = 0.0


@contextlib.contextmanager
def local_pool(workers: int) -> Iterator[Submit]:
    """``submit(one, key, overrides)`` into `workers` processes on this machine."""
    # spawned, not forked: a worker that trains on a GPU needs its own CUDA context
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool.submit


def _in_folder(folder: str, one: Callable[..., dict[str, Any]], key: str, overrides: dict[str, Any]
               ) -> dict[str, Any]:
    """A Ray task: `one` run from the driver's folder (the spec's relative paths; a shared file system)."""
    os.chdir(folder)
    return one(key, overrides)


@contextlib.contextmanager
def ray_pool(place: RayPlace) -> Iterator[Submit]:
    """``submit(one, key, overrides)`` as a task on the Ray cluster at `place`, holding its resources (a run whose
    node dies is run again on another node, from its last checkpoint: Ray retries a task whose worker died)."""
    from common.user_code import USER_DIR
    from hybridfl import cluster

    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), USER_DIR: os.getcwd(), "OMP_NUM_THREADS": "1"}
    with cluster.joined(place.address, env) as ray:
        cluster.check_fits(cluster.nodes(ray), place.cpus, place.gpus, f"the Ray cluster at {place.address}",
                           ("--run-num-cpus", "--run-num-gpus"))
        task = ray.remote(_in_folder).options(num_cpus=place.cpus, num_gpus=place.gpus, max_retries=3)
        yield lambda one, key, overrides: task.remote(os.getcwd(), one, key, overrides).future()


def run_all(jobs: Iterable[Job], path: Path, workers: int, one: Callable[..., dict[str, Any]],
            progress: Progress = plain, ray: RayPlace | None = None) -> Results:
    """Run the jobs without a current result in `path` (`workers` processes, or tasks on the Ray cluster `ray`),
    appending each result as it finishes; ``one(key, overrides)`` runs a job in a worker (a module-level function,
    or a partial of one); ``progress(text, done, total)`` hears of each. A run that raises is reported and the
    others go on (their results are kept); then :class:`RunsFailed` names each failed run and its error. Returns
    every result in `path` at the end, those another process appended meanwhile included."""
    done = load_results(path)
    todo = pending(list(dict(jobs).items()), done)  # a job listed twice runs once
    path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"{len(todo)} runs to do ({len(done)} already in {path})")
    if not todo:
        return done
    with ray_pool(ray) if ray else local_pool(workers) as submit:
        futures = {submit(one, k, o): k for k, o in todo}
        failed: dict[str, str] = {}
        for n, fut in enumerate(as_completed(futures), 1):
            try:
                result = fut.result()
            except Exception as err:  # noqa: BLE001 - one run's failure is reported; the other runs go on
                key = futures[fut]
                failed[key] = f"{type(err).__name__}: {err}"
                progress(f"[{n}/{len(todo)}] {key}: FAILED, {failed[key]}", n, len(todo))
                continue
            append(path, result)
            val = f"{result['val']:.4f}" if result.get("val") is not None else "—"
            progress(f"[{n}/{len(todo)}] {result['key']}: test {result['test']:.4f} val {val} "
                     f"({result['seconds']:.0f} s)", n, len(todo))
    if failed:
        raise RunsFailed(failed, path)
    return load_results(path)


class RunsFailed(RuntimeError):
    """Runs of a sweep that raised: ``failed`` maps each run's name to its error; the others' results are in the
    results file, and running the sweep again retries only what has no result."""

    def __init__(self, failed: Mapping[str, str], path: Path) -> None:
        self.failed = dict(failed)
        lines = "\n".join(f"  {key}: {error}" for key, error in self.failed.items())
        super().__init__(f"{len(self.failed)} run(s) failed (the other results are in {path}; run the sweep "
                         f"again to retry them):\n{lines}")


# -- the spec --------------------------------------------------------------------------------------------------------


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


# -- selection and the report ----------------------------------------------------------------------------------------


def mean_std(values: Sequence[float]) -> str:
    """Percent, mean ± sample std over seeds (fewer than three say how many: a row still missing a seed is not
    read as a full one)."""
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.1f} (1 seed)"
    spread = f"{statistics.mean(pct):.1f} ± {statistics.stdev(pct):.1f}"
    return spread if len(pct) > 2 else f"{spread} (2 seeds)"


def standard_error(scores: Sequence[float], validation_size: int) -> float:
    """One standard error of a candidate's mean validation score: over its seeds when it has two or more, else
    the binomial error of one accuracy on `validation_size` samples."""
    if len(scores) >= 2:
        return statistics.stdev(scores) / math.sqrt(len(scores))
    if validation_size <= 0:
        raise ValueError("one seed and no validation-size: no standard error to select with (give the spec "
                         "more seeds or `validation-samples`)")
    p = scores[0]
    return math.sqrt(p * (1 - p) / validation_size)


@dataclass(frozen=True)
class Candidate:
    """A grid point of one preset and its finished, current runs."""

    preset: str
    point: dict[str, Any]
    runs: list[dict[str, Any]]
    seeds: int  # how many the spec asks for
    overrides: dict[str, Any] = field(default_factory=dict)  # its first seed's run config
    rule: str = "one-se"  # how its preset's candidates are chosen
    block: str = ""  # its block's label

    @property
    def label(self) -> str:
        """Its block's label and its point (``key value, ...``), or "preset"."""
        point = ", ".join(f"{k} {v}" for k, v in self.point.items())
        return ": ".join(filter(None, [self.block, point])) or "preset"

    def values(self, name: str) -> list[Any]:
        """`name` of each of its runs that has it."""
        return [r[name] for r in self.runs if r.get(name) is not None]

    @property
    def complete(self) -> bool:
        return len(self.runs) == self.seeds and all(r.get("val") is not None for r in self.runs)

    def val(self) -> float:
        return statistics.fmean(r["val"] for r in self.runs)


def candidates(sweep: Sweep, results: Results) -> list[Candidate]:
    """Every block's candidates with their current results, in spec order."""
    return [Candidate(preset, point, [results[k] for k, o in jobs if current(results.get(k), o)], len(jobs),
                      jobs[0][1], block.select or sweep.select, block.label)
            for block, preset, point, jobs in sweep.rows()]


def choose(group: Sequence[Candidate], rule: str, validation_samples: int = 0) -> Candidate | None:
    """The candidate `rule` takes among one preset's `group`, on validation scores only; None until every
    candidate is complete (or for ``none``). One seed's standard error counts the run config's ``validation-size``
    samples, else `validation_samples` (where validation is the clients' own splits)."""
    if rule == "none" or not group or not all(c.complete for c in group):
        return None
    best = max(group, key=Candidate.val)  # ties: the first
    if rule == "best":
        return best
    from server_app.config import load_config

    size = load_config(best.overrides or {"preset": best.preset}).validation_size or validation_samples
    threshold = best.val() - standard_error([r["val"] for r in best.runs], size)
    return next(c for c in group if c.val() >= threshold)


def choices(sweep: Sweep, results: Results, found: list[Candidate] | None = None) -> dict[str, Candidate | None]:
    """Per preset, the chosen candidate (None where the rule has nothing to choose from yet); `found`: the
    sweep's :func:`candidates`, when already at hand."""
    by_preset: dict[str, list[Candidate]] = {}
    for c in candidates(sweep, results) if found is None else found:
        by_preset.setdefault(c.preset, []).append(c)
    return {p: choose(group, group[0].rule, sweep.validation_samples) for p, group in by_preset.items()}


def table(results: Results, sweep: Sweep) -> str:
    """The generic report: one row per preset and grid point, validation and test mean ± std over its seeds,
    seconds per run and where they ran (results of a CPU and of a GPU sit in one table); * marks each preset's
    choice by the spec's rule."""
    found = candidates(sweep, results)
    chosen = choices(sweep, results, found)
    rules = sorted({c.rule for c in found})
    lines = [f"Sweep {sweep.name}: {sweep.metric}; chosen on validation (*) by {' or '.join(rules)}", "",
             "| preset | candidate | runs | val % | test % | s per run |", "|---|---|---:|---|---|---:|"]
    last = None
    for c in found:
        mark = " *" if chosen.get(c.preset) == c else ""
        vals = [r["val"] for r in c.runs if r.get("val") is not None]
        where = ", ".join(sorted({r["hardware"] for r in c.runs if r.get("hardware")}))
        cells = [mean_std(vals) if vals else "—", mean_std([r["test"] for r in c.runs]) if c.runs else "—",
                 f"{statistics.fmean(r['seconds'] for r in c.runs):.0f}" + (f" ({where})" if where else "")
                 if c.runs else "—"]
        lines.append(f"| {c.preset if c.preset != last else ''} | {c.label}{mark} | {len(c.runs)}/{c.seeds} | "
                     + " | ".join(cells) + " |")
        last = c.preset
    return "\n".join(lines)


def plot(results: Results, sweep: Sweep, path: Path) -> None:
    """Test accuracy per step of each candidate (mean over its seeds), one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c in candidates(sweep, results):
        curves = [r["curve"] for r in c.runs if r.get("curve")]
        if curves and all(len(x) == len(curves[0]) for x in curves):
            ax.plot([s for s, _ in curves[0]], 100 * np.mean([[a for _, a in x] for x in curves], axis=0),
                    label=f"{c.preset} {c.label}" if c.point or c.block else c.preset)
    ax.set(title=f"sweep {sweep.name} (mean over seeds)", xlabel="round", ylabel="test accuracy (%)")
    ax.grid(alpha=0.3)
    if ax.lines:  # beside the axes: a tuning sweep has dozens of candidates
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), ncol=1 + len(ax.lines) // 25)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def report(sweep: Sweep, results: Results | None = None) -> str:
    """Write the sweep's report (the spec's `table` function, else :func:`table` and a plot beside it) from its
    results file, run nothing, and return the markdown."""
    results = load_results(sweep.results) if results is None else results
    sweep.report.parent.mkdir(parents=True, exist_ok=True)
    if sweep.table:
        text = resolve("table", sweep.table, IMPORTABLE)(results, sweep)
    else:
        text = table(results, sweep)
        plot(results, sweep, sweep.report.with_suffix(".png"))
    sweep.report.write_text(text + "\n")
    return text


def run(sweep: Sweep, workers: int = 1, progress: Progress = plain, ray: RayPlace | None = None) -> str:
    """Run the sweep's jobs that have no current result (`workers` in parallel, or on the Ray cluster `ray`), then
    :func:`report` (also when some failed: then :class:`RunsFailed` follows)."""
    try:
        results = run_all(sweep.jobs(), sweep.results, workers, sweep.worker(), progress, ray)
    except RunsFailed:
        report(sweep)
        raise
    return report(sweep, results)
