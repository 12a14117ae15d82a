"""FedDUAL's FMNIST results (paper Tables 1 and 2), on the paper's own data and protocol (``configs/feddual-fmnist/``):
what a run records and how the table reads. The runs are the sweep ``benchmarks/sweeps/feddual-fmnist.yaml``.

100 clients, 10 per round, 180 rounds, the code's LeNet, Adam, 3 local epochs, batch 32, label skew Dir(0.01).
Rows: FedAvg, FedProx (μ tuned on the paper's grid), FedDUAL as the paper reads (``feddual``) and as its code
runs (``feddual-reference``), and the ablation {cross-entropy, adaptive loss} × {unweighted mean, barycenter}
(``mean``, ``feddual-loss``, ``feddual-aggregation``, ``feddual``); columns: the code's partition (min one sample
per class and client, overlapping; 3 seeds) and the standard Dirichlet (seed 0). The asynchronous rows (σ = 5
rounds: ``feddual-async``, ``fedbuff-async``) run on the code's partition. Metric: test accuracy, the max of the
last five evaluations (every 5 rounds: rounds 160–180) as the Feddle tables here, with the final round's beside
it; the FedDUAL rows also report the mean client β and how often the barycenter underflowed. The tuning sweep
(``feddual-fmnist-tune.yaml``) takes the clients' Adam lr with FedAvg, then FedProx's μ. The paper's numbers:
``benchmarks/sweeps/feddual-fmnist.paper.yaml``.

    hybridfl sweep benchmarks/sweeps/feddual-fmnist-tune.yaml --jobs 2
    hybridfl sweep benchmarks/sweeps/feddual-fmnist.yaml --jobs 2
    hybridfl report benchmarks/sweeps/feddual-fmnist.yaml
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import yaml

from benchmarks.runs import mean_curves, pyplot, seeded
from hybridfl.sweep import Results, Sweep, mean_std

FAMILY = "feddual-fmnist"
# (preset method, label) in the table's order
METHODS: list[tuple[str, str]] = [
    ("fedavg", "FedAvg"), ("fedprox", "FedProx"), ("feddual", "FedDUAL (paper's reading)"),
    ("feddual-reference", "FedDUAL (released code)"), ("mean", "ablation: neither (unweighted mean, CE)"),
    ("feddual-loss", "ablation: adaptive loss only"), ("feddual-aggregation", "ablation: dynamic aggregation only"),
    ("feddual-async", "FedDUAL, σ = 5 rounds"), ("fedbuff-async", "FedBuff (K 10, η 1), σ = 5 rounds")]
ASYNC = {"feddual-async", "fedbuff-async"}
PAPER = Path(__file__).resolve().parent / "sweeps" / f"{FAMILY}.paper.yaml"


def record(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The clients' β and the barycenter's underflows, each a mean over the run's rounds."""
    steps = [r for r in rows if r["round"] > 0]
    mean = lambda k: statistics.fmean([r[k] for r in steps if k in r]) if any(k in r for r in steps) else None
    return {"beta": mean("client-beta"), "underflow": mean("wb-underflow"), "max-weight": mean("wb-max-weight")}


def cells(results: Results, method: str, partition: str) -> list[dict[str, Any]]:
    return seeded(results, f"{FAMILY}/{method}-{partition}")


def table(results: Results, sweep: Sweep | None = None) -> str:
    """The table (and, given the `sweep`, ``accuracy.png`` beside its report)."""
    paper = yaml.safe_load(PAPER.read_text())
    lines = ["| Method | code's partition | final round | standard Dirichlet | mean β | underflowed arrays per "
             "round | largest barycenter weight | paper (FMNIST) |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda rs, k: f"{statistics.fmean([r[k] for r in rs]):.3f}" if rs and rs[0].get(k) is not None else "—"
    for method, label in METHODS:
        code, other = cells(results, method, "code"), cells(results, method, "dirichlet")
        lines.append(f"| {label} | {mean_std([r['test'] for r in code]) if code else '—'} | "
                     f"{mean_std([r['final'] for r in code]) if code else '—'} | "
                     f"{mean_std([r['test'] for r in other]) if other else '—'} | {fmt(code, 'beta')} | "
                     f"{fmt(code, 'underflow')} | {fmt(code, 'max-weight')} | {paper.get(method, '—')} |")
    if sweep is not None:
        plot(results, sweep.report.parent / "accuracy.png")
    return "\n".join(lines)


def plot(results: Results, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    mean_curves(ax, {label: [r["curve"] for r in cells(results, m, "code")] for m, label in METHODS},
                "Fashion-MNIST, Dir(0.01), the code's partition (mean over seeds)", "round", bold="FedDUAL (paper",
                dashed=[label for m, label in METHODS if m in ASYNC])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
