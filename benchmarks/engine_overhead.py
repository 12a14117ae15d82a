"""Engine overhead: the same federated job through the in-process engine and as a bare PyTorch loop.

    python -m benchmarks.engine_overhead [--rounds 10] [--repeats 3] [--threads 1] [--flwr-run]

The job is a preset (default ``fedavg-digits``: 10 clients, Dirichlet 0.5, 2 local epochs, batch 32,
SGD) for ``--rounds`` rounds. It runs, in this one process:

* engine: ``run_inprocess(overrides)`` end to end: the real ServerApp and ClientApp exchanging
  Flower Messages (ArrayRecord serialisation, config validation, a model built and a partition
  loaded per message, the run's outputs written to a temp folder: metrics, events, summary, model, plots);
* bare: the same work with the project's functions and no Flower, following the runtime's
  synchronous path: per round the runtime's client sampling, per client ``common.training.train``
  from the global model with the dispatcher's seed (``derive_seed(seed, client, dispatch count)``),
  the strategy's aggregation, and the ServerApp's evaluations (test split at round 0, every
  ``eval-every`` rounds and the last; every client's partition at the end). Partitions are loaded
  and the client model built once; nothing is written.

Each path is warmed up once untimed, then timed ``--repeats`` times (wall clock, perf_counter) in
alternating order (engine, bare, bare, engine, ...). It prints the median of each, the ratio
engine/bare (goal: <= 1.10), the median of the paired ratios (repeat i's engine over repeat i's bare,
CPU time: neighbours in time share the machine's state, so drift between invocations cancels), and
checks that both paths end with bitwise the same global model and the same evaluations.
``--flwr-run`` also runs the job through ``flwr run`` on a simulation SuperLink (``hybridfl.launch.simulate``,
temporary FLWR_HOME) and prints its total wall time (SuperLink, Ray, FAB install included) and the
ServerApp's own ``wall-seconds`` from its summary.json.
Exits 1 if the engine and bare runs disagree (the comparison would not be like with like).
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.config import part_of
from common.models import build_model
from common.params import ParamSpec
from common.server_data import build_server_data
from common.splits import client_partition, data_spec, load_dataset, make_splits
from common.training import LocalRecipe, derive_seed, evaluate, train
from hybridfl.engine.inprocess import run_inprocess
from server_app.config import RunConfig, load_config
from server_app.evaluation import weighted_mean
from strategies import build_strategy
from strategies.base import Update, deliver


@dataclass
class Outcome:
    """What a run produced, for the like-with-like check."""

    seconds: float  # wall clock
    cpu: float  # CPU time of this process (all threads): less sensitive to other load on the machine
    params: torch.Tensor  # final global model, flat
    evals: list[tuple[int, float, float]]  # (round, test-loss, test-accuracy) of every server evaluation
    client_eval: dict[str, float]  # example-weighted eval-loss / eval-accuracy over all clients
    round_seconds: list[float] = field(default_factory=list)  # per round, from metrics.jsonl (ServerApp runs)


def _global_model(cfg: RunConfig) -> tuple[torch.nn.Module, ParamSpec]:
    full = load_dataset(cfg.dataset)
    model = build_model(cfg.model, full.x.shape[1], full.x.shape[2], full.num_classes, seed=cfg.seed)
    return model, ParamSpec.of(model)


def read_outcome(out: Path, cfg: RunConfig, seconds: float, cpu: float) -> Outcome:
    """The outcome of a ServerApp run from what it wrote to `out`."""
    model, pspec = _global_model(cfg)
    model.load_state_dict(torch.load(out / "model.pt"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["round"], r["test-loss"], r["test-accuracy"]) for r in rows if "test-accuracy" in r]
    ce = json.loads((out / "summary.json").read_text())["client-eval"]
    return Outcome(seconds, cpu, pspec.flatten(model), evals, {k: ce[k] for k in ("eval-loss", "eval-accuracy")},
                   [r["seconds"] for r in rows if r["round"] > 0])


def run_engine(overrides: dict[str, Any]) -> Outcome:
    """The job through the in-process engine; outputs are read back after the clock stops."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = run_inprocess(overrides)
    return read_outcome(out, load_config(overrides), time.perf_counter() - t0, time.process_time() - c0)


def run_bare(cfg: RunConfig) -> Outcome:
    """The same work as the ServerApp + ClientApps of `cfg`, as a plain loop over the project's functions.

    It follows the runtime's synchronous path (virtual clock, σ = 0): sample, train every sampled
    client from the current global model, hand the updates over in client order, close the round.
    """
    if cfg.loop != "hybridfl" or cfg.clock != "virtual" or cfg.delay_sigma != 0:
        raise ValueError("the bare loop is the synchronous job: loop='hybridfl', clock='virtual', delay-sigma=0")
    t0, c0 = time.perf_counter(), time.process_time()
    spec = data_spec(cfg)
    splits = make_splits(spec)
    test, server = splits.test, build_server_data(cfg, splits)
    model, pspec = _global_model(cfg)  # the server's model: initial weights, test evaluations
    local, _ = _global_model(cfg)  # one client model, reloaded with the model it is sent per update
    recipe = part_of(LocalRecipe, cfg)
    strategy = build_strategy(cfg.strategy, cfg.options, seed=cfg.seed, num_clients=cfg.num_clients, recipe=recipe)
    strategy.initialize(pspec.flatten(model), pspec, copy.deepcopy(model))
    strategy.attach(server)
    clients = list(range(cfg.num_clients))
    parts = {c: client_partition(spec, c) for c in clients}
    rng = random.Random(cfg.seed)  # the runtime's client sampling
    dispatches = dict.fromkeys(clients, 0)

    def test_eval(rnd: int) -> tuple[int, float, float]:
        pspec.load_into(model, strategy.params)
        m = evaluate(model, test, seed=cfg.seed)
        return rnd, m["loss"], m["accuracy"]

    evals = [test_eval(0)]
    for rnd in range(1, cfg.num_rounds + 1):
        sampled = sorted(rng.sample(clients, min(cfg.clients_per_round, len(clients))))
        updates = []
        for c in sampled:
            payload = strategy.model_for(c)
            pspec.load_into(local, payload.params)
            start = pspec.flatten(local)
            metrics = train(local, parts[c], recipe, seed=derive_seed(cfg.seed, c, dispatches[c]))
            dispatches[c] += 1
            updates.append(Update(c, strategy.version, pspec.flatten(local) - start, len(parts[c]), {}, metrics,
                                  sent=payload))
        deliver(strategy, updates)
        weighted_mean((u.num_examples, u.metrics) for u in updates)  # the round's train metrics, as logged
        if rnd % cfg.eval_every == 0 or rnd == cfg.num_rounds:
            evals.append(test_eval(rnd))
    # Federated evaluation of the final model on every client's partition, in client order.
    pspec.load_into(local, strategy.params)
    per_client = []
    for c in clients:
        m = evaluate(local, parts[c], seed=cfg.seed)
        per_client.append((float(len(parts[c])), {"eval-loss": m["loss"], "eval-accuracy": m["accuracy"]}))
    client_eval = weighted_mean(per_client)
    return Outcome(time.perf_counter() - t0, time.process_time() - c0, strategy.params.clone(), evals, client_eval)


def run_flwr(overrides: dict[str, Any]) -> tuple[Outcome, float]:
    """The job through ``flwr run`` (simulation): its outcome (total wall s) and the ServerApp's wall-seconds."""
    from hybridfl.launch.simulate import simulate

    with tempfile.TemporaryDirectory(prefix="flwr-home-") as home:
        t0 = time.perf_counter()
        out = simulate(overrides, Path(home))
        total = time.perf_counter() - t0
    server_wall = float(json.loads((out / "summary.json").read_text())["wall-seconds"])
    return read_outcome(out, load_config(overrides), total, float("nan")), server_wall


def same(a: Outcome, b: Outcome) -> list[str]:
    """What differs between two outcomes (empty: bitwise the same model and evaluations)."""
    diffs = []
    if not torch.equal(a.params, b.params):
        diffs.append(f"final models differ (max |diff| {float((a.params - b.params).abs().max()):.3g})")
    if a.evals != b.evals:
        diffs.append(f"test evaluations differ: {a.evals[-1]} vs {b.evals[-1]} (last)")
    if a.client_eval != b.client_eval:
        diffs.append(f"client evaluations differ: {a.client_eval} vs {b.client_eval}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="fedavg-digits", help="configs/<preset>.yaml (default: fedavg-digits)")
    parser.add_argument("--rounds", type=int, default=10, help="server rounds (default: 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each path (default: 3)")
    parser.add_argument("--flwr-run", action="store_true", help="also time the job through `flwr run` (~30 s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: one core runs the job, the other absorbs the machine's noise)")
    parser.add_argument("--verbose", action="store_true", help="keep Flower's INFO logs of the engine runs")
    args = parser.parse_args(argv)
    if not args.verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="engine-overhead-"))
    base = {"preset": args.preset, "num-rounds": args.rounds, "output-dir": str(tmp)}
    cfg = load_config(base)
    names = itertools.count()
    paths: dict[str, Callable[[], Outcome]] = {
        "engine": lambda: run_engine({**base, "run-name": f"engine-{next(names)}"}),
        "bare": lambda: run_bare(cfg),
    }

    print(f"job: {args.preset}, {cfg.num_clients} clients ({cfg.clients_per_round}/round), {args.rounds} rounds, "
          f"{cfg.local_epochs} local epochs, batch {cfg.batch_size}, {cfg.optimizer}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}", flush=True)
    reference = {k: run() for k, run in paths.items()}  # warm-up (dataset, partitions, imports), untimed
    runs: dict[str, list[Outcome]] = {"engine": [], "bare": []}
    for i in range(args.repeats):
        for name in ("engine", "bare") if i % 2 == 0 else ("bare", "engine"):
            gc.collect()
            result = paths[name]()
            runs[name].append(result)
            if diffs := same(result, reference[name]):
                print(f"warning: {name} run {i} is not reproducible: {'; '.join(diffs)}")
            print(f"  {name:6s} run {i}: {result.seconds:.3f} s wall, {result.cpu:.3f} s CPU", flush=True)

    wall = {k: statistics.median(r.seconds for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r.cpu for r in v) for k, v in runs.items()}
    print(f"\n{'path':8s} {'median wall s':>14s} {'min':>7s} {'max':>7s} {'median CPU s':>13s}")
    for k in ("engine", "bare"):
        secs = [r.seconds for r in runs[k]]
        print(f"{k:8s} {wall[k]:14.3f} {min(secs):7.3f} {max(secs):7.3f} {cpu[k]:13.3f}")
    best = {k: min(r.seconds for r in v) for k, v in runs.items()}
    print(f"ratio engine/bare: {wall['engine'] / wall['bare']:.3f} (medians; goal <= 1.10), "
          f"{best['engine'] / best['bare']:.3f} (minima), {cpu['engine'] / cpu['bare']:.3f} (CPU medians); "
          f"{args.repeats} repeats, load average now {os.getloadavg()[0]:.2f}")
    paired = sorted(e.cpu / b.cpu for e, b in zip(runs["engine"], runs["bare"], strict=True))
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    print(f"paired ratio engine/bare (CPU, repeat by repeat): median {statistics.median(paired):.3f}, "
          f"quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, range {paired[0]:.3f}-{paired[-1]:.3f}")

    diffs = same(reference["engine"], reference["bare"])
    e = reference["engine"]
    print(f"final test accuracy: engine {e.evals[-1][2]:.4f}, bare {reference['bare'].evals[-1][2]:.4f}; "
          f"client eval accuracy {e.client_eval['eval-accuracy']:.4f}")
    print("engine vs bare: " + ("bitwise identical final model and evaluations" if not diffs else "; ".join(diffs)))

    if args.flwr_run:
        flwr, server_wall = run_flwr({**base, "run-name": "flwr-run"})
        later = {"flwr run": flwr.round_seconds[1:], "engine": [t for r in runs["engine"] for t in r.round_seconds[1:]]}
        steady = {k: statistics.median(v) if v else float("nan") for k, v in later.items()}
        print(f"\nflwr run (simulation): {flwr.seconds:.1f} s total (SuperLink, Ray, FAB install included); "
              f"ServerApp wall-seconds {server_wall:.1f} s; round 1 {flwr.round_seconds[0]:.2f} s, later rounds "
              f"{steady['flwr run']:.2f} s (engine {steady['engine']:.2f} s; medians); "
              f"final test accuracy {flwr.evals[-1][2]:.4f}")
        flwr_diffs = same(flwr, reference["bare"])
        print("flwr run vs bare: " + ("bitwise identical final model and evaluations" if not flwr_diffs
                                      else "; ".join(flwr_diffs)))
        if flwr_diffs:
            # Ray's 1-CPU ClientApp actors run torch on one thread; CPU kernels reduce in another order.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                single = same(flwr, run_bare(cfg))
            finally:
                torch.set_num_threads(threads)
            print("flwr run vs bare at 1 torch thread: " + ("bitwise identical final model and evaluations"
                                                            if not single else "; ".join(single)))
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
