"""The ServerApp: builds the run from its configuration, drives the runner, writes the outputs.

The configuration is ``configs/<preset>.yaml`` overlaid with exactly the keys the user passed
(``flwr run -c``), which Flower hands over as ``grid.run.override_config``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
import time
from logging import INFO
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from common.config import RunConfig, load_config
from common.data import data_spec, load_dataset, make_splits
from common.server_data import ServerData, build_server_data
from common.models import build_from_config, model_config
from common.params import ParamSpec
from common.protocol import TRAIN_SEED
from common.training import evaluate
from server_app.messaging import Dispatcher, NodeDirectory, federated_evaluate
from server_app.outputs import Recorder, run_dir
from server_app.runtime import Runner, StepLog
from strategies import build_strategy

app = ServerApp()
RUN_STATE = "hybridfl-run"  # ConfigRecord left in the ServerApp's context.state: {"output-dir": ...}


@app.main()
def main(grid: Grid, context: Context) -> None:
    out = run_server(grid, load_config(grid.run.override_config))
    context.state[RUN_STATE] = ConfigRecord({"output-dir": str(out)})


def run_server(grid: Grid, cfg: RunConfig) -> Path:
    """Run `cfg` over `grid` and return the run's output folder."""
    t_start = time.perf_counter()
    out = run_dir(cfg)
    spec = data_spec(cfg)
    splits, full = make_splits(spec), load_dataset(cfg.dataset, cfg.data_root)
    server_data = build_server_data(cfg, splits)
    model = build_from_config(cfg.to_dict(), full.x.shape[1], full.x.shape[2], full.num_classes, seed=cfg.seed)
    pspec = ParamSpec.of(model)
    strategy = build_strategy(cfg)
    strategy.initialize(pspec.flatten(model), pspec)
    strategy.attach(copy.deepcopy(model))
    log(INFO, "run %s: %s on %s (%d train / %d test), server data: %s, %d clients, %d rounds, %s clock (σ=%g) -> %s",
        out.name, cfg.strategy, cfg.dataset, len(splits.train), len(splits.test), describe(server_data),
        cfg.num_clients, cfg.num_rounds, cfg.clock, cfg.delay_sigma, out)

    directory = NodeDirectory(grid)
    directory.wait_for(cfg.num_clients, cfg.wait_nodes_s)
    dispatcher = Dispatcher(pspec, {**spec.to_config(), **model_config(cfg.to_dict())}, cfg.seed)
    recorder = Recorder(out)
    runner = Runner(grid, strategy, directory, dispatcher, clients_per_round=cfg.clients_per_round, clock=cfg.clock,
                    delay_sigma=cfg.delay_sigma, concurrency=cfg.concurrency, reply_timeout=cfg.reply_timeout_s,
                    poll_interval=cfg.poll_interval_s, wait_nodes=cfg.wait_nodes_s, seed=cfg.seed,
                    server_data=server_data, on_event=recorder.event)

    def evaluate_into(entry: StepLog) -> StepLog:
        """The global model on the test split (and the validation split, when there is one)."""
        pspec.load_into(model, strategy.params)
        entry.test = evaluate(model, splits.test)
        if len(splits.validation):
            entry.validation = evaluate(model, splits.validation)
        return entry

    recorder.round(evaluate_into(StepLog(0, 0)).to_dict())

    def on_round(entry: StepLog) -> None:
        if entry.round % cfg.eval_every == 0 or entry.round == cfg.num_rounds:
            evaluate_into(entry)
        recorder.round(entry.to_dict())
        acc = f"test-accuracy {entry.test['accuracy']:.4f}" if entry.test else ""
        log(INFO, "round %d/%d v%d: %d/%d updates, %d failed, %d rejected, %d timed out, %.2fs %s", entry.round,
            cfg.num_rounds, entry.version, entry.accepted, entry.sampled, entry.failures, entry.rejected,
            entry.timeouts, entry.seconds, acc)

    t_train = time.perf_counter()
    if cfg.loop == "flower":
        flower_loop(grid, strategy, cfg, dispatcher, recorder, evaluate_into)
    else:
        runner.run(cfg.num_rounds, on_round)
    train_seconds = time.perf_counter() - t_train
    client_eval = federated_evaluate(grid, directory, dispatcher, strategy.params, strategy.version,
                                     cfg.reply_timeout_s)
    pspec.load_into(model, strategy.params)
    summary = recorder.finish({"run": out.name, "config": cfg.to_dict(), "strategy": strategy.describe(),
                               "final-version": strategy.version, "client-eval": client_eval,
                               "server-data": describe(server_data),
                               "reply-to-dispatch-s": runner.latency_summary(),
                               "wall-seconds": time.perf_counter() - t_start, "train-seconds": train_seconds}, model)
    log(INFO, "run %s finished: final test accuracy %.4f (max of last 5 evals %.4f); outputs in %s", out.name,
        summary["final-test-accuracy"], summary["max-last-5-evals"], out)
    return out


def describe(server_data: ServerData | None) -> str:
    if server_data is None:
        return "none"
    kind = "in-domain" if server_data.in_domain else "out-of-domain"
    return f"{len(server_data)} {kind} samples on {server_data.device}"


def flower_loop(grid: Grid, strategy, cfg: RunConfig, dispatcher: Dispatcher, recorder: Recorder,
                evaluate_into: Callable[[StepLog], StepLog]) -> None:
    """Flower's own ``strategy.start()`` round loop instead of the hybridfl runtime, to compare the two
    (benchmarks/async_latency.py). Federated evaluation is off, as with Flower's ``fraction_evaluate=0``;
    every client gets the same ``train-seed`` (Flower sends one config to all)."""
    strategy.evaluate_clients = 0
    seen = {"accepted": 0, "rejected": 0, "t": time.perf_counter()}

    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        strategy.params = strategy.spec.from_record(arrays)
        entry = evaluate_into(StepLog(rnd, strategy.version, seconds=time.perf_counter() - seen["t"]))
        entry.accepted, entry.rejected = (strategy.accepted_replies - seen["accepted"],
                                          strategy.rejected_replies - seen["rejected"])
        seen.update(accepted=strategy.accepted_replies, rejected=strategy.rejected_replies, t=time.perf_counter())
        if rnd:  # round 0 is already recorded
            recorder.round(entry.to_dict())
        return MetricRecord(entry.test)

    result = strategy.start(grid=grid, initial_arrays=strategy.spec.to_record(strategy.params),
                            num_rounds=cfg.num_rounds, timeout=cfg.reply_timeout_s,
                            train_config=ConfigRecord({**dispatcher.run_config, **strategy.train_config,
                                                       TRAIN_SEED: cfg.seed}),
                            evaluate_fn=evaluate_fn)
    strategy.params = strategy.spec.from_record(result.arrays)
