"""What the benchmarks share: the reproduction families' runs' rows and curves (running them is the sweep
machinery's: hybridfl/sweep/, ``hybridfl sweep``), and a timing's median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def seeded(results: dict[str, dict[str, Any]], preset: str) -> list[dict[str, Any]]:
    """The reported runs of `preset`: one per seed, without extra overrides."""
    prefix = f"{preset}/s"
    return [r for k, r in sorted(results.items()) if k.startswith(prefix) and k[len(prefix):].isdigit()]


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


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
