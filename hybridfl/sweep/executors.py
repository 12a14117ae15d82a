"""Running a sweep's jobs: one job in a worker process (resumed where it was interrupted) and its result line, the
workers on this machine or tasks on a Ray cluster, and every job without a current result."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.user_code import resolve
from hybridfl.sweep.store import Job, Results, append, config_digest, digest, load_results, pending

IMPORTABLE = "`module:function`, importable from here"  # what a spec's `record` and `table` name


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

    from hybridfl.engine.inprocess import run_inprocess

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
    """``submit(one, key, overrides)`` into `workers` processes on this machine. Left by an exception (Ctrl-C, the
    command's SIGTERM), it stops its workers mid-run (each run resumes from its checkpoint) and drops the queued
    runs: the pool's own exit would wait for every run submitted, the queued ones too."""
    # spawned, not forked: a worker that trains on a GPU needs its own CUDA context
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool.submit
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        workers_now = multiprocessing.active_children()  # the driver's only children are the pool's workers
        for worker in workers_now:
            worker.terminate()
        for worker in workers_now:
            worker.join(timeout=30)
        raise
    pool.shutdown(wait=True)


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
    from hybridfl.launch import cluster

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
