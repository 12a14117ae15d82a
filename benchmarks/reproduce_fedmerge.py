"""FedMerge's classic-FL experiment (paper §4.1, Fig. 3, Table 2), on Fashion-MNIST (``configs/fedmerge-fmnist/``):
what a run records and how the table reads. The runs are the sweep ``benchmarks/sweeps/fedmerge-fmnist.yaml``.

Two settings, ``cluster`` (5 clusters of clients, 3 classes each as the code draws them) and ``personal``
(Dirichlet 0.1); 50 clients, all in every round. Rows: FedMerge, the Fixed (k/15) ablation, FedAvg,
FedAvg+, Local, IFCA, FedEM and Ditto (not in the paper: hybridfl's worked example of a method with client
state), at the protocol's d (``global-models``) over 3 seeds, and FedMerge's d sweep ({1, 5, 10, 15}, seed 0).
Metric: the mean over clients of each client's accuracy on its own test split at the evaluation with the lowest
mean validation loss (the paper's model selection; ``personal-selected-accuracy``). For FedMerge on the cluster
split the table also says whether the learned weights found the ground-truth clusters: the adjusted Rand index of
the rows' argmax against each client's class set, and the mean L1 distance of weight rows within and between true
clusters. The tuning sweep (``fedmerge-fmnist-tune.yaml``: seed 100, cluster setting, validation split) takes the
clients' lr with FedAvg, then Ditto's λ at that lr.

The table is ``table.md``, the curves ``personal.png``, seed 0's FedMerge heatmaps (d > 1) copied to
``merge-weights-<setting>-d<d>.png``, all beside the results; the paper's numbers are
``benchmarks/sweeps/fedmerge-fmnist.paper.yaml``.

    hybridfl sweep benchmarks/sweeps/fedmerge-fmnist-tune.yaml --jobs 2
    hybridfl sweep benchmarks/sweeps/fedmerge-fmnist.yaml --jobs 2
    hybridfl report benchmarks/sweeps/fedmerge-fmnist.yaml
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import yaml

from benchmarks.runs import pyplot
from hybridfl.sweep import Results, Sweep, mean_std

FAMILY = "fedmerge-fmnist"
SETTINGS = ("cluster", "personal")
# (preset method, label) in the table's order
METHODS: list[tuple[str, str]] = [("fedmerge", "FedMerge"), ("fedavg", "FedAvg"), ("ifca", "IFCA"),
                                  ("fedmerge-fixed", "Fixed (5/15)"), ("fedavg-plus", "FedAvg+"), ("local", "Local"),
                                  ("fedem", "FedEM"), ("ditto", "Ditto")]
SWEEP = (1, 5, 10, 15)  # FedMerge's d; 5 is the protocol's
PAPER = Path(__file__).resolve().parent / "sweeps" / f"{FAMILY}.paper.yaml"


def cluster_recovery(out: Path) -> dict[str, float]:
    """How far the last evaluation's merging weights found the ground truth: clients holding the same class
    set are one true cluster (the clusters partitioner gives every client of a cluster each of its classes)."""
    import numpy as np
    from sklearn.metrics import adjusted_rand_score

    from common.splits import client_partition, data_spec
    from server_app.checkpoint import read_config
    from server_app.config import load_config

    last = json.loads((out / "clients.jsonl").read_text().splitlines()[-1])
    if "merge-weights" not in last:
        return {}
    spec = data_spec(load_config(read_config(out)))
    truth_sets = [frozenset(np.unique(client_partition(spec, c).y).tolist()) for c in last["clients"]]
    ids = {s: i for i, s in enumerate(dict.fromkeys(truth_sets))}
    truth = np.array([ids[s] for s in truth_sets])
    w = np.array(last["merge-weights"])[last["clients"]]
    dist = np.abs(w[:, None, :] - w[None, :, :]).sum(-1)
    same, off = truth[:, None] == truth[None, :], ~np.eye(len(w), dtype=bool)
    return {"ari": float(adjusted_rand_score(truth, w.argmax(1))),
            "within": float(dist[same & off].mean()) if (same & off).any() else float("nan"),
            "between": float(dist[~same].mean()) if (~same).any() else float("nan")}


def record(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's personalised numbers (the sweep records the headline, ``personal-selected-accuracy``, and its
    validation score): the final and the worst client's accuracy, the payload, the personalised curve, and the
    cluster recovery."""
    selected = next(r for r in rows if r["round"] == summary["personal-selected-round"])
    return {"final": summary["personal-final-accuracy"], "worst": selected["personal-accuracy-min"],
            "bytes-down": summary["bytes-down-per-dispatch"], "bytes-up": summary["bytes-up-per-update"],
            "curve": [[r["round"], r["personal-accuracy"]] for r in rows if "personal-accuracy" in r],
            **cluster_recovery(out)}


def _cells(results: dict[str, dict[str, Any]], method: str, setting: str, extra: str = "") -> list[dict[str, Any]]:
    prefix = f"{FAMILY}/{method}-{setting}/s"
    return [r for k, r in sorted(results.items()) if k.startswith(prefix)
            and k[len(prefix):].partition("/")[2] == extra and k[len(prefix):].split("/")[0].isdigit()]


def table(results: Results, sweep: Sweep | None = None) -> str:
    """The table (and, given the `sweep`, its figures beside its report: the curves and seed 0's heatmaps)."""
    paper_table_2 = yaml.safe_load(PAPER.read_text())
    lines = ["| Method | Cluster | Personal | worst client (cluster) | MB down / up per client-round | "
             "paper Table 2, CIFAR-100 (cluster; personal) |", "|---|---|---|---|---|---|"]
    for method, label in METHODS:
        got = {s: _cells(results, method, s) for s in SETTINGS}
        cost = next((f"{r['bytes-down'] / 1e6:.2f} / {r['bytes-up'] / 1e6:.2f}" for r in got["cluster"]), "—")
        paper = "; ".join(paper_table_2[s].get(method, "—") for s in SETTINGS)
        lines.append(f"| {label} | " + " | ".join(mean_std([r["test"] for r in got[s]]) if got[s] else "—"
                                                  for s in SETTINGS)
                     + f" | {mean_std([r['worst'] for r in got['cluster']]) if got['cluster'] else '—'} | {cost} "
                       f"| {paper} |")
    lines += ["", "FedMerge's d (seeds as run; cluster-recovery on the cluster split: ARI of argmax rows, mean L1 "
              "distance of weight rows within / between true clusters):", "",
              "| d | Cluster | Personal | ARI | within | between |", "|---|---|---|---|---|---|"]
    for d in SWEEP:
        got = {s: _cells(results, "fedmerge", s, f"global-models={d}") or
               [r for r in _cells(results, "fedmerge", s) if d == 5] for s in SETTINGS}
        rec = got["cluster"]
        fmt = lambda k: f"{statistics.fmean([r[k] for r in rec]):.2f}" if rec and k in rec[0] else "—"
        accuracy = (mean_std([r["test"] for r in got[s]]) if got[s] else "—" for s in SETTINGS)
        lines.append(f"| {d} | " + " | ".join(accuracy) + f" | {fmt('ari')} | {fmt('within')} | {fmt('between')} |")
    if sweep is not None:
        plot(results, sweep.report.parent / "personal.png")
        heatmaps(results, sweep.report.parent)
    return "\n".join(lines)


def plot(results: Results, path: Path) -> None:
    import numpy as np

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, setting in zip(axes, SETTINGS):
        for method, label in METHODS:
            runs = _cells(results, method, setting)
            if runs:
                steps = [s for s, _ in runs[0]["curve"]]
                acc = np.mean([[a for _, a in r["curve"]] for r in runs], axis=0)
                ax.plot(steps, 100 * acc, marker="o", ms=3, label=label, lw=2.5 if method == "fedmerge" else 1.2)
        ax.set(title=setting, xlabel="round", ylabel="personalised accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def heatmaps(results: Results, folder: Path) -> None:
    """Seed 0's FedMerge weight heatmaps (d > 1) copied into `folder`, while this machine still has the runs'
    folders (a copy whose run is gone stays)."""
    for setting in SETTINGS:
        for d in SWEEP[1:]:
            run = results.get(f"{FAMILY}/fedmerge-{setting}/s0" + ("" if d == 5 else f"/global-models={d}"))
            heatmap = Path(run["folder"]) / "merge-weights.png" if run and "folder" in run else None
            if heatmap and heatmap.is_file():
                shutil.copy(heatmap, folder / f"merge-weights-{setting}-d{d}.png")
