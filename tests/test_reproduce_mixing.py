"""The mixing sweeps (benchmarks/sweeps/mixing-fmnist*.yaml): its presets resolve to the label-shift protocol, and what
benchmarks/reproduce_mixing.py measures."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import write_jpg, write_leaf

from benchmarks import reproduce_mixing as M
from hybridfl import sweep as S
from hybridfl.engine.inprocess import run_inprocess
from server_app.config import load_config


@pytest.mark.parametrize("setting", M.SETTINGS)
def test_every_preset_resolves_to_the_protocol_with_its_label_shift(setting):
    lacking = {"binary": "0", "classes10": "7,8,9"}[setting]
    assert M.lacking_classes(setting) == tuple(int(c) for c in lacking.split(","))
    jobs = dict(S.load("benchmarks/sweeps/mixing-fmnist.yaml").jobs())
    for method, _ in M.METHODS:
        cfg = load_config(jobs[f"{M.FAMILY}/{method}-{setting}/s0"])
        assert (cfg.num_clients, cfg.clients_per_round, cfg.num_rounds, cfg.dataset) == (100, 10, 100, "fashion-mnist")
        assert cfg.binary_positive == ("0,2,3,4,6" if setting == "binary" else "")
        assert cfg.central_classes == ("" if method == "oracle" else lacking)  # the oracle federates everything
    strategies = {m: load_config(jobs[f"{M.FAMILY}/{m}-{setting}/s0"]).strategy for m, _ in M.METHODS}
    assert strategies == {"nomix": "fedavg", "parallel": "parallel-training", "example": "example-transfer",
                          "gradient": "gradient-transfer", "oracle": "fedavg", "fedft": "fedft", "hfcl": "hfcl"}


def test_the_tuning_sweep_takes_the_protocols_values_from_the_committed_runs():
    """Each variant's open choice as the protocol has it: by the one-standard-error rule, and parallel training's
    pair as the best validation score (it ran before the rule), read without running anything."""
    sweep = S.load("benchmarks/sweeps/mixing-fmnist-tune.yaml")
    results = S.load_results(sweep.results)
    assert S.pending(sweep.jobs(), results) == []
    for preset, chosen in S.choices(sweep, results).items():
        cfg = load_config({"preset": preset}).to_dict()
        assert chosen is not None and all(cfg[k] == v for k, v in chosen.point.items()), preset


def test_the_lacking_classes_accuracy_is_measured_on_those_test_samples_only(tmp_path):
    out = run_inprocess({"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "num-rounds": 2,
                         "central-classes": "3", "strategy": "fedavg", "output-dir": str(tmp_path), "run-name": "r"})
    assert M.lacking_accuracy(out, (3,)) == 0.0  # never seen: never predicted
    assert M.lacking_accuracy(out, (0, 1, 2)) > 0.5


def test_a_binary_run_trains_a_two_class_head_on_server_and_clients(tmp_path):
    out = run_inprocess({"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "num-rounds": 2,
                         "binary-positive": "1,2,3", "central-classes": "0", "strategy": "example-transfer",
                         "transfer-examples": 4, "output-dir": str(tmp_path), "run-name": "r"})
    assert torch.load(out / "model.pt", weights_only=True)["head.bias"].shape == (2,)
    assert M.lacking_accuracy(out, (1,)) > 0.5  # label 1: the positives the clients hold


def test_the_table_puts_accuracy_and_extra_bytes_side_by_side():
    def result(method, setting, seed, acc, lacking, extra):
        key = f"{M.FAMILY}/{method}-{setting}/s{seed}"
        return key, {"key": key, "test": acc, "lacking": lacking, "extra-bytes": extra, "curve": [[0, 0.1], [5, acc]]}

    results = dict([result("example", "binary", s, a, 0.8, 128 * 785 * 4) for s, a in ((0, 0.9), (1, 0.8))]
                   + [result("nomix", "binary", 0, 0.5, 0.0, 0)])
    text = M.table(results)
    assert "| example transfer | 85.0 ± 7.1 (2 seeds) | 80.0 ± 0.0 (2 seeds) | 401.9 | — | — | — |" in text
    assert "| no mixing (FedAvg, clients' data) | 50.0 (1 seed) | 0.0 (1 seed) | 0.0 | — | — | — |" in text


def test_the_cost_benchmark_times_each_variant_on_what_its_dispatch_really_carries():
    from benchmarks import mixing_cost as C

    spec = C.built("example")[2]
    extra = {m: C.server_round(m)[1].extra_nbytes for m in C.VARIANTS.values()}
    # 128 transferred examples of 28x28 pixels and a label; one gradient the size of the trainable parameters
    assert extra == {"nomix": 0, "parallel": 0, "example": 4 * 128 * (28 * 28 + 1), "gradient": 4 * spec.numel}
    C.client_run("gradient", 20)  # the ClientApp's path: the received gradient in the objective


@pytest.mark.parametrize("method", ["nomix", "parallel", "example", "gradient", "oracle"])
def test_the_celeba_presets_run_the_papers_shift_when_its_files_are_present(tmp_path, method):
    """The paper's own experiment on LEAF CelebA files written here: the clients keep the smiling faces, the server
    holds every unsmiling one (the oracle federates both)."""
    from common.splits import data_spec, make_splits

    users = {}
    for c in range(8):
        names = [f"{c:02d}{i}.jpg" for i in range(8)]
        for i, name in enumerate(names):
            write_jpg(tmp_path / "celeba" / "img_align_celeba" / name, (30 * i, 20 * c, 255 * (i % 2)), (8, 8))
        users[f"celeb{c}"] = (names, [float(i % 2) for i in range(8)])
    write_leaf(tmp_path / "celeba" / "train" / "t.json", users)
    run = {"preset": f"mixing-celeba/{method}", "data-root": str(tmp_path), "num-clients": 6, "clients-per-round": 2,
           "num-rounds": 2, "validation-size": 4, "eval-every": 1, "output-dir": str(tmp_path / "out"),
           "run-name": method}
    cfg = load_config(run)
    splits = make_splits(data_spec(cfg))
    if method == "oracle":
        assert len(splits.central) == 0 and set(splits.train.y.tolist()) == {0, 1}
    else:  # every unsmiling training face is the server's; the clients keep the smiling ones
        assert set(splits.central.y.tolist()) == {0} and set(splits.train.y.tolist()) == {1}
        assert len(splits.central) + len(splits.train) + len(splits.test) + len(splits.validation) == 64
    summary = json.loads((run_inprocess(run) / "summary.json").read_text())
    if method == "gradient":  # one model-sized gradient
        assert summary["extra-bytes-down-per-dispatch"] > 0
    else:  # 20 central faces of 3x32x32 and a label; nothing for the others
        faces = 4 * 20 * (3 * 32 * 32 + 1)
        assert (summary["extra-bytes-down-per-dispatch"] or 0) == (faces if method == "example" else 0)
