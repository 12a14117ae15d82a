"""benchmarks/reproduce_feddual.py: its presets resolve to the paper's protocol, and what it tabulates."""

from __future__ import annotations

from benchmarks import reproduce_feddual as F
from benchmarks.runs import ranking
from server_app.config import load_config


def test_every_job_resolves_to_the_protocol_with_its_method_and_partition():
    jobs = F.jobs([m for m, _, _ in F.METHODS], [0, 1], [0], None)
    assert len(jobs) == len(F.METHODS) * 2 + (len(F.METHODS) - len(F.ASYNC))
    assert [k.rsplit("/", 1)[1] for k, _ in jobs[:3]] == ["s0", "s0", "s0"]  # every method's first seed first
    for key, overrides in jobs:
        cfg = load_config(overrides)
        assert (cfg.num_clients, cfg.clients_per_round, cfg.num_rounds, cfg.local_epochs) == (100, 10, 180, 3)
        assert (cfg.model, cfg.optimizer, cfg.batch_size, cfg.dirichlet_alpha) == ("lenet", "adam", 32, 0.01)
        assert cfg.partitioner == ("feddual" if "-code/" in key else "dirichlet")
        assert cfg.delay_sigma == (5.0 if "-async-" in key else 0.0)
    options = {m: load_config(F.job(m, "code", 0)[1]) for m in ("feddual", "feddual-reference", "feddual-loss",
                                                                "feddual-aggregation", "mean")}
    switches = {m: (c.local_objective, c.options["dynamic-arrays"], c.options["beta-mode"],
                    c.options["dynamic-source"], c.options["wb-stable"]) for m, c in options.items()}
    assert switches == {"feddual": ("feddual", 2, "epoch", "delta", True),
                        "feddual-reference": ("feddual", 2, "reference", "loss-gradient", False),
                        "feddual-loss": ("feddual", 0, "epoch", "delta", True),
                        "feddual-aggregation": ("cross-entropy", 2, "epoch", "delta", True),
                        "mean": ("cross-entropy", 0, "epoch", "delta", True)}


def test_the_tuning_grid_is_ranked_on_the_validation_split_only():
    results = {}
    for extra, val, test in (({"lr": 1e-3}, 0.70, 0.60), ({"lr": 3e-4}, 0.80, 0.50), ({"lr": 3e-3}, 0.80, 0.90)):
        key, overrides = F.job("fedavg", "code", F.TUNE_SEED, extra)
        results[key] = {"key": key, "config": F.config_digest(overrides), "val": val, "test": test}
    lines = ranking(results, F.tuning_jobs(["fedavg"], None)).splitlines()
    assert lines[2:] == ["| fedavg | lr=0.0003 * | 80.0 | 50.0 |", "|  | lr=0.003 | 80.0 | 90.0 |",
                         "|  | lr=0.001 | 70.0 | 60.0 |"]  # tied on validation: grid order, never test


def test_the_table_reports_both_partitions_and_the_feddual_diagnostics():
    def result(method, partition, seed, acc, **extra):
        key = f"{F.FAMILY}/{method}-{partition}/s{seed}"
        return key, {"key": key, "test": acc, "final": acc - 0.01, "curve": [[0, 0.1], [180, acc]], "beta": None,
                     "underflow": None, "max-weight": None, **extra}

    results = dict([result("feddual", "code", s, a, beta=0.52, underflow=0.0, **{"max-weight": 0.9})
                    for s, a in ((0, 0.80), (1, 0.84))] + [result("feddual", "dirichlet", 0, 0.7),
                                                           result("fedavg", "code", 0, 0.75)])
    text = F.table(results)
    assert "| FedDUAL (paper's reading) | 82.0 ± 2.8 | 81.0 ± 2.8 | 70.0 (1 seed) | 0.520 | 0.000 | 0.900 | " \
           "81.99 ± 0.21 |" in text
    assert "| FedAvg | 75.0 (1 seed) | 74.0 (1 seed) | — | — | — | — | 81.70 ± 0.20 |" in text
