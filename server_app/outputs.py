"""The run's outputs: ``outputs/<run>/{metrics.jsonl, events.jsonl, summary.json, model.pt, *.png}``, and
``clients.jsonl`` in a run that evaluates its clients (``client-test-fraction``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.figures import Figure
from common.user_code import is_import_path
from server_app.config import RunConfig
from server_app.plots import write_plots
from server_app.presets import read_preset
from server_app.tracking import Tracker


def run_dir(cfg: RunConfig, root: Path | None = None) -> Path:
    """Create and return ``<root>/<run-name>`` (root defaults to output-dir).

    An empty run-name becomes ``<label>-s<seed>-<timestamp>`` (:func:`run_label`), with ``-2``, ``-3``… when another
    run took that name in the same second, so no run writes into another's folder.
    """
    root = root or Path(cfg.output_dir).expanduser().resolve()
    if cfg.run_name:
        path = root / cfg.run_name
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = f"{run_label(cfg)}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = root / base, 1
    while True:
        try:
            path.mkdir(parents=True)  # atomic: of two runs, one gets the name
            return path
        except FileExistsError:
            k += 1
            path = root / f"{base}-{k}"


def run_label(cfg: RunConfig) -> str:
    """What a run is named after: its preset (its folders, and a user preset's ``package:``, joined by '-': no ':' in a
    folder name); or, when its method or data are not the preset's, the two (``FedAvgM-breast_cancer``: an import
    path by its last name), so a run on one's own data is not named after the preset's."""
    preset, defaults = read_preset(cfg.preset), RunConfig()
    ran = {"strategy": cfg.strategy, "dataset": cfg.dataset}
    chosen = ran.values() if any(preset.get(k, getattr(defaults, k)) != v for k, v in ran.items()) else [cfg.preset]
    return "-".join(v.rpartition(":")[2] if is_import_path(v) else v.replace("/", "-").replace(":", "-")
                    for v in chosen)


def papers_metric(accuracies: list[float]) -> float | None:
    """The Feddle papers' reported number: the max over the last five evaluations."""
    return max(accuracies[-5:]) if accuracies else None


def _kept_lines(path: Path, count: int) -> list[str]:
    """The first `count` complete lines of `path`, the file cut to them (a killed run may have written more)."""
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")][:count]
    if len(lines) < count:
        raise RuntimeError(f"{path} has {len(lines)} complete lines, fewer than the checkpoint's {count}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(path)
    return lines


def _ratio(rows: list[dict[str, Any]], num: str, den: str) -> float | None:
    """Σ num / Σ den over the rows (payload bytes per dispatch or per update), None when Σ den = 0."""
    total = sum(r.get(den, 0) for r in rows)
    return sum(r.get(num, 0) for r in rows) / total if total else None


def personal_selection(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The personalised headline: the final mean accuracy over clients, and the one at the evaluation with the
    lowest mean validation loss over clients (the FedMerge paper's model selection), when there are any."""
    evals = [r for r in rows if r.get("personal-clients")]
    if not evals:
        return {}
    out = {"personal-final-accuracy": evals[-1]["personal-accuracy"]}
    selectable = [r for r in evals if "personal-val-loss" in r]
    if selectable:
        best = min(selectable, key=lambda r: r["personal-val-loss"])  # ties: the earliest
        out.update({"personal-selected-accuracy": best["personal-accuracy"], "personal-selected-round": best["round"],
                    "val-personal-selected-accuracy": best.get("personal-val-accuracy")})
    return out


class Recorder:
    """Appends one JSON line per round and per event, and writes the summary, the model and the plots at the end.

    `position` (from :meth:`state_dict`) resumes a run: both files are cut back to what the checkpoint
    had recorded, and what the rest of the run writes follows on. `tracker` gets every row as it is written
    (``tracking``).
    """

    def __init__(self, path: Path, position: dict[str, int] | None = None, tracker: Tracker | None = None) -> None:
        self.path = path
        self.tracker = tracker or Tracker()
        self.rows: list[dict[str, Any]] = []
        self.staleness: list[int] = []
        self.outcomes: dict[str, int] = {}
        self.events = 0
        self.first_event_t: float | None = None
        self.last_event_t = 0.0
        self.client_rows: list[dict[str, Any]] = []
        clients = path / "clients.jsonl"  # written from a run's first personalised evaluation on
        if position is None:
            for name in ("metrics.jsonl", "events.jsonl"):
                (path / name).write_text("")
            clients.unlink(missing_ok=True)  # a named folder's earlier run's
            return
        self.rows = [json.loads(line) for line in _kept_lines(path / "metrics.jsonl", position["rows"])]
        for line in _kept_lines(path / "events.jsonl", position["events"]):
            self._count(json.loads(line))
        count = position.get("clients", 0)
        kept = _kept_lines(clients, count) if count or clients.exists() else []
        self.client_rows = [json.loads(line) for line in kept]

    def state_dict(self) -> dict[str, int]:
        """The recorder's position: rows, events and per-client rows written so far."""
        return {"rows": len(self.rows), "events": self.events, "clients": len(self.client_rows)}

    def round(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        self.tracker.round(row)

    def clients(self, row: dict[str, Any]) -> None:
        """One personalised evaluation: each client's metrics (and the strategy's per-client report)."""
        self.client_rows.append(row)
        with open(self.path / "clients.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        self.tracker.clients(row)

    def _count(self, event: dict[str, Any]) -> None:
        if event["outcome"] == "accepted":
            self.staleness.append(event["staleness"])
        self.outcomes[event["outcome"]] = self.outcomes.get(event["outcome"], 0) + 1
        self.first_event_t = event["t"] if self.first_event_t is None else self.first_event_t
        self.last_event_t = event["t"]
        self.events += 1

    def event(self, event: dict[str, Any]) -> None:
        """One update handed over or lost: client, base version, dispatch and arrival round, staleness, outcome."""
        self._count(event)
        with open(self.path / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    def totals(self) -> dict[str, int]:
        """The run's replies so far by outcome: accepted, failures, rejected, timeouts, vanished (a fleet's device
        went offline), unavailable (the SuperLink no longer held the message or its reply)."""
        return {k: sum(r.get(k, 0) for r in self.rows)
                for k in ("accepted", "failures", "rejected", "timeouts", "vanished", "unavailable")}

    def finish(self, summary: dict[str, Any], models: dict[str, dict[str, torch.Tensor]],
               figures: Callable[[list[dict[str, Any]], list[dict[str, Any]]], dict[str, Figure]],
               plots: bool = True) -> dict[str, Any]:
        """Write summary.json, ``model.pt`` (the headline model's ``state_dict``; ``models.pt`` holds all of
        them by name when the strategy has several) and, with `plots`, the plots, the method's own from
        ``figures(rows, client_rows)`` (``Strategy.figures``); return the summary."""
        evals = [r for r in self.rows if "test-accuracy" in r]
        accs = [r["test-accuracy"] for r in evals]
        totals = self.totals()
        summary = {
            **summary,
            "final-test-accuracy": accs[-1] if accs else None,
            "final-test-loss": evals[-1]["test-loss"] if evals else None,
            "best-test-accuracy": max(accs) if accs else None,
            "max-last-5-evals": papers_metric(accs),
            "val-max-last-5-evals": papers_metric([r["val-accuracy"] for r in evals if "val-accuracy" in r]),
            **{f"total-{k}": v for k, v in totals.items()},
            "device-time-s": self.rows[-1].get("device-t", 0.0) if self.rows else 0.0,
            "updates-per-s": self._rate(),
            "bytes-down-per-dispatch": _ratio(self.rows, "bytes-down", "sampled"),
            "extra-bytes-down-per-dispatch": _ratio(self.rows, "bytes-extra-down", "sampled"),
            "bytes-up-per-update": _ratio(self.rows, "bytes-up", "accepted"),
            "pulled-bytes-per-reply": _ratio(self.rows, "pulled-bytes", "pulled-replies"),
            "staleness-mean": float(np.mean(self.staleness)) if self.staleness else None,
            "staleness-max": int(max(self.staleness)) if self.staleness else None,
            **personal_selection(self.rows),
        }
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        torch.save(next(iter(models.values())), self.path / "model.pt")
        if len(models) > 1:
            torch.save(models, self.path / "models.pt")
        if plots:
            write_plots(self.path, self.rows, self.staleness, figures(self.rows, self.client_rows))
        self.tracker.finish(summary)
        return summary

    def _rate(self) -> float | None:
        """Accepted updates per second of wall time between the first and the last event."""
        span = self.last_event_t - (self.first_event_t or 0.0)
        return self.outcomes.get("accepted", 0) / span if span > 0 else None
