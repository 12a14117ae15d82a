"""FedMerge's sweep (benchmarks/sweeps/fedmerge-fmnist*.yaml) and benchmarks/reproduce_fedmerge.py: its presets
resolve, and what it measures (cluster recovery, the table)."""

from __future__ import annotations

import json

import pytest

from benchmarks import reproduce_fedmerge as F
from hybridfl import sweep as S
from hybridfl.engine.inprocess import run_inprocess
from server_app.config import load_config

SPEC = "benchmarks/sweeps/fedmerge-fmnist.yaml"


def test_every_job_resolves_to_the_protocol_with_its_method_and_setting():
    jobs = S.load(SPEC).jobs()
    assert len(jobs) == len(F.METHODS) * 2 * 3 + 3 * 2  # the table and the d sweep without the protocol's d
    seeds = [int(key.split("/s")[1].split("/")[0]) for key, _ in jobs]
    rows = (len(F.METHODS) - 1) * 2
    assert seeds[:rows] == [0] * rows  # every cheaper row's first seed first
    assert all("/fedem-" in k for k, _ in jobs[-6:]) and not any("/fedem-" in k for k, _ in jobs[:-6])
    for key, overrides in jobs:
        cfg = load_config(overrides)
        assert cfg.num_clients == 50 and cfg.clients_per_round == 50 and cfg.client_test_fraction > 0
        assert cfg.partitioner == ("clusters" if "-cluster/" in key else "dirichlet")
        assert cfg.data_fraction == 0.1 and cfg.input_size == 14 and cfg.num_rounds == 200 and cfg.cnn_norm == "group"
        assert (cfg.eval_every, cfg.checkpoint_every) == (10, 10)
    fixed = load_config(dict(jobs)["fedmerge-fmnist/fedmerge-fixed-cluster/s0"])
    assert fixed.options["fixed-models"] == 5 and fixed.options["global-models"] == 15
    assert load_config(dict(jobs)["fedmerge-fmnist/fedmerge-personal/s0"]).local_objective == "proximal"


def test_the_tuning_sweep_takes_the_documented_choices_from_the_committed_runs():
    """lr 0.03 (within one standard error of 0.1's validation score on ~525 samples: the protocol's) and Ditto's
    λ 0.1, chosen on validation from benchmarks/results/fedmerge-fmnist/tuning.jsonl without running anything."""
    sweep = S.load("benchmarks/sweeps/fedmerge-fmnist-tune.yaml")
    results = S.load_results(sweep.results)
    assert S.pending(sweep.jobs(), results) == []
    chosen = S.choices(sweep, results)
    assert chosen["fedmerge-fmnist/fedavg-cluster"].point == {"lr": 0.03}
    assert load_config({"preset": "fedmerge-fmnist/fedavg-cluster"}).lr == 0.03
    assert chosen["fedmerge-fmnist/ditto-cluster"].point == {"ditto-lambda": 0.1}
    assert load_config({"preset": "fedmerge-fmnist/ditto-cluster"}).options["ditto-lambda"] == 0.1


def test_cluster_recovery_scores_weights_against_the_clients_class_sets(tmp_path):
    out = run_inprocess({"dataset": "synthetic", "num-clients": 6, "clients-per-round": 6, "num-rounds": 1,
                         "local-epochs": 1, "batch-size": 16, "strategy": "fedmerge", "global-models": 3,
                         "partitioner": "clusters", "num-clusters": 2, "client-test-fraction": 0.2,
                         "output-dir": str(tmp_path), "run-name": "r"})
    lines = (out / "clients.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    last["merge-weights"] = [[0.8, 0.1, 0.1]] * 3 + [[0.1, 0.1, 0.8]] * 3  # clusters are id blocks of 3
    (out / "clients.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    rec = F.cluster_recovery(out)
    assert rec["ari"] == pytest.approx(1.0) and rec["within"] == 0.0 and rec["between"] == pytest.approx(1.4)
    last["merge-weights"] = [[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]] * 3  # alternating: no agreement
    (out / "clients.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    assert F.cluster_recovery(out)["ari"] < 0.1


def test_the_table_reports_mean_and_std_over_seeds_and_the_papers_numbers():
    def result(method, setting, seed, acc, extra=""):
        key = f"{F.FAMILY}/{method}-{setting}/s{seed}" + (f"/{extra}" if extra else "")
        return key, {"key": key, "test": acc, "worst": acc - 0.2, "bytes-down": 4e5, "bytes-up": 4e5, "ari": 0.5,
                     "within": 0.1, "between": 0.9, "curve": [[0, 0.1], [10, acc]]}

    results = dict([result("fedmerge", "cluster", s, a) for s, a in ((0, 0.80), (1, 0.90), (2, 0.85))]
                   + [result("fedavg", "cluster", 0, 0.6), result("fedmerge", "cluster", 0, 0.7, "global-models=10")])
    text = F.table(results)
    assert "| FedMerge | 85.0 ± 5.0 | — | 65.0 ± 5.0 | 0.40 / 0.40 | 53.27; 51.18 |" in text
    assert "| FedAvg | 60.0 (1 seed) |" in text
    assert "| 10 | 70.0 (1 seed) | — | 0.50 | 0.10 | 0.90 |" in text
    assert "| 5 | 85.0 ± 5.0 |" in text  # the protocol's d is the table's own runs


def test_report_copies_seed_0_heatmaps_by_d_and_keeps_a_copy_whose_run_folder_is_gone(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "merge-weights-cluster-d15.png").write_bytes(b"kept")  # committed from an earlier machine
    runs = {}
    for setting, d, seed, has_png in (("cluster", 5, 0, True), ("personal", 10, 0, True), ("cluster", 15, 0, False),
                                      ("cluster", 10, 1, True)):
        key = S.job(f"{F.FAMILY}/fedmerge-{setting}", seed, None if d == 5 else {"global-models": d})[0]
        folder = tmp_path / key.replace("/", "_")
        folder.mkdir()
        if has_png:
            (folder / "merge-weights.png").write_bytes(key.encode())
        runs[key] = {"key": key, "folder": str(folder)}
    F.heatmaps(runs, results)
    keys = list(runs)
    assert (results / "merge-weights-cluster-d5.png").read_bytes() == keys[0].encode()
    assert (results / "merge-weights-personal-d10.png").read_bytes() == keys[1].encode()
    assert (results / "merge-weights-cluster-d15.png").read_bytes() == b"kept"
    assert not (results / "merge-weights-cluster-d10.png").exists()  # seed 1's run is not the figure's
