"""A figure as data: what a method's plots of a run show (``Strategy.figures``), drawn by the outputs
(server_app/plots.py), so that a strategy computes what to show and never draws."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Panel:
    """One plot: lines by label (x values, y values), or an image (a matrix, one row per client), on labelled axes."""

    xlabel: str
    ylabel: str
    lines: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    image: list[list[float]] | None = None
    title: str = ""


@dataclass(frozen=True)
class Figure:
    """Panels side by side under one title (the outputs prefix it with the run's name)."""

    title: str
    panels: list[Panel]
