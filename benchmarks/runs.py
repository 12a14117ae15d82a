"""What every reproduction script shares: resumable, parallel runs of presets in worker processes.

A job is ``(key, overrides)``. Its result is one line of a results file (``runs.jsonl``), appended when
it finishes; a job whose result is there with the same resolved configuration (:func:`config_digest`) is
not run again, one whose preset changed since is. A run interrupted mid-way (a session ended) is picked up
at its last checkpoint (:func:`interrupted`). Several invocations may share a results file.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import multiprocessing
import statistics
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any


def digest(config: dict[str, Any]) -> str:
    """A digest of the keys that differ from their defaults (output folder aside): an option added later, at
    a default that reproduces the old behaviour, leaves the digests of finished runs as they were."""
    from server_app.config import RunConfig, option_specs

    defaults = {k: spec.default for k, spec in {**RunConfig.specs(), **option_specs()}.items()}
    kept = {k: v for k, v in config.items()
            if k not in ("output-dir", "run-name", "resume") and (k not in defaults or v != defaults[k])}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_digest(overrides: dict[str, Any]) -> str:
    """A digest of the run's resolved configuration (presets applied), output folder aside."""
    from server_app.config import load_config

    return digest(load_config(overrides).to_dict())


def interrupted(overrides: dict[str, Any]) -> Path | None:
    """The run folder of an earlier, interrupted run of this very configuration (a later session picks it up
    at its last checkpoint), else None."""
    from common.config import ConfigError
    from server_app.checkpoint import CHECKPOINT, read_config

    folder = Path(overrides["output-dir"]) / overrides["run-name"]
    if not (folder / CHECKPOINT).is_file() or (folder / "summary.json").is_file():
        return None
    try:
        same = digest(read_config(folder)) == config_digest(overrides)
    except ConfigError:  # an unusable checkpoint: start afresh
        return None
    return folder if same else None


def preset_job(preset: str, seed: int, extra: dict[str, Any] | None = None, rounds: int | None = None,
               root: str = "outputs/reproduce") -> tuple[str, dict[str, Any]]:
    """The job of `preset` at `seed` with `extra` overrides (and `rounds`, for quick looks): its key
    ``<preset>/s<seed>[/k=v,...]`` and its overrides, run in ``<root>/<key with _ for />``."""
    extra = {**(extra or {}), **({"num-rounds": rounds} if rounds else {})}
    tail = ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
    key = f"{preset}/s{seed}" + (f"/{tail}" if tail else "")
    return key, {"preset": preset, "seed": seed, **extra, "output-dir": str(Path(root).resolve()),
                 "run-name": key.replace("/", "_")}


def seeded(results: dict[str, dict[str, Any]], preset: str) -> list[dict[str, Any]]:
    """The reported runs of `preset`: one per seed, without extra overrides."""
    prefix = f"{preset}/s"
    return [r for k, r in sorted(results.items()) if k.startswith(prefix) and k[len(prefix):].isdigit()]


def ranking(results: dict[str, dict[str, Any]], grids: dict[str, list[tuple[str, dict[str, Any]]]]) -> str:
    """A markdown table of tuning grids (``{name: [(key, overrides), ...]}``): each grid's finished candidates
    (same configuration as now), best validation score first, ties in grid order; never ranked on test."""
    lines = ["| grid | candidate | val % | test % |", "|---|---|---:|---:|"]
    for name, jobs in grids.items():
        done = [(r["val"], r["test"], key.rsplit("/", 1)[1]) for key, overrides in jobs
                if (r := results.get(key)) is not None and r.get("config") == config_digest(overrides)]
        for rank, (val, test, label) in enumerate(sorted(done, key=lambda r: r[0], reverse=True)):
            lines.append(f"| {name if rank == 0 else ''} | {label}{' *' if rank == 0 else ''} | {100 * val:.1f} | "
                         f"{100 * test:.1f} |")
    return "\n".join(lines)


def mean_curves(ax: Any, curves: dict[str, list[list[list[float]]]], title: str, xlabel: str, bold: str = "",
                dashed: Sequence[str] = ()) -> None:
    """Accuracy (%) per step on `ax`: for each label, the mean over its runs' ``[[step, accuracy], ...]``."""
    import numpy as np

    for label, runs in curves.items():
        if runs:
            steps = [s for s, _ in runs[0]]
            acc = np.mean([[a for _, a in c] for c in runs], axis=0)
            ax.plot(steps, 100 * acc, label=label, lw=2.5 if bold and label.startswith(bold) else 1.2,
                    ls="--" if label in dashed else "-")
    ax.set(title=title, xlabel=xlabel, ylabel="test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def finished_run(overrides: dict[str, Any]) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """Run `overrides` in-process in this worker (one torch thread; an interrupted run of the same configuration
    is resumed) and return its folder, summary.json and metrics.jsonl rows."""
    import logging

    import torch

    from server_app.inprocess import run_inprocess

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = run_inprocess({"resume": str(folder)} if (folder := interrupted(overrides)) else overrides)
    summary = json.loads((out / "summary.json").read_text())
    return out, summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_results(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines())}


def pending(jobs: Iterable[tuple[str, dict[str, Any]]],
            done: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The jobs without a result, or whose result was made with another resolved configuration (a record
    made before digests were kept, without "config", is taken as it is)."""
    todo, stale = [], []
    for key, overrides in jobs:
        if key not in done:
            todo.append((key, overrides))
        elif done[key].get("config", "") not in ("", config_digest(overrides)):
            todo.append((key, overrides))
            stale.append(key)
    if stale:
        print(f"{len(stale)} runs again: their presets changed since they ran ({', '.join(stale)})", flush=True)
    return todo


def append(path: Path, result: dict[str, Any]) -> None:
    """One result line, appended under an exclusive lock: several invocations may share a results file."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(result) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def add_run_options(ap: argparse.ArgumentParser, results: Path) -> None:
    """The options every reproduction script has: --jobs, --rounds, --tune, --report, --results."""
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes, one torch thread each)")
    ap.add_argument("--rounds", type=int, default=None, help="override the presets' num-rounds (quick looks)")
    ap.add_argument("--tune", action="store_true", help="run the grids of --methods instead (validation split)")
    ap.add_argument("--report", action="store_true", help="run nothing: tabulate and plot the results so far")
    ap.add_argument("--results", type=Path, default=results)


Jobs = list[tuple[str, dict[str, Any]]]


def tune_or_run(args: argparse.Namespace, one: Callable[[tuple[str, dict[str, Any]]], dict[str, Any]],
                grids: Callable[[list[str] | None], dict[str, Jobs]], methods: list[str],
                jobs: Callable[[], Jobs], table: Callable[[dict[str, dict[str, Any]]], str],
                plot: Callable[[dict[str, dict[str, Any]], Path], None]) -> None:
    """With --tune: run the grids of `methods` (``grids(methods)``; ``grids(None)`` is every grid) and write
    their ranking to tuning.md; otherwise run `jobs()`, write table.md and accuracy.png. With --report, run
    nothing and tabulate what the results files hold. Everything written is also printed."""
    args.results.mkdir(parents=True, exist_ok=True)
    if args.tune:
        todo = [j for g in grids(methods).values() for j in g]
        done = run_all([] if args.report else todo, args.results / "tuning.jsonl", args.jobs, one)
        text, out = ranking(done, grids(None)), args.results / "tuning.md"
    else:
        results = run_all([] if args.report else jobs(), args.results / "runs.jsonl", args.jobs, one)
        text, out = table(results), args.results / "table.md"
        plot(results, args.results / "accuracy.png")
    out.write_text(text + "\n")
    print(text)


def run_all(jobs: Iterable[tuple[str, dict[str, Any]]], path: Path, workers: int,
            one: Callable[[str, dict[str, Any]], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run the jobs not yet in `path` (in parallel), appending each result as it finishes. ``one(key, overrides)``
    runs a job in a worker process (a module-level function) and returns its result: ``key``, ``config``
    (:func:`config_digest`), ``test``, ``val``, ``seconds`` and whatever the table needs. Returns every result
    in `path` at the end, those another process appended meanwhile included, so that a table written from it
    misses none of a parallel lane's runs."""
    done = load_results(path)
    todo = pending(list(dict(jobs).items()), done)  # a job listed twice runs once
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(todo)} runs to do ({len(done)} already in {path})", flush=True)
    # spawned, not forked: a worker that trains on a GPU needs its own CUDA context
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(one, k, o): k for k, o in todo}
        for n, fut in enumerate(as_completed(futures), 1):
            result = fut.result()
            done[result["key"]] = result
            append(path, result)
            print(f"[{n}/{len(todo)}] {result['key']}: test {result['test']:.4f} val {result['val']:.4f} "
                  f"({result['seconds']:.0f} s)", flush=True)
    return load_results(path)


def mean_std(values: Sequence[float]) -> str:
    """Percent, mean ± sample std over seeds (one seed says so)."""
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.1f} (1 seed)"
    return f"{statistics.mean(pct):.1f} ± {statistics.stdev(pct):.1f}"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
