"""The ServerApp: builds the run from its configuration, drives the runner, writes the outputs.

The configuration is ``configs/<preset>.yaml`` overlaid with exactly the keys the user passed
(``flwr run -c``), which Flower hands over as ``grid.run.override_config``.
"""

from __future__ import annotations

import time
from logging import INFO
from pathlib import Path

from flwr.app import ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from common.config import RunConfig, load_config
from common.data import data_spec, load_dataset, make_splits
from common.models import build_model
from common.params import ParamSpec
from common.protocol import MODEL
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
    splits, full = make_splits(spec), load_dataset(cfg.dataset)
    model = build_model(cfg.model, full.x.shape[1], full.x.shape[2], full.num_classes, seed=cfg.seed)
    pspec = ParamSpec.of(model)
    strategy = build_strategy(cfg)
    strategy.initialize(pspec.flatten(model), pspec)
    log(INFO, "run %s: %s on %s (%d train / %d test / %d central), %d clients, %d rounds, %s clock (σ=%g) -> %s",
        out.name, cfg.strategy, cfg.dataset, len(splits.train), len(splits.test), len(splits.central),
        cfg.num_clients, cfg.num_rounds, cfg.clock, cfg.delay_sigma, out)

    directory = NodeDirectory(grid)
    directory.wait_for(cfg.num_clients, cfg.wait_nodes_s)
    dispatcher = Dispatcher(pspec, {**spec.to_config(), MODEL: cfg.model}, cfg.seed)
    recorder = Recorder(out)
    runner = Runner(grid, strategy, directory, dispatcher, clients_per_round=cfg.clients_per_round, clock=cfg.clock,
                    delay_sigma=cfg.delay_sigma, concurrency=cfg.concurrency, reply_timeout=cfg.reply_timeout_s,
                    poll_interval=cfg.poll_interval_s, wait_nodes=cfg.wait_nodes_s, seed=cfg.seed,
                    on_event=recorder.event)

    def test_metrics() -> dict[str, float]:
        pspec.load_into(model, strategy.params)
        return evaluate(model, splits.test)

    recorder.round(StepLog(0, 0, test=test_metrics()).to_dict())

    def on_round(entry: StepLog) -> None:
        if entry.round % cfg.eval_every == 0 or entry.round == cfg.num_rounds:
            entry.test = test_metrics()
        recorder.round(entry.to_dict())
        acc = f"test-accuracy {entry.test['accuracy']:.4f}" if entry.test else ""
        log(INFO, "round %d/%d v%d: %d/%d updates, %d failed, %d rejected, %d timed out, %.2fs %s", entry.round,
            cfg.num_rounds, entry.version, entry.accepted, entry.sampled, entry.failures, entry.rejected,
            entry.timeouts, entry.seconds, acc)

    runner.run(cfg.num_rounds, on_round)
    train_seconds = time.perf_counter() - t_start
    client_eval = federated_evaluate(grid, directory, dispatcher, strategy.params, strategy.version,
                                     cfg.reply_timeout_s)
    pspec.load_into(model, strategy.params)
    summary = recorder.finish({"run": out.name, "config": cfg.to_dict(), "strategy": strategy.describe(),
                               "final-version": strategy.version, "client-eval": client_eval,
                               "reply-to-dispatch-s": runner.latency_summary(),
                               "wall-seconds": time.perf_counter() - t_start, "train-seconds": train_seconds}, model)
    log(INFO, "run %s finished: final test accuracy %.4f (max of last 5 evals %.4f); outputs in %s", out.name,
        summary["final-test-accuracy"], summary["max-last-5-evals"], out)
    return out
