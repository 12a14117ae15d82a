"""Experiment tracking: a run's metrics also go, step by step, to TensorBoard event files or to an MLflow store.

``tracking = "tensorboard"`` writes ``<run>/tensorboard/`` (``tensorboard --logdir outputs``): every number of
every step (accuracies, losses, staleness, accepted / rejected, a method's own per-step metrics such as Feddle's
coefficients) as a scalar, every list of numbers as a histogram, and every matrix a personalised evaluation
reports (FedMerge's merging weights) as an image. ``tracking = "mlflow"`` logs the run's configuration as
params, the same scalars as metrics and, at the end, the run folder's outputs as artifacts, to ``tracking-uri``
(default: a local store, ``<output-dir>/mlruns``; ``mlflow ui --backend-store-uri <it>``), experiment
``experiment`` (default: the preset; a sweep names its own). Both packages are optional extras
(``pip install 'hybridfl[tracking]'``); asking for one that is not installed fails at start.
A resumed run goes on in the same MLflow run (its id is kept in ``<run>/tracking.json``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import OneOf, option
from common.errors import ConfigError

BACKENDS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # backend -> the module it needs


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where a run's metrics go besides its own files (none of it changes a result)."""

    tracking: str = option("", OneOf(("", *BACKENDS)), "also log every step's metrics to TensorBoard event files "
                           "(`<run>/tensorboard/`) or an MLflow store; empty = the run's own files only")
    experiment: str = option("", None, "the experiment a tracked run belongs to (default: its preset; a sweep: the "
                             "sweep's name)", "name")
    tracking_uri: str = option("", None, "MLflow's tracking URI (default: `<output-dir>/mlruns`, a local store)",
                               "URI")


def check_tracking(cfg: TrackingConfig) -> None:
    """Refuse a backend whose package is not installed, at start, naming the extra that brings it."""
    module = BACKENDS.get(cfg.tracking)
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError("tracking", cfg.tracking, f"an installed backend: `{module}` is not installed here "
                          "(pip install 'hybridfl[tracking]')")


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and k != "round"}


class Tracker:
    """No tracking: the run's own files only."""

    def round(self, row: dict[str, Any]) -> None:
        """One round's row of metrics.jsonl."""

    def clients(self, row: dict[str, Any]) -> None:
        """One personalised evaluation (a row of clients.jsonl)."""

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's end: its summary."""


class TensorBoard(Tracker):
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def round(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        for k, v in _scalars(row).items():
            self.writer.add_scalar(k, v, step)
        for k, v in row.items():
            if isinstance(v, list) and v and all(isinstance(x, int | float) for x in v):
                self.writer.add_histogram(k, _array(v), step)
        self.writer.flush()

    def clients(self, row: dict[str, Any]) -> None:
        import numpy as np

        for k, v in row.items():  # a matrix (one row per client): an image, each row scaled to [0, 1] over all
            if isinstance(v, list) and v and all(isinstance(x, list) and x for x in v):
                m = np.nan_to_num(_array(v).astype(float))
                span = m.max() - m.min()
                self.writer.add_image(k, (m - m.min()) / (span if span > 0 else 1), int(row["round"]),
                                      dataformats="HW")
        self.writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", "```\n" + json.dumps(_scalars(summary), indent=1) + "\n```")
        self.writer.close()


def _array(values: list[Any]) -> Any:
    import numpy as np

    return np.asarray(values, dtype=float)


class Mlflow(Tracker):
    STATE = "tracking.json"

    def __init__(self, out: Path, config: dict[str, Any], experiment: str, uri: str) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store (mlflow ≥ 3 asks to opt in)
        import mlflow

        self.mlflow, self.out = mlflow, out
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        state = out / self.STATE
        run_id = json.loads(state.read_text())["mlflow-run-id"] if state.is_file() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else out.name)
        if run_id is None:  # a resumed run already has them (and MLflow refuses a param changed)
            mlflow.log_params({k: json.dumps(v) if isinstance(v, dict) else v for k, v in config.items()})
            state.write_text(json.dumps({"mlflow-run-id": self.run.info.run_id}) + "\n")

    def round(self, row: dict[str, Any]) -> None:
        self.mlflow.log_metrics(_scalars(row), step=int(row["round"]))

    def finish(self, summary: dict[str, Any]) -> None:
        self.mlflow.log_metrics({f"summary.{k}": v for k, v in _scalars(summary).items()})
        for path in sorted(self.out.iterdir()):
            if path.is_file() and path.name != "checkpoint.pt":
                self.mlflow.log_artifact(str(path))
        self.mlflow.end_run()


class Trackers(Tracker):
    """Several trackers, each told everything in turn."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def round(self, row: dict[str, Any]) -> None:
        for t in self.trackers:
            t.round(row)

    def clients(self, row: dict[str, Any]) -> None:
        for t in self.trackers:
            t.clients(row)

    def finish(self, summary: dict[str, Any]) -> None:
        for t in self.trackers:
            t.finish(summary)


Watcher = Callable[[Any, Path], Tracker]  # (the run's configuration, its folder) -> a tracker
_WATCHERS: list[Watcher] = []


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Every run started in this process meanwhile also reports to ``watcher(cfg, out)`` (the command's
    progress line for an in-process run: the engine runs the ServerApp in this process)."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def open_tracker(cfg: Any, out: Path) -> Tracker:
    """The run's tracker (`cfg`: the run's configuration, its backend checked by ``load_config``), with whatever
    is watching this process's runs."""
    trackers = [watcher(cfg, out) for watcher in _WATCHERS]
    if cfg.tracking == "tensorboard":
        trackers.append(TensorBoard(out))
    elif cfg.tracking == "mlflow":
        uri = cfg.tracking_uri or Path(cfg.output_dir, "mlruns").resolve().as_uri()
        trackers.append(Mlflow(out, cfg.to_dict(), cfg.experiment or cfg.preset, uri))
    return Trackers(trackers)
