"""FedMerge's classic-FL experiment (paper §4.1, Fig. 3, Table 2), on Fashion-MNIST (``configs/fedmerge-fmnist/``).

Two settings, ``cluster`` (5 clusters of clients, 3 classes each as the code draws them) and ``personal``
(Dirichlet 0.1); 50 clients, all in every round. Rows: FedMerge, the Fixed (k/15) ablation, FedAvg,
FedAvg+, Local, IFCA, FedEM and Ditto (not in the paper: hybridfl's worked example of a method with client
state), at the protocol's d (``global-models``) with ``--seeds`` (3 for the table),
and FedMerge's d sweep ({1, 5, 10, 15}, ``--sweep-seeds``). Metric: the mean over clients of each client's
accuracy on its own test split at the evaluation with the lowest mean validation loss (the paper's model
selection; ``personal-selected-accuracy``). For FedMerge on the cluster split the table also says whether
the learned weights found the ground-truth clusters: the adjusted Rand index of the rows' argmax against
each client's class set, and the mean L1 distance of weight rows within and between true clusters.

``--tune`` runs the tuning grids on the validation split (seed 100, cluster setting): the clients' lr with FedAvg,
then Ditto's λ (at the tuned lr).

Runs are resumable and parallel (benchmarks/runs.py); results in ``<results>/runs.jsonl``, the tables in
``table.md``, the curves in ``personal.png``, seed 0's FedMerge heatmaps (d > 1) copied to
``merge-weights-<setting>-d<d>.png``.

    python -m benchmarks.reproduce_fedmerge --tune --jobs 2
    python -m benchmarks.reproduce_fedmerge --jobs 2
    python -m benchmarks.reproduce_fedmerge --report
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.runs import config_digest, finished_run, mean_std, pyplot, run_all

FAMILY = "fedmerge-fmnist"
SETTINGS = ("cluster", "personal")
# (preset method, label) in the table's and the runs' order: the goal's comparisons first, FedEM (d x the
# client work) last
METHODS: list[tuple[str, str]] = [("fedmerge", "FedMerge"), ("fedavg", "FedAvg"), ("ifca", "IFCA"),
                                  ("fedmerge-fixed", "Fixed (5/15)"), ("fedavg-plus", "FedAvg+"), ("local", "Local"),
                                  ("fedem", "FedEM"), ("ditto", "Ditto")]
SWEEP = (1, 5, 10, 15)
TUNE_SEED = 100
TUNE_GRIDS: dict[str, list[dict[str, Any]]] = {"fedavg": [{"lr": lr} for lr in (0.1, 0.3, 0.03)],
                                               "ditto": [{"ditto-lambda": lam} for lam in (0.01, 0.1, 1.0)]}
# The paper's Table 2 (CIFAR-100, d = 15): the only numbers it prints for this experiment
PAPER_TABLE_2 = {"cluster": {"fedavg": "30.29", "fedmerge-fixed": "32.52 (5/15)", "fedmerge": "53.27"},
                 "personal": {"fedavg": "29.20", "fedmerge-fixed": "44.70 (5/15)", "fedmerge": "51.18"}}


def job(method: str, setting: str, seed: int, extra: dict[str, Any] | None = None,
        rounds: int | None = None) -> tuple[str, dict[str, Any]]:
    extra = {**(extra or {}), **({"num-rounds": rounds} if rounds else {})}
    tail = ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
    key = f"{FAMILY}/{method}-{setting}/s{seed}" + (f"/{tail}" if tail else "")
    root = Path("outputs") / "reproduce-fedmerge"
    return key, {"preset": f"{FAMILY}/{method}-{setting}", "seed": seed, **extra, "output-dir": str(root.resolve()),
                 "run-name": key.replace("/", "_"), "eval-every": 10, "checkpoint-every": 10}


def cluster_recovery(out: Path) -> dict[str, float]:
    """How far the last evaluation's merging weights found the ground truth: clients holding the same class
    set are one true cluster (the clusters partitioner gives every client of a cluster each of its classes)."""
    import numpy as np
    from sklearn.metrics import adjusted_rand_score

    from common.data import client_partition, data_spec
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


def _one(key: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """One run in this worker (one torch thread): its personalised headline, curve and cost."""
    out, summary, rows = finished_run(overrides)
    selected = next(r for r in rows if r["round"] == summary["personal-selected-round"])
    return {"key": key, "config": config_digest(overrides), "test": summary["personal-selected-accuracy"],
            "val": selected["personal-val-accuracy"], "final": summary["personal-final-accuracy"],
            "worst": selected["personal-accuracy-min"], "seconds": summary["wall-seconds"],
            "bytes-down": summary["bytes-down-per-dispatch"], "bytes-up": summary["bytes-up-per-update"],
            "curve": [[r["round"], r["personal-accuracy"]] for r in rows if "personal-accuracy" in r],
            "folder": str(out), **cluster_recovery(out)}


def _cells(results: dict[str, dict[str, Any]], method: str, setting: str, extra: str = "") -> list[dict[str, Any]]:
    prefix = f"{FAMILY}/{method}-{setting}/s"
    return [r for k, r in sorted(results.items()) if k.startswith(prefix)
            and k[len(prefix):].partition("/")[2] == extra and k[len(prefix):].split("/")[0].isdigit()]


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| Method | Cluster | Personal | worst client (cluster) | MB down / up per client-round | "
             "paper Table 2, CIFAR-100 (cluster; personal) |", "|---|---|---|---|---|---|"]
    for method, label in METHODS:
        got = {s: _cells(results, method, s) for s in SETTINGS}
        cost = next((f"{r['bytes-down'] / 1e6:.2f} / {r['bytes-up'] / 1e6:.2f}" for r in got["cluster"]), "—")
        paper = "; ".join(PAPER_TABLE_2[s].get(method, "—") for s in SETTINGS)
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
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
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


def jobs(seeds: Sequence[int], sweep_seeds: Sequence[int], rounds: int | None) -> list[tuple[str, dict[str, Any]]]:
    """The first seed of every row, the sweep, then the later seeds with FedEM's last: a FedEM run costs ~5×
    another run here (each client trains all d models), so an interrupted table has every cheaper row whole."""
    first = [job(m, s, seeds[0], rounds=rounds) for m, _ in METHODS for s in SETTINGS]
    sweep = [job("fedmerge", s, seed, {"global-models": d}, rounds) for d in SWEEP if d != 5
             for s in SETTINGS for seed in sweep_seeds]
    later = [job(m, s, seed, rounds=rounds) for fedem in (False, True) for seed in seeds[1:]
             for m, _ in METHODS if (m == "fedem") == fedem for s in SETTINGS]
    return first + sweep + later


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes, one torch thread each)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the table's rows")
    ap.add_argument("--sweep-seeds", default="0", help="seeds of FedMerge's d sweep")
    ap.add_argument("--rounds", type=int, default=None, help="override the presets' num-rounds (quick looks)")
    ap.add_argument("--tune", action="store_true", help="the clients' lr grid with FedAvg (validation split)")
    ap.add_argument("--report", action="store_true", help="run nothing: tabulate and plot the results so far")
    ap.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / FAMILY)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    sweep = [int(s) for s in args.sweep_seeds.split(",")]
    args.results.mkdir(parents=True, exist_ok=True)
    if args.tune:
        grid = [job(m, "cluster", TUNE_SEED, extra, args.rounds)
                for m, extras in TUNE_GRIDS.items() for extra in extras]
        done = run_all([] if args.report else grid, args.results / "tuning.jsonl", args.jobs, _one)
        for key, _ in grid:
            r = done.get(key)
            print(f"{key}: " + (f"val {100 * r['val']:.1f}, test {100 * r['test']:.1f}" if r else "not run"))
        return
    results = run_all([] if args.report else jobs(seeds, sweep, args.rounds), args.results / "runs.jsonl",
                      args.jobs, _one)
    (args.results / "table.md").write_text(table(results) + "\n")
    plot(results, args.results / "personal.png")
    for setting in SETTINGS:  # seed 0's heatmaps, while this machine still has the runs' folders
        for d in SWEEP[1:]:
            run = results.get(job("fedmerge", setting, 0, None if d == 5 else {"global-models": d})[0])
            heatmap = Path(run["folder"]) / "merge-weights.png" if run else None
            if heatmap and heatmap.is_file():
                shutil.copy(heatmap, args.results / f"merge-weights-{setting}-d{d}.png")
    print(table(results))


if __name__ == "__main__":
    main()
