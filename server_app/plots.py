"""The run's plots, drawn when it ends: ``accuracy.png`` (and ``accuracy-device-time.png`` where the run kept device
time), ``staleness.png``, ``personal.png`` (a run that evaluates its clients) and the method's own figures, which a
strategy returns as data (``Strategy.figures``, :class:`common.figures.Figure`) and this module draws."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from common.figures import Figure


def write_plots(out: Path, rows: list[dict[str, Any]], staleness: list[int], figures: dict[str, Figure]) -> None:
    """Every plot of the run in `out`, from its metrics.jsonl `rows`, the accepted updates' `staleness` and the
    method's `figures` by file name."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    evals = [r for r in rows if "test-accuracy" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["round"] for r in evals], [r["test-accuracy"] for r in evals], marker="o", ms=3)
    ax.set(xlabel="round", ylabel="test accuracy")
    ax.set_title(out.name, fontsize=9)
    ax.grid(alpha=0.3)
    _save(fig, out / "accuracy.png")

    if evals and evals[-1].get("device-t", 0) > 0:  # a fleet's device time: the same curve against it
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["device-t"] / 3600 for r in evals], [r["test-accuracy"] for r in evals], marker="o", ms=3)
        ax.set(xlabel="device time (hours)", ylabel="test accuracy")
        ax.set_title(f"{out.name}: time to accuracy", fontsize=9)
        ax.grid(alpha=0.3)
        _save(fig, out / "accuracy-device-time.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(staleness, bins=np.arange(max(staleness, default=0) + 2) - 0.5, color="tab:orange")
    ax.set(xlabel="staleness (versions)", ylabel="accepted updates")
    ax.set_title(f"{out.name}: staleness", fontsize=9)
    _save(fig, out / "staleness.png")

    personal = [r for r in rows if r.get("personal-clients")]
    if personal:  # personalised evaluation: each client's model on its own test split
        rounds = [r["round"] for r in personal]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.fill_between(rounds, [r["personal-accuracy-q25"] for r in personal],
                        [r["personal-accuracy-q75"] for r in personal], alpha=0.25, label="quartiles")
        ax.plot(rounds, [r["personal-accuracy"] for r in personal], marker="o", ms=3, label="mean over clients")
        ax.plot(rounds, [r["personal-accuracy-min"] for r in personal], ls=":", label="worst client")
        ax.set(xlabel="round", ylabel="personalised test accuracy")
        ax.legend(fontsize=8)
        ax.set_title(out.name, fontsize=9)
        ax.grid(alpha=0.3)
        _save(fig, out / "personal.png")

    for name, figure in figures.items():
        _save(draw(figure, f"{out.name}: {figure.title}"), out / name)


def draw(figure: Figure, title: str) -> Any:
    """`figure` as a matplotlib figure under `title`: its panels side by side, lines with a legend, images with a
    colour bar."""
    from matplotlib import pyplot as plt

    images = any(p.image is not None for p in figure.panels)
    fig, axes = plt.subplots(1, len(figure.panels), squeeze=False,
                             figsize=(3.2 * len(figure.panels) + 1, 4) if images else (4.3 * len(figure.panels), 3.6))
    for ax, panel in zip(axes[0], figure.panels):
        for label, (x, y) in panel.lines.items():
            ax.plot(x, y, label=label)
        if len(panel.lines) > 1:
            ax.legend(fontsize=8)
        if panel.image is not None:
            shown = ax.imshow(np.array(panel.image), aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
            fig.colorbar(shown, ax=ax, fraction=0.08)
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel, title=panel.title)
    fig.suptitle(title, fontsize=9)
    return fig


def _save(fig: Any, path: Path) -> None:
    from matplotlib import pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
