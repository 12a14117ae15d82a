"""The one wiring path: :func:`build_run` builds a run from its configuration — data, server data, model,
strategy, runner, recorder, and, with ``resume``, everything restored from the checkpoint — and
:meth:`TrainingRun.execute` drives it with the hybridfl runtime or Flower's own ``start()`` rounds
(``loop``), evaluating, recording and checkpointing every round the same way under both. The
ServerApp, the in-process engine and ``flwr run`` all go through here.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path

import torch
from flwr.common import log
from flwr.serverapp import Grid
from torch import nn

from common.config import part_of
from common.fleet import load_fleet
from common.models import build_from_config, check_on_data
from common.params import ParamSpec
from common.server_data import ServerData, build_server_data
from common.splits import Splits, check_partitions, client_sizes, data_spec, make_splits, task_data
from common.training import LocalRecipe, evaluate
from server_app import node_state
from server_app.checkpoint import CHECKPOINT, check_layout, pack_state, read_checkpoint, unpack_state, write_checkpoint
from server_app.config import RunConfig, client_config
from server_app.evaluation import client_evaluate, federated_evaluate, personal_summary
from server_app.flower import FlowerStrategy
from server_app.outputs import Recorder, run_dir
from server_app.rounds import RoundLog
from server_app.runtime import Runner, RuntimeConfig
from server_app.tracking import open_tracker
from strategies import Strategy, build_strategy


def describe(server_data: ServerData | None) -> str:
    if server_data is None:
        return "none"
    kind = "in-domain" if server_data.in_domain else "out-of-domain"
    return f"{len(server_data)} {kind} samples on {server_data.device}"


@dataclass
class TrainingRun:
    """A run, built and ready to go: :meth:`execute` trains it and writes its outputs."""

    grid: Grid
    cfg: RunConfig
    out: Path
    splits: Splits
    server_data: ServerData | None
    model: nn.Module  # the evaluation model (the strategy holds its own copy)
    pspec: ParamSpec
    strategy: Strategy
    runner: Runner
    recorder: Recorder
    first_round: int = 1  # > 1 when resumed
    started: float = field(default_factory=time.perf_counter)  # for the log line's estimate of the time left
    # wall seconds of the processes before this one (a resumed run); None where the checkpoint did not keep them
    earlier_seconds: float | None = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    node_files: dict[int, int] = field(default_factory=dict)  # in-process nodes' state files (server_app/node_state.py)

    def run_seconds(self) -> float | None:
        """Wall seconds of the whole run so far, over every process that worked on it."""
        return None if self.earlier_seconds is None else self.earlier_seconds + time.perf_counter() - self.t_start

    # -- every round, under either loop -------------------------------------------------------
    def evaluate(self, entry: RoundLog) -> RoundLog:
        """The central model(s) on the test split (and the validation split, when there is one); the first
        model's metrics are unprefixed, the others' carry the model's name. With ``client-test-fraction``
        also every client's own model on its own held-out splits (``personal-*``; ``clients.jsonl``)."""
        for i, (name, params) in enumerate(self.strategy.central_models().items()):
            self.pspec.load_into(self.model, params)
            prefix = f"{name}-" if i else ""
            for split, into in ((self.splits.test, entry.test), (self.splits.validation, entry.validation)):
                if len(split):
                    into.update({prefix + k: v for k, v in evaluate(self.model, split, seed=self.cfg.seed).items()})
        if self.cfg.client_test_fraction > 0:  # personalised: each client's model on its own held-out split
            per_client, _ = client_evaluate(self.grid, self.runner.directory, self.runner.dispatcher, self.strategy,
                                            self.cfg.reply_timeout_s, max_examples=self.runner.evaluated_examples)
            entry.personal = personal_summary(per_client)
            clients = sorted(per_client)
            self.recorder.clients({"round": entry.round, "clients": clients,
                                   **{k: [per_client[c].get(k) for c in clients]
                                      for k in ("eval-accuracy", "eval-loss", "val-loss")},
                                   **self.strategy.client_report()})
        return entry

    def on_round(self, entry: RoundLog) -> None:
        cfg = self.cfg
        last = entry.round in (cfg.num_rounds, self.runner.final_round)
        if entry.round % cfg.eval_every == 0 or last:
            self.evaluate(entry)
        self.recorder.round(entry.to_dict())
        acc = f"test-accuracy {entry.test['accuracy']:.4f}" if entry.test else ""
        if entry.personal.get("clients"):
            acc += f" personal-accuracy {entry.personal['accuracy']:.4f}"
        done = entry.round - self.first_round + 1
        left = (time.perf_counter() - self.started) / done * (cfg.num_rounds - entry.round)
        if cfg.time_budget_s:
            left = min(left, max(0.0, cfg.time_budget_s - (time.perf_counter() - self.started)))
        fleet = f"; device time {entry.device_t:.1f}s, {entry.vanished} vanished" if cfg.fleet else ""
        link = f", {entry.unavailable} unavailable at the SuperLink" if entry.unavailable else ""
        log(INFO, "round %d/%d: %d updates accepted, %d clients dispatched, %d failed, %d rejected, %d timed out%s%s; "
            "model v%d; %.2fs, about %s left; %s", entry.round, cfg.num_rounds, entry.accepted, entry.sampled,
            entry.failures, entry.rejected, entry.timeouts, link, fleet, entry.version, entry.seconds, duration(left),
            acc)
        if cfg.checkpoint_every and (entry.round % cfg.checkpoint_every == 0 or last):
            self.checkpoint(entry.round)
        self.check_failures(entry.round)

    def check_failures(self, rnd: int) -> None:
        """Stop a run whose clients fail: more than ``max-failed-fraction`` of the dispatches so far failed, were
        rejected or timed out, once ``clients-per-round`` of them have ended (a run must not end as a success
        having learned nothing). Messages the SuperLink lost (``unavailable``: a restart, an expiry) say nothing
        of the devices and are left out of both counts."""
        totals = self.recorder.totals()
        lost = totals["failures"] + totals["rejected"] + totals["timeouts"]
        ended = lost + totals["accepted"]
        if ended >= self.cfg.clients_per_round and lost > self.cfg.max_failed_fraction * ended:
            raise RuntimeError(f"round {rnd}: {lost} of the run's {ended} dispatches failed, were rejected or timed "
                               f"out ({totals['timeouts']} timed out after reply-timeout-s = "
                               f"{self.cfg.reply_timeout_s:g}), more than max-failed-fraction = "
                               f"{self.cfg.max_failed_fraction:g}; the first: "
                               f"{self.runner.first_loss or 'not recorded (the run was resumed)'}")

    def check_learned(self) -> None:
        """A run that ends having made no model from an accepted update or from the server's own training (Center
        trains on the server's data alone) has learned nothing: it fails, saying why."""
        totals = self.recorder.totals()
        if self.first_round <= self.cfg.num_rounds and totals["accepted"] == 0 and self.strategy.version == 0:
            raise RuntimeError(f"the run accepted no update in {self.cfg.num_rounds} rounds ({totals['failures']} "
                               f"failed, {totals['rejected']} rejected, {totals['unavailable']} unavailable at the "
                               f"SuperLink, {totals['timeouts']} timed out after "
                               f"reply-timeout-s = {self.cfg.reply_timeout_s:g}; any other dispatch was still on its "
                               f"way at the end, delay-sigma = {self.cfg.delay_sigma:g}); the first: "
                               f"{self.runner.first_loss or 'none recorded'}")

    def checkpoint(self, rnd: int) -> None:
        holds = isinstance(self.grid, node_state.HoldsNodes)
        if holds:
            self.node_files = node_state.save(self.grid, self.out, rnd, self.node_files)
        write_checkpoint(self.out, {
            "round": rnd, "config": self.cfg.to_dict(),
            "layout": {"names": list(self.pspec.names), "shapes": [list(s) for s in self.pspec.shapes]},
            "strategy": pack_state(self.strategy.state_dict(), type(self.strategy)), "runner": self.runner.state_dict(),
            "recorder": self.recorder.state_dict(), "torch-rng": torch.get_rng_state(),
            "run-seconds": self.run_seconds(), **({"nodes": self.node_files} if holds else {})})
        if holds:
            node_state.prune(self.out, self.node_files)

    # -- the run ------------------------------------------------------------------------------
    def execute(self) -> Path:
        """Train from `first_round` to ``num-rounds``, evaluate on the clients, write the outputs; return the folder."""
        cfg, self.t_start = self.cfg, time.perf_counter()
        log(INFO, "run %s: %s on %s (%d train / %d test), server data: %s, %d clients, %d rounds%s, %s clock (σ=%g), "
            "%s loop -> %s", self.out.name, cfg.strategy, cfg.dataset, len(self.splits.train), len(self.splits.test),
            describe(self.server_data), cfg.num_clients, cfg.num_rounds,
            f" (resumed after round {self.first_round - 1})" if self.first_round > 1 else "", cfg.clock,
            cfg.delay_sigma, cfg.loop, self.out)
        # a resumed run goes on without devices gone for good, as a running one does (a new one needs them all)
        self.runner.directory.wait_for(cfg.num_clients, cfg.wait_nodes_s, least=1 if self.first_round > 1 else None)
        if self.first_round == 1:
            self.recorder.round(self.evaluate(RoundLog(0, 0)).to_dict())
        t_train = self.started = time.perf_counter()
        if self.first_round <= cfg.num_rounds:
            if cfg.loop == "flower":
                adapter = FlowerStrategy(self.strategy, clients_per_round=cfg.clients_per_round, seed=cfg.seed,
                                         server_data=self.server_data, runner=self.runner, on_round=self.on_round,
                                         first_round=self.first_round)
                adapter.start(self.grid, self.pspec.to_record(self.strategy.params),
                              num_rounds=cfg.num_rounds - self.first_round + 1, timeout=cfg.reply_timeout_s)
            else:
                self.runner.run(cfg.num_rounds, self.on_round, self.first_round)
        train_seconds = time.perf_counter() - t_train
        self.check_learned()
        client_eval = federated_evaluate(self.grid, self.runner.directory, self.runner.dispatcher, self.strategy,
                                         cfg.reply_timeout_s, self.runner.evaluated_examples)
        models = {}
        for name, params in self.strategy.central_models().items():
            self.pspec.load_into(self.model, params)
            models[name] = copy.deepcopy(self.model.state_dict())
        summary = self.recorder.finish({
            "run": self.out.name, "config": cfg.to_dict(), "strategy": self.strategy.describe(),
            "final-version": self.strategy.version, "client-eval": client_eval,
            "server-data": describe(self.server_data), "resumed-after-round": self.first_round - 1,
            "reply-to-dispatch-s": self.runner.latency_summary(), "in-flight-at-end": self.runner.discarded,
            "lost-at-resume": self.runner.lost_at_resume, "pushed-again": self.runner.pushed_again,
            "wall-seconds": time.perf_counter() - self.t_start, "run-wall-seconds": self.run_seconds(),
            "train-seconds": train_seconds}, models,
            type(self.strategy).figures, cfg.plots)
        log(INFO, "run %s finished: final test accuracy %.4f (max of last 5 evals %.4f); outputs in %s", self.out.name,
            summary["final-test-accuracy"], summary["max-last-5-evals"], self.out)
        if "personal-selected-accuracy" in summary:
            log(INFO, "personalised accuracy (mean over clients): final %.4f, at the lowest validation loss (round %d) "
                "%.4f", summary["personal-final-accuracy"], summary["personal-selected-round"],
                summary["personal-selected-accuracy"])
        return self.out


def duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``2h13m``."""
    s = round(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


FEW_TEST_ROWS = 10  # fewer test samples per client than this make a personalised accuracy coarse


def build_run(grid: Grid, cfg: RunConfig) -> TrainingRun:
    """Everything a run needs, from its configuration; with ``resume``, restored from the run's checkpoint."""
    resumed = read_checkpoint(Path(cfg.resume)) if cfg.resume else None
    spec = data_spec(cfg)
    splits, full = make_splits(spec), task_data(spec)
    fewest = check_partitions(spec)
    if spec.client_test_fraction and fewest < FEW_TEST_ROWS:
        log(WARNING, "client-test-fraction %s leaves a client %d test samples: its personalised accuracy moves in "
            "steps of %.0f points (raise client-test-fraction, or use fewer clients)", spec.client_test_fraction,
            fewest, 100 / max(fewest, 1))
    server_data = build_server_data(cfg, splits)
    model = build_from_config(cfg.to_dict(), full.x.shape[1:], full.num_classes, seed=cfg.seed)
    check_on_data(model, full.x, full.num_classes, cfg.model)
    pspec = ParamSpec.of(model)
    recipe = part_of(LocalRecipe, cfg)
    strategy = build_strategy(cfg.strategy, cfg.options, seed=cfg.seed, num_clients=cfg.num_clients, recipe=recipe)
    if strategy.server_need() == "none" and server_data is not None:  # the need itself is checked at attach
        log(INFO, "strategy '%s' does not use the server's data (%s)", cfg.strategy, describe(server_data))
    strategy.initialize(pspec.flatten(model), pspec, copy.deepcopy(model))
    if cfg.checkpoint_every:  # a state a checkpoint could not load back is refused now, not at the resume
        pack_state(strategy.state_dict(), type(strategy))
    runner = Runner(grid, strategy, client_config(cfg), part_of(RuntimeConfig, cfg), seed=cfg.seed,
                    server_data=server_data, client_sizes=client_sizes(spec),
                    fleet=load_fleet(cfg.fleet, cfg.num_clients, cfg.seed))
    # The run's folder once every check at start passed: a run refused at start leaves none
    out = Path(cfg.resume) if cfg.resume else run_dir(cfg)
    if resumed is None:  # a named folder may hold an older run's checkpoint: it must not be resumed into this run
        (out / CHECKPOINT).unlink(missing_ok=True)
        node_state.prune(out, {})
    first_round, earlier, node_files = 1, 0.0, {}
    if resumed is not None:
        check_layout(out, resumed, pspec.names, pspec.shapes)
        strategy.load_state_dict(unpack_state(resumed["strategy"], type(strategy), out))
        runner.load_state_dict(resumed["runner"])
        torch.set_rng_state(resumed["torch-rng"])
        first_round = int(resumed["round"]) + 1
        earlier = resumed.get("run-seconds")
        if isinstance(grid, node_state.HoldsNodes):
            node_files = dict(resumed.get("nodes", {}))
            node_state.load(grid, out, node_files)
        elif resumed.get("nodes"):
            log(INFO, "the states of the %d in-process nodes kept in %s stay unused: this runtime's nodes keep "
                "their own", len(resumed["nodes"]), out / node_state.FOLDER)
    recorder = Recorder(out, resumed["recorder"] if resumed is not None else None, open_tracker(cfg, out))
    runner.on_event = recorder.event
    return TrainingRun(grid, cfg, out, splits, server_data, model, pspec, strategy, runner, recorder, first_round,
               earlier_seconds=earlier, node_files=node_files)
