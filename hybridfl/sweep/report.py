"""Choosing on validation (the one-standard-error rule) and the report: a table of every candidate, a plot, or
the spec's own `table` function."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.user_code import resolve
from hybridfl.sweep.executors import IMPORTABLE
from hybridfl.sweep.spec import Sweep
from hybridfl.sweep.store import Results, current, load_results


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
