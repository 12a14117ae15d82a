"""The Feddle papers' CNN table (004 Table 5 = 000 Table 7), reproduced on data that ships offline: what a run
records and how the tables read. The runs are sweeps (``benchmarks/sweeps/``), one preset family each:

* ``feddle-fmnist`` — the papers' own data and protocol: Fashion-MNIST (``make data``) on 500 clients,
  10 per server step, 200 steps; ID server data 1000 held-out samples, OOD server data Animal-MNIST.
* ``feddle-animal`` — the first offline stand-in: Animal-MNIST on 100 clients, 100 steps; OOD server data
  scikit-learn's digits.

Both: Dirichlet α ∈ {0.1, 0.3} label skew, half-normal delays σ ∈ {5, 20} steps, the papers' CNN from
scratch, a protocol file with one preset per method × setting (``configs/<family>/<method>-dir<α>-n<σ>.yaml``).
Metric: the papers' "max of the last five evaluations" (every 10 steps) of test accuracy, mean ± std over seeds.
Dir(0.1)/σ=20 runs seeds 0–2, the other settings seed 0. Center does not depend on the clients' split or delays:
its runs fill every column. The table also gives the accepted client updates per server step of each setting, and
the papers' Fashion-MNIST numbers beside ours (``benchmarks/sweeps/feddle.paper.yaml``).

The sweeps: ``<family>.yaml`` (the table, :func:`table`, with ``accuracy.png``), ``<family>-tune.yaml`` (the
grids on Dir(0.1)/σ=20 at seed 100, ranked by the VALIDATION split; Fashion-MNIST in two stages as App. D:
FedAvg's client lr and epochs first, then each method's grid), ``feddle-animal-ablation.yaml`` (004 Table 3's
cumulative components, :func:`ablation`), ``feddle-fmnist-analysis.yaml`` (Feddle-ID's gap to Fed+FT taken
apart, :func:`analysis`) and ``feddle-fmnist-select.yaml`` (issue 36: Feddle's candidates chosen on validation by
the one-standard-error rule); ``feddle-fmnist-async-corrected.yaml`` runs the headline's rows on one recipe
(:data:`HEADLINE`, :func:`headline`, with ``headline.png``).

    hybridfl sweep benchmarks/sweeps/feddle-fmnist-tune.yaml --jobs 2
    hybridfl sweep benchmarks/sweeps/feddle-fmnist.yaml --jobs 2          # the table
    hybridfl sweep benchmarks/sweeps/feddle-fmnist-analysis.yaml --jobs 2 # Feddle-ID vs Fed+FT
    hybridfl sweep benchmarks/sweeps/feddle-fmnist-select.yaml --jobs 2   # issue 36, stage 1
    hybridfl sweep benchmarks/sweeps/feddle-animal.yaml --jobs 2          # the Animal-MNIST table
    hybridfl sweep benchmarks/sweeps/feddle-animal-ablation.yaml --jobs 2 # Feddle's components
    hybridfl report benchmarks/sweeps/feddle-fmnist.yaml
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from benchmarks.runs import pyplot
from hybridfl.sweep import Results, Sweep, candidates, load_results, mean_std
from hybridfl.sweep import table as sweep_table

SETTINGS: list[tuple[float, int]] = [(0.1, 20), (0.1, 5), (0.3, 20), (0.3, 5)]
MAIN = (0.1, 20)
# (preset name, label, uses ID data), in the papers' row order
METHODS: list[tuple[str, str, bool]] = [
    ("center", "Center", True), ("fedft", "Fed+FT", True), ("hfcl", "HFCL", True), ("feddf-id", "FedDF-ID", True),
    ("feddle-id", "Feddle-ID", True), ("fedavg", "FedAvg", False), ("fedasync", "FedAsync", False),
    ("fedbuff", "FedBuff", False), ("ca2fl", "CA2FL", False), ("feddf-ood", "FedDF-OOD", False),
    ("feddle-ood", "Feddle-OOD", False)]
# Configurations chosen on validation that the papers do not have (issue 36; ‡ in the table): rows of the families
# with presets for them
VALIDATED: list[tuple[str, str, bool]] = [
    ("feddle-ft-id", "Feddle-ID + Fed+FT's pass ‡", True),
    ("feddle-pull-ood", "Feddle-OOD, pull λ 100 ‡", False),
    ("feddle-step-ood", "Feddle-OOD at FedBuff's step length ‡", False)]
# what a ‡ row's papers' column says where it is not "not in the papers"
NOT_IN_PAPERS = {"feddle-pull-ood": "the papers' method at λ 0.01: the Feddle-OOD row"}
# The headline (issue 61): each row's candidate in benchmarks/sweeps/feddle-fmnist-async-corrected.yaml, every
# method's clients on one recipe (FedAvg's best on validation), the server pass re-tuned on it where a method has one
ONE_RECIPE: dict[str, Any] = {"lr": 0.003, "local-epochs": 5}
RETUNED = {**ONE_RECIPE, "server-train-lr": 0.001}  # benchmarks/sweeps/feddle-fmnist-retune-corrected.yaml
STEP = {"buffer-size": 1, "staleness-weight": "polynomial", "server-lr": 0.8, "staleness-exponent": 0.5}  # FedAsync
HEADLINE: dict[str, tuple[str, dict[str, Any]]] = {  # label: (preset method, point)
    "Fed+FT": ("fedft", RETUNED), "HFCL": ("hfcl", ONE_RECIPE), "FedDF-ID": ("feddf-id", RETUNED),
    "Feddle-ID": ("feddle-id", ONE_RECIPE), "FedAvg": ("fedavg", ONE_RECIPE),
    "FedAsync": ("fedbuff", {**STEP, **ONE_RECIPE}), "FedBuff": ("fedbuff", ONE_RECIPE), "CA2FL": ("ca2fl", ONE_RECIPE),
    "FedDF-OOD": ("feddf-ood", RETUNED), "Feddle-OOD": ("feddle-ood", ONE_RECIPE)}
SETTING_FREE = {"center"}  # no clients: the same number in every column, and no client updates
PAPER = Path(__file__).resolve().parent / "sweeps" / "feddle.paper.yaml"
CHECKPOINTS = (10, 20, 50, 100, 150, 200)  # steps at which the analysis tabulates the accuracy curves
# Per-step metrics kept in a result's "series" (mean over the steps between two evaluations): what the
# analysis compares (the search's server-data loss and its coefficients, Fed+FT's server training)
SERIES_KEYS = ("loss-before", "loss-after", "c-negative", "c-mean", "server-train-loss", "accepted",
               "staleness-mean")


def preset(family: str, method: str, setting: tuple[float, int]) -> str:
    alpha, sigma = setting
    return f"{family}/{method}-dir{alpha:g}-n{sigma:g}"


def methods(family: str) -> list[tuple[str, str, bool]]:
    """The family's rows: the papers' :data:`METHODS`, then those of :data:`VALIDATED` it has presets for."""
    from server_app.presets import preset_names

    names = set(preset_names())
    return METHODS + [m for m in VALIDATED if preset(family, m[0], MAIN) in names]


def series(rows: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """One entry per evaluation: its step, the splits' metrics, and the mean of each of SERIES_KEYS over the
    steps since the previous evaluation (those the run logged)."""
    out, window = [], []
    for row in rows:
        window.append(row)
        if "test-accuracy" not in row:
            continue
        entry = {k: row[k] for k in ("round", "test-accuracy", "test-loss", "val-accuracy", "val-loss") if k in row}
        for k in SERIES_KEYS:
            values = [r[k] for r in window if k in r]
            if values:
                entry[k] = statistics.fmean(values)
        out.append(entry)
        window = []
    return out


def record(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's per-evaluation :func:`series` (the sweep records the rest)."""
    return {"series": series(rows)}


def cell(results: Results, family: str, method: str, setting: tuple[float, int], field: str = "test") -> list[Any]:
    """`field` of the reported runs (seeds, no extra overrides) of one method × setting."""
    setting = MAIN if method in SETTING_FREE else setting
    prefix = preset(family, method, setting) + "/s"
    return [r[field] for k, r in sorted(results.items()) if k.startswith(prefix) and k[len(prefix):].isdigit()]


def table(results: Results, sweep: Sweep) -> str:
    """The family's table (the sweep's name) over the four settings, and ``accuracy.png`` beside its report."""
    from server_app.config import load_config

    family = sweep.name
    paper = yaml.safe_load(PAPER.read_text())["Fashion-MNIST"]
    head = " | ".join(f"Dir({a:g}),N({s})" for a, s in SETTINGS)
    lines = [f"| Method | ID | {head} | papers' FMNIST CNN ({', '.join(f'D({a:g}),N({s})' for a, s in SETTINGS)}) |",
             "|---|---|" + "---|" * len(SETTINGS) + "---|"]
    rows = methods(family)
    for method, label, in_domain in rows:
        ours = [cell(results, family, method, st) for st in SETTINGS]
        theirs = "; ".join(paper[method]) if method in paper else NOT_IN_PAPERS.get(method, "not in the papers")
        lines.append(f"| {label} | {'✓' if in_domain else '✗'} | "
                     + " | ".join(mean_std(v) if v else "—" for v in ours) + f" | {theirs} |")
    # How many client updates the protocol delivered: accepted updates per server step, over every run with
    # clients; the clients' schedule depends on the setting and seed, not on the method.
    delivered = []
    for st in SETTINGS:
        steps = load_config({"preset": preset(family, "fedbuff", st)}).num_rounds
        per_step = [a / steps for method, _, _ in rows if method not in SETTING_FREE
                    for a in cell(results, family, method, st, "accepted")]
        delivered.append(f"{statistics.mean(per_step):.2f}" if per_step else "—")
    lines.append(f"| accepted updates per step (runs with clients) | | {' | '.join(delivered)} | papers: ~10 |")
    if set(rows) & set(VALIDATED):
        lines += ["", "‡ a configuration chosen on validation (the family's `-select` sweep, issue 36); the rows above "
                  "are the papers' methods at the family's tuned values, kept as measured."]
    plot(results, family, sweep.report.parent / "accuracy.png")
    return "\n".join(lines)


def headline(results: Results, sweep: Sweep) -> str:
    """The corrected sweep's report (:func:`hybridfl.sweep.table`), and ``headline.png`` beside it: the headline's
    rows (:data:`HEADLINE`) per step, with and without in-domain data, and Center from the table's runs beside."""
    family = sweep.blocks[0].presets[0].split("/")[0]
    table_runs = sweep.results.parent / "runs.jsonl"  # the table's, beside: Center trains no client
    curves = {"Center": cell(load_results(table_runs), family, "center", MAIN, "curve") if table_runs.exists() else []}
    found = candidates(sweep, results)
    for label, (method, point) in HEADLINE.items():
        candidate = next(c for c in found if c.preset == preset(family, method, MAIN) and c.point == point)
        curves[label] = [r["curve"] for r in candidate.runs]
    plot_groups({label: c for label, c in curves.items() if c}, {label: flag for _, label, flag in METHODS}, family,
                sweep.report.parent / "headline.png",
                "every method's clients at lr {lr:g} x {local-epochs} local epochs".format_map(ONE_RECIPE))
    return sweep_table(results, sweep)


def draw_curves(ax: Any, curves: dict[str, list[list[list[float]]]], title: str, bold: str = "Feddle") -> None:
    """Test accuracy per step on `ax`, the mean over a label's runs (seeds); labels starting with `bold` thick."""
    import numpy as np

    for label, runs in curves.items():
        steps = [s for s, _ in runs[0]]
        acc = np.mean([[a for _, a in c] for c in runs], axis=0)
        ax.plot(steps, 100 * acc, marker="o", ms=3, label=label, lw=2.5 if label.startswith(bold) else 1.2)
    ax.set(title=title, xlabel="server step", ylabel="test accuracy (%)")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=7)


def plot(results: Results, family: str, path: Path) -> None:
    """The table's Dir(0.1)/N(20) curves of every row, with and without in-domain data."""
    rows = methods(family)
    curves = {label: cell(results, family, method, MAIN, "curve") for method, label, _ in rows}
    plot_groups({k: v for k, v in curves.items() if v}, {label: flag for _, label, flag in rows}, family, path)


def plot_groups(curves: dict[str, list[list[list[float]]]], in_domain: dict[str, bool], family: str, path: Path,
                note: str = "") -> None:
    """Two panels of test accuracy per step: the labels with in-domain server data, and those without; FedAvg, the
    reference without server data, in both."""
    from server_app.config import load_config

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    ood = load_config({"preset": preset(family, "feddle-ood", MAIN)}).server_dataset
    for ax, group in zip(axes, (True, False)):
        draw_curves(ax, {k: v for k, v in curves.items() if in_domain[k] == group or k == "FedAvg"},
                    ("with ID server data" if group else f"without ID data (OOD: {ood})") + ", Dir(0.1), N(20)"
                    + (f"\n{note}" if note else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ablation(results: Results, sweep: Sweep) -> str:
    """The component ablation: one row per block label (cumulative switches), Feddle-ID and Feddle-OOD beside."""
    cells: dict[str, dict[bool, list[float]]] = {}
    for c in candidates(sweep, results):
        cells.setdefault(c.block, {})[c.preset.rsplit("/", 1)[1].startswith("feddle-ood")] = c.values("test")
    lines = ["| Configuration | In-domain (Feddle-ID) | Out-of-domain (Feddle-OOD) |", "|---|---|---|"]
    for label, got in cells.items():
        lines.append(f"| {label} | " + " | ".join(mean_std(got[ood]) if got.get(ood) else "—" for ood in (False, True))
                     + " |")
    return "\n".join(lines)


def _at(curve: Sequence[Sequence[float]], step: int) -> float | None:
    return next((a for s, a in curve if s == step), None)


def step_size(result: dict[str, Any], atlas_size: int) -> float | None:
    """Σ_m ĉ_m of the searches in the run's second half (mean over its evaluation windows; c-mean × the atlas
    size, which is full by then): the found step's length in units of one median-norm update. FedBuff's step
    c′ sums to η_g there (uniform weights), so a value under η_g means the search shortened its fallback's
    step; None for a run without searches."""
    end = max((e["round"] for e in result.get("series", [])), default=0)
    late = [e["c-mean"] * atlas_size for e in result.get("series", []) if "c-mean" in e and e["round"] > end / 2]
    return statistics.fmean(late) if late else None


def analysis(results: Results, sweep: Sweep) -> str:
    """One row per block (its label): the papers' metric, the accuracy at :data:`CHECKPOINTS`, the loss on the
    server's data beside the validation loss (the search's and the fine-tuning's fit to the 1000 samples against
    what generalises) and Feddle's :func:`step_size` beside its fallback's η_g; ``analysis.png`` beside the report."""
    from server_app.config import load_config

    lines = ["| Configuration | test % | val % | " + " | ".join(f"step {s}" for s in CHECKPOINTS)
             + " | server-data loss | val loss | Σĉ, 2nd half (η_g) |",
             "|---|---|---|" + "---|" * len(CHECKPOINTS) + "---|---|---|"]
    curves: dict[str, list[list[list[float]]]] = {}
    for c in candidates(sweep, results):
        got = c.runs
        if not got:
            lines.append(f"| {c.block} | not run | | " + "| " * len(CHECKPOINTS) + "| | |")
            continue
        options = load_config(c.overrides).to_dict()
        sizes = [v for v in (step_size(r, options.get("atlas-size", 0)) for r in got) if v is not None]
        curves[c.block] = [r["curve"] for r in got]
        at = [[_at(r["curve"], s) for r in got] for s in CHECKPOINTS]
        last = [e for r in got for e in r.get("series", [])[-5:]]
        server_loss = [v for e in last if (v := e.get("loss-after", e.get("server-train-loss"))) is not None]
        val_loss = [e["val-loss"] for e in last if "val-loss" in e]
        fmt = lambda v: f"{statistics.fmean(v):.3f}" if v else "—"
        lines.append(f"| {c.block} | {mean_std(c.values('test'))} | {mean_std(c.values('val'))} | "
                     + " | ".join(f"{100 * statistics.fmean(v):.1f}" if None not in v else "—" for v in at)
                     + f" | {fmt(server_loss)} | {fmt(val_loss)} | "
                     + (f"{fmt(sizes)} ({options['server-lr']:g})" if sizes else "—") + " |")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    draw_curves(ax, curves, "Feddle (ID, OOD) and Fed+FT taken apart, Dir(0.1), N(20)")
    fig.tight_layout()
    fig.savefig(sweep.report.parent / "analysis.png", dpi=120)
    plt.close(fig)
    return "\n".join(lines)
