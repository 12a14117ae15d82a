"""Scale: peak memory and wall time against the number of clients, in-process and under ``flwr run``.

    python -m benchmarks.scale [--clients 100,1000,5000] [--steps 60] [--methods fedavg,fedasync,feddle]
                               [--engines inprocess,flwr] [--dataset animal-mnist] [--report]

The job is the issue's: Animal-MNIST (or, with ``--dataset fashion-mnist``, Fashion-MNIST: its 60 000
client samples give 50 000 clients one each) split IID over ``--clients`` clients, the 1.67 M-parameter CNN
(``cnn-width`` 32: 6.7 MB per model as float32), 10 clients per step, one local epoch with Adam, one
torch thread; FedAvg synchronous (σ = 0), FedAsync and Feddle-ID with σ = 20 (the feddle-animal
presets' method settings). The test split is evaluated at step 0 and at the end, then every client
evaluates the final model (the end-of-run evaluation).

Each run is a fresh process (``--child``), so its peak is its own:

* ``inprocess``: ``run_inprocess`` (ServerApp, ClientApp and every client's work in one process);
  the peak is that process's ``ru_maxrss``.
* ``flwr``: ``hybridfl.launch.simulate`` (a simulation SuperLink, ``flwr run`` with one simulated SuperNode per
  client on Ray, 1 CPU each); the peak is the largest sum of the PSS of the process tree (SuperLink,
  ServerApp, simulation runtime, Ray), sampled every 0.5 s.

Results are appended per run to ``benchmarks/results/scale/runs.jsonl`` (a run already there is not
run again; one that failed, its reason recorded, is); the table (with the growth per added client, MB,
between consecutive client counts) goes to ``table.md`` and the plot to ``scale.png``. ``--ingest``
instead measures the server's update ingest: see :func:`ingest`.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.runs import median_seconds, pyplot
from hybridfl.sweep import append, config_digest, load_results, pending

RESULTS = Path(__file__).resolve().parent / "results" / "scale"
PRESET = {"fedavg": "fedavg-dir0.1-n20", "fedasync": "fedasync-dir0.1-n20", "feddle": "feddle-id-dir0.1-n20"}
# The preset family of each dataset: Animal-MNIST's 7000 client samples cannot give 50 000 clients one each,
# Fashion-MNIST's 60 000 can
FAMILY = {"animal-mnist": "feddle-animal", "fashion-mnist": "feddle-fmnist"}
SIGMA = {"fedavg": 0.0, "fedasync": 20.0, "feddle": 20.0}
# Flower's simulation asks its SuperNodes which partition they hold in a time that grows with their square (BENCHMARKS
# "Scale"): a run's 120 s for them to answer would end the point, which --timeout bounds instead. Not in the job's
# digest: how long the server waits changes no result.
FLWR_WAIT_NODES_S = 24 * 3600
# The last exception a failed point's output names (the ServerApp's, as `flwr run --stream` prints it)
REASON = re.compile(r"^\s*(?:\w+\.)*(\w*(?:Error|Exception): .*)$", re.MULTILINE)


def overrides(method: str, clients: int, steps: int, dataset: str = "animal-mnist") -> dict[str, Any]:
    """The run configuration of one point of the table."""
    return {"preset": f"{FAMILY[dataset]}/{PRESET[method]}", "partitioner": "iid", "num-clients": clients,
            "num-rounds": steps, "delay-sigma": SIGMA[method], "cnn-width": 32, "local-epochs": 1, "eval-every": steps,
            "checkpoint-every": 0, "seed": 0}


def tree_pss_mb(proc: psutil.Process) -> float:
    """Memory of `proc` and its descendants, MB: the sum of their PSS (shared pages split between the processes
    that map them; a sum of RSS would count the Python and torch libraries once per process)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:  # exited meanwhile
            pass
    return total / 2**20


def child(engine: str, method: str, clients: int, steps: int, dataset: str) -> dict[str, Any]:
    """Run one point in this process; return its measurements."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        ov = {**overrides(method, clients, steps, dataset), "output-dir": tmp}
        t0 = time.perf_counter()
        if engine == "inprocess":
            from hybridfl.engine.inprocess import run_inprocess

            out = run_inprocess(ov)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        else:
            from hybridfl.launch.simulate import simulate

            ov["wait-nodes-s"] = FLWR_WAIT_NODES_S
            samples: list[float] = []
            done = threading.Event()
            me = psutil.Process()

            def sample() -> None:
                while not done.wait(0.5):
                    samples.append(tree_pss_mb(me))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                out = simulate(ov, Path(tmp) / "flwr-home")
            finally:
                done.set()
                sampler.join()
            peak = max(samples, default=0.0)
        seconds = time.perf_counter() - t0
        summary = json.loads((out / "summary.json").read_text())
        accepted = sum(json.loads(line).get("accepted", 0) for line in (out / "metrics.jsonl").read_text().splitlines())
    return {"peak-mb": peak, "seconds": seconds, "accepted": accepted,
            "client-eval-replies": summary["client-eval"].get("replies", 0)}


def point_key(engine: str, method: str, clients: int, steps: int, dataset: str) -> str:
    return f"{engine}/{method}/n{clients}/t{steps}" + ("" if dataset == "animal-mnist" else f"/{dataset}")


def run_point(engine: str, method: str, clients: int, steps: int, dataset: str, timeout: float) -> dict[str, Any]:
    """One point in a fresh process; a failure (a crash, memory, the timeout) is recorded with its reason."""
    cmd = [sys.executable, "-m", "benchmarks.scale", "--child", json.dumps([engine, method, clients, steps, dataset])]
    result: dict[str, Any] = {"key": point_key(engine, method, clients, steps, dataset), "engine": engine,
                              "method": method, "clients": clients, "steps": steps, "dataset": dataset,
                              "config": config_digest(overrides(method, clients, steps, dataset))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[1])
    except subprocess.TimeoutExpired:
        return {**result, "error": f"did not finish within {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        reasons = REASON.findall(proc.stdout + proc.stderr) or proc.stderr.strip().splitlines()[-1:]
        return {**result, "error": f"exit {proc.returncode}: {reasons[-1] if reasons else 'no output'}"}
    return {**result, **json.loads(lines[-1])}


def dataset_of(r: dict[str, Any]) -> str:
    return r.get("dataset", "animal-mnist")  # the first records predate the dataset flag


def series_of(r: dict[str, Any]) -> tuple[str, str, str, int]:
    """The points one line of the table's growth and of the plot join."""
    return r["engine"], dataset_of(r), r["method"], r["steps"]


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| engine | dataset | method | clients | steps | peak RSS MB | growth MB per added client | wall s | "
            "accepted updates | clients evaluated |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = sorted(results, key=lambda r: (*series_of(r), r["clients"]))
    for i, r in enumerate(order):
        head = f"| {r['engine']} | {dataset_of(r)} | {r['method']} | {r['clients']} | {r['steps']} |"
        if "error" in r:
            rows.append(f"{head} failed: {r['error']} | | | | |")
            continue
        prev = order[i - 1] if i else None
        growth = ""
        if prev and "error" not in prev and series_of(prev) == series_of(r):
            growth = f"{(r['peak-mb'] - prev['peak-mb']) / (r['clients'] - prev['clients']):+.3f}"
        rows.append(f"{head} {r['peak-mb']:.0f} | "
                    f"{growth} | {r['seconds']:.0f} | {r['accepted']:.0f} | {r['client-eval-replies']:.0f} |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple[str, str, str, int], list[tuple[int, float]]] = {}
    for r in results:
        if "error" not in r:
            series.setdefault(series_of(r), []).append((r["clients"], r["peak-mb"]))
    for (engine, dataset, method, steps), pts in sorted(series.items()):
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", label=f"{method}, {engine}, {dataset}, {steps} steps")
    ax.set(xscale="log", xlabel="clients", ylabel="peak MB (in-process: RSS; flwr run: PSS of its processes)",
           title="Memory against clients (1.67 M CNN)")
    ax.axhline(4096, color="grey", lw=0.8, ls="--")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ingest(replies: int = 100, repeats: int = 5) -> str:
    """The server's update ingest beside Flower's own packing, in MB of float32 model per second (median of
    `repeats`), measured here side by side with the 1.67 M CNN:

    * Flower pack / unpack: ``ArrayRecord(state_dict)`` and ``ArrayRecord.to_torch_state_dict()``, `replies` times
      each (the same bytes as the ingest's, so every timing spans a similar stretch of a shared machine).
    * hybridfl ingest, per method: `replies` train replies, built as the ClientApp builds them, each decoded and
      validated (``parse_reply``: shape, finite floats), checked and received by the strategy, which steps when
      ready (FedAvg: once, over all; FedBuff: every 10; FedAsync: every reply).
    """

    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    from common.models import build_model
    from common.params import ParamSpec
    from common.protocol import ARRAYS, BASE_VERSION, METRICS, NUM_EXAMPLES, PARTITION_ID
    from flower_internals.engine import act_as_serverapp
    from server_app.wire import Dispatcher, parse_reply
    from strategies import build_strategy
    from strategies.base import Update, deliver

    torch.set_num_threads(1)
    # Messages take their sender from the process's task identity, as in a ServerApp process.
    act_as_serverapp(1)
    model = build_model("cnn", 1, 28, 10, seed=0, cnn_width=32)
    spec = ParamSpec.of(model)
    mb = 4 * spec.numel / 2**20
    gen = torch.Generator().manual_seed(0)

    def timed(fn: Any) -> float:
        return median_seconds(fn, repeats)

    state = model.state_dict()
    packed = ArrayRecord(state)
    rows = [("Flower: ArrayRecord(state_dict) (pack)", replies * mb / timed(lambda: [ArrayRecord(state)
                                                                                  for _ in range(replies)])),
            ("Flower: to_torch_state_dict() (unpack)", replies * mb / timed(lambda: [packed.to_torch_state_dict()
                                                                                  for _ in range(replies)]))]
    for method, options in (("fedavg", {}), ("fedbuff", {"buffer-size": 10}), ("fedasync", {})):
        strategy = build_strategy(method, options, num_clients=replies)
        strategy.initialize(spec.flatten(model), spec, model)
        sent = strategy.model_for(0)
        train = Dispatcher(spec, {}, 0).message(1, sent, 0)
        msgs = [Message(RecordDict({ARRAYS: spec.to_record(0.01 * torch.randn(spec.numel, generator=gen)),
                                    METRICS: MetricRecord({NUM_EXAMPLES: 50, PARTITION_ID: c, BASE_VERSION: 0})}),
                        reply_to=train) for c in range(replies)]

        def checked(m: Message) -> Update:
            update = parse_reply(m, spec)
            update.sent = sent
            strategy.check(update)
            return update

        def take_all() -> None:
            deliver(strategy, map(checked, msgs))

        rows.append((f"hybridfl ingest: {method} (decode, validate, aggregate)", replies * mb / timed(take_all)))
    lines = [f"Update ingest, {spec.numel / 1e6:.2f} M parameters ({mb:.1f} MB float32), {replies} replies, "
             f"one torch thread, median of {repeats}:", "", "| what | MB/s | × Flower's pack |", "|---|---:|---:|"]
    lines += [f"| {name} | {rate:.0f} | {rate / rows[0][1]:.2f} |" for name, rate in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="100,1000,5000")
    ap.add_argument("--steps", default="60", help="comma-separated")
    ap.add_argument("--methods", default="fedavg,fedasync,feddle")
    ap.add_argument("--engines", default="inprocess")
    ap.add_argument("--dataset", default="animal-mnist", choices=sorted(FAMILY))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument("--report", action="store_true", help="run nothing: tabulate the results so far")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--ingest", action="store_true", help="measure the server's update ingest instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ingest:
        text = ingest()
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "ingest.md").write_text(text + "\n")
        print(text)
        return 0
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "runs.jsonl"
    points = [(e, m, int(n), int(t), args.dataset) for e in args.engines.split(",") for m in args.methods.split(",")
              for t in args.steps.split(",") for n in args.clients.split(",")]
    jobs = [(point_key(*p), overrides(*p[1:])) for p in points]
    done = {k: r for k, r in load_results(path).items() if "error" not in r}
    todo = [] if args.report else {k for k, _ in pending(jobs, done)}
    for (key, _), point in zip(jobs, points):
        if key in todo:
            result = run_point(*point, args.timeout)
            append(path, result)
            print(key, {k: v for k, v in result.items() if k not in ("key", "config")}, flush=True)
    results = list(load_results(path).values())
    text = table(results)
    (args.results / "table.md").write_text(text + "\n")
    plot(results, args.results / "scale.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
