"""The mixing paper's experiment (its Figure 1: CelebA smiling, federated data = smiling faces, central data = the
rest), as a label-shift benchmark on Fashion-MNIST (``configs/mixing-fmnist/``): what a run records and how the
table reads. The runs are the sweep ``benchmarks/sweeps/mixing-fmnist.yaml``.

Two settings: ``binary`` (a two-class task; the clients hold only positives, the server only negatives) and
``classes10`` (the clients hold classes 0–6, the server samples of 7–9); evaluation on the full test
distribution. Rows: no mixing (FedAvg on the clients' data), the three mixing variants (parallel training,
example transfer, gradient transfer), the oracle (every class federated), and Fed+FT and HFCL from the Feddle
family. Metric: test accuracy, the max of the last five evaluations (every 5 rounds), mean ± std over 3 seeds,
with each run's extra downlink bytes per client dispatch beside it (examples × example size; one model-sized
gradient) and the accuracy on the classes the clients lack. The tuning sweep (``mixing-fmnist-tune.yaml``: seed
100, classes10, the validation split) takes the clients' SGD lr with no mixing, then each variant's open choices.

    hybridfl sweep benchmarks/sweeps/mixing-fmnist-tune.yaml --jobs 2
    hybridfl sweep benchmarks/sweeps/mixing-fmnist.yaml --jobs 2
    hybridfl report benchmarks/sweeps/mixing-fmnist.yaml
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.runs import mean_curves, pyplot, seeded
from hybridfl.sweep import Results, Sweep, mean_std

FAMILY = "mixing-fmnist"
SETTINGS = ("binary", "classes10")
METHODS: list[tuple[str, str]] = [("nomix", "no mixing (FedAvg, clients' data)"), ("parallel", "parallel training"),
                                  ("example", "example transfer"), ("gradient", "gradient transfer"),
                                  ("oracle", "oracle (all data federated)"), ("fedft", "Fed+FT"), ("hfcl", "HFCL")]


def lacking_classes(setting: str) -> tuple[int, ...]:
    """The classes the clients of `setting` lack (its central-classes; the oracle's clients hold them)."""
    from common.datasets import class_ids
    from server_app.config import load_config

    return class_ids(load_config({"preset": f"{FAMILY}/{setting}"}).central_classes)


def lacking_accuracy(out: Path, lacking: Sequence[int]) -> float:
    """The final model of the run in `out` on the test samples of the classes `lacking`."""
    import numpy as np
    import torch

    from common.models import build_from_config
    from common.splits import data_spec, make_splits
    from common.training import evaluate
    from server_app.checkpoint import read_config
    from server_app.config import load_config

    cfg = load_config(read_config(out))
    test = make_splits(data_spec(cfg)).test
    model = build_from_config(cfg.to_dict(), test.x.shape[1:], test.num_classes, seed=cfg.seed)
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    return evaluate(model, test.subset(np.flatnonzero(np.isin(test.y, lacking))))["accuracy"]


def record(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The final model's accuracy on the classes the clients lack, and the extra downlink bytes per dispatch."""
    setting = summary["config"]["preset"].rsplit("-", 1)[1]
    return {"lacking": lacking_accuracy(out, lacking_classes(setting)),
            "extra-bytes": summary["extra-bytes-down-per-dispatch"] or 0}


def cells(results: Results, method: str, setting: str) -> list[dict[str, Any]]:
    return seeded(results, f"{FAMILY}/{method}-{setting}")


def table(results: Results, sweep: Sweep | None = None) -> str:
    """The table (and, given the `sweep`, ``accuracy.png`` beside its report)."""
    head = " | ".join(f"{s}: test % | on the lacking classes % | extra KB down per dispatch" for s in SETTINGS)
    lines = [f"| Method | {head} |", "|---|" + "---|---|---|" * len(SETTINGS)]
    for method, label in METHODS:
        row = []
        for setting in SETTINGS:
            got = cells(results, method, setting)
            row += [mean_std([r["test"] for r in got]), mean_std([r["lacking"] for r in got]),
                    f"{statistics.fmean([r['extra-bytes'] for r in got]) / 1e3:.1f}"] if got else ["—"] * 3
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    if sweep is not None:
        plot(results, sweep.report.parent / "accuracy.png")
    return "\n".join(lines)


def plot(results: Results, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, setting in zip(axes, SETTINGS):
        mean_curves(ax, {label: [r["curve"] for r in cells(results, m, setting)] for m, label in METHODS},
                    f"{setting} (mean over seeds)", "round", dashed=["oracle (all data federated)"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
