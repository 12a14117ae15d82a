"""benchmarks/reproduce_feddle.py: the preset families it runs, and how it picks up interrupted work."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import reproduce_feddle as R
from server_app.config import load_config
from server_app.inprocess import run_inprocess


@pytest.mark.parametrize("family", sorted(R.FAMILIES))
def test_every_method_and_setting_of_a_family_is_a_preset_of_its_protocol(family):
    configs = {(m, st): load_config({"preset": R.preset(family, m, st)}) for m, _, _ in R.METHODS for st in R.SETTINGS}
    for (method, (alpha, sigma)), cfg in configs.items():
        assert (cfg.dirichlet_alpha, cfg.delay_sigma, cfg.eval_every) == (alpha, sigma, 10)
        assert cfg.validation_size > 0 and cfg.clock == "virtual"
        assert cfg.central_size == 1000  # held out by every method, so all share one test split
        assert (cfg.server_dataset != "") == method.endswith("-ood")
    for grid in R.FAMILIES[family].values():  # every tuning candidate is a valid configuration
        for extra in grid:
            load_config({"preset": R.preset(family, "fedavg", R.MAIN), **extra})


def test_the_fashion_mnist_family_is_the_papers_protocol():
    cfg = load_config({"preset": "feddle-fmnist/feddle-id-dir0.1-n20"})
    assert (cfg.dataset, cfg.num_clients, cfg.clients_per_round, cfg.num_rounds) == ("fashion-mnist", 500, 10, 200)
    assert (cfg.central_size, cfg.options["atlas-size"]) == (1000, 20)
    assert load_config({"preset": "feddle-fmnist/feddle-ood-dir0.1-n20"}).server_dataset == "animal-mnist"


@pytest.fixture
def torch_threads():
    """`_one` sets one torch thread for its worker process; keep this process's count for later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_an_interrupted_run_is_resumed_from_its_checkpoint_unless_its_configuration_changed(tmp_path, torch_threads):
    overrides = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 4,
                 "local-epochs": 1, "batch-size": 16, "strategy": "fedbuff", "buffer-size": 2, "delay-sigma": 1.0,
                 "validation-size": 20, "checkpoint-every": 2, "output-dir": str(tmp_path), "run-name": "r"}
    whole = R._one("k", {**overrides, "run-name": "whole"})
    run_inprocess(overrides)
    (tmp_path / "r" / "summary.json").unlink()  # as if killed after its last checkpoint
    assert R._interrupted(overrides) == tmp_path / "r"
    assert R._interrupted({**overrides, "server-lr": 0.5}) is None  # another configuration starts afresh
    resumed = R._one("k", overrides)
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["resumed-after-step"] == 4
    same = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    assert same(resumed) == same(whole) and resumed["config"] == R.config_digest(overrides)


def test_a_result_is_run_again_only_when_its_resolved_configuration_changed():
    key, overrides = R.job("feddle-fmnist", "fedbuff", R.MAIN, 0)
    digest = R.config_digest(overrides)
    assert R.config_digest({**overrides, "server-lr": 0.5}) != digest
    jobs = [(key, overrides)]
    assert R.pending(jobs, {}) == jobs
    assert R.pending(jobs, {key: {"config": digest}}) == []
    assert R.pending(jobs, {key: {}}) == []  # recorded before digests were kept
    assert R.pending(jobs, {key: {"config": "0" * 16}}) == jobs  # the preset changed since
