"""FedDUAL's sweeps (benchmarks/sweeps/feddual-fmnist*.yaml): its presets resolve to the paper's protocol, and what
benchmarks/reproduce_feddual.py tabulates."""

from __future__ import annotations

from benchmarks import reproduce_feddual as F
from hybridfl import sweep as S
from server_app.config import load_config


def test_every_job_resolves_to_the_protocol_with_its_method_and_partition():
    jobs = S.load("benchmarks/sweeps/feddual-fmnist.yaml").jobs()
    assert len(jobs) == len(F.METHODS) * 3 + (len(F.METHODS) - len(F.ASYNC))
    assert [k.rsplit("/", 1)[1] for k, _ in jobs[:3]] == ["s0", "s0", "s0"]  # every method's first seed first
    for key, overrides in jobs:
        cfg = load_config(overrides)
        assert (cfg.num_clients, cfg.clients_per_round, cfg.num_rounds, cfg.local_epochs) == (100, 10, 180, 3)
        assert (cfg.model, cfg.optimizer, cfg.batch_size, cfg.dirichlet_alpha) == ("lenet", "adam", 32, 0.01)
        assert cfg.partitioner == ("feddual" if "-code/" in key else "dirichlet")
        assert cfg.delay_sigma == (5.0 if "-async-" in key else 0.0)
    ablation = ("feddual", "feddual-reference", "feddual-loss", "feddual-aggregation", "mean")
    options = {m: load_config(dict(jobs)[f"{F.FAMILY}/{m}-code/s0"]) for m in ablation}
    switches = {m: (c.local_objective, c.options["dynamic-arrays"], c.options["beta-mode"],
                    c.options["dynamic-source"], c.options["wb-stable"]) for m, c in options.items()}
    assert switches == {"feddual": ("feddual", 2, "epoch", "delta", True),
                        "feddual-reference": ("feddual", 2, "reference", "loss-gradient", False),
                        "feddual-loss": ("feddual", 0, "epoch", "delta", True),
                        "feddual-aggregation": ("cross-entropy", 2, "epoch", "delta", True),
                        "mean": ("cross-entropy", 0, "epoch", "delta", True)}


def test_the_tuning_sweep_takes_the_protocols_values_from_the_committed_runs():
    """The best validation score (these grids ran before the one-standard-error rule), read without running."""
    sweep = S.load("benchmarks/sweeps/feddual-fmnist-tune.yaml")
    results = S.load_results(sweep.results)
    assert S.pending(sweep.jobs(), results) == []
    chosen = S.choices(sweep, results)
    assert chosen[f"{F.FAMILY}/fedavg-code"].point == {"lr": load_config({"preset": f"{F.FAMILY}/fedavg-code"}).lr}
    mu = load_config({"preset": f"{F.FAMILY}/fedprox-code"}).options["proximal-mu"]
    assert chosen[f"{F.FAMILY}/fedprox-code"].point == {"proximal-mu": mu}


def test_the_table_reports_both_partitions_and_the_feddual_diagnostics():
    def result(method, partition, seed, acc, **extra):
        key = f"{F.FAMILY}/{method}-{partition}/s{seed}"
        return key, {"key": key, "test": acc, "final": acc - 0.01, "curve": [[0, 0.1], [180, acc]], "beta": None,
                     "underflow": None, "max-weight": None, **extra}

    results = dict([result("feddual", "code", s, a, beta=0.52, underflow=0.0, **{"max-weight": 0.9})
                    for s, a in ((0, 0.80), (1, 0.84))] + [result("feddual", "dirichlet", 0, 0.7),
                                                           result("fedavg", "code", 0, 0.75)])
    text = F.table(results)
    assert ("| FedDUAL (paper's reading) | 82.0 ± 2.8 (2 seeds) | 81.0 ± 2.8 (2 seeds) | 70.0 (1 seed) | 0.520 "
            "| 0.000 | 0.900 | 81.99 ± 0.21 |") in text
    assert "| FedAvg | 75.0 (1 seed) | 74.0 (1 seed) | — | — | — | — | 81.70 ± 0.20 |" in text
