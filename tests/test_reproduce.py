"""The Feddle families' sweeps (benchmarks/sweeps/feddle-*.yaml), what benchmarks/reproduce_feddle.py tabulates, and
the sweep machinery under them: digests, resume, parallel lanes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from benchmarks import reproduce_feddle as R
from hybridfl import sweep as S
from hybridfl.engine.inprocess import run_inprocess
from server_app.config import load_config, used_keys

FAMILIES = ("feddle-animal", "feddle-fmnist")


def spec(name: str) -> S.Sweep:
    return S.load(f"benchmarks/sweeps/{name}.yaml")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_and_setting_of_a_family_is_a_preset_of_its_protocol(family):
    jobs = spec(family).jobs()
    methods = {o["preset"].split("/")[1].rsplit("-dir", 1)[0] for _, o in jobs}
    assert methods == {m for m, _, _ in R.methods(family)}
    for _, overrides in jobs:
        cfg = load_config(overrides)
        method = overrides["preset"].split("/")[1].rsplit("-dir", 1)[0]
        assert overrides["preset"] == R.preset(family, method, (cfg.dirichlet_alpha, int(cfg.delay_sigma)))
        assert cfg.eval_every == 10 and cfg.validation_size > 0 and cfg.clock == "virtual"
        assert cfg.central_size == 1000  # held out by every method, so all share one test split
        assert (cfg.server_dataset != "") == method.endswith("-ood")
        assert (overrides["seed"] in (0, 1, 2)) if (cfg.dirichlet_alpha, cfg.delay_sigma) == R.MAIN else (
            overrides["seed"] == 0)


@pytest.mark.parametrize("name", ["feddle-animal-tune", "feddle-fmnist-tune", "feddle-fmnist-select"])
def test_every_tuning_candidate_sets_keys_its_method_uses_at_seed_100(name):
    """A grid over a key the method ignores (HFCL has no server lr) would spend runs on identical results."""
    from server_app.config import RunConfig

    for key, overrides in spec(name).jobs():
        cfg = load_config(overrides)
        point = {k: v for k, v in overrides.items() if k not in ("preset", "seed", "output-dir", "run-name")}
        assert set(point) <= used_keys(cfg) | set(RunConfig.specs()), key
        assert overrides["seed"] == 100 and (cfg.dirichlet_alpha, cfg.delay_sigma) == R.MAIN


def test_the_fashion_mnist_family_is_the_papers_protocol():
    cfg = load_config({"preset": "feddle-fmnist/feddle-id-dir0.1-n20"})
    assert (cfg.dataset, cfg.num_clients, cfg.clients_per_round, cfg.num_rounds) == ("fashion-mnist", 500, 10, 200)
    assert (cfg.central_size, cfg.options["atlas-size"]) == (1000, 20)
    assert load_config({"preset": "feddle-fmnist/feddle-ood-dir0.1-n20"}).server_dataset == "animal-mnist"


@pytest.fixture
def torch_threads():
    """A sweep's worker sets one torch thread for its process; keep this process's count for later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_an_interrupted_run_is_resumed_from_its_checkpoint_unless_its_configuration_changed(tmp_path, torch_threads):
    overrides = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 4,
                 "local-epochs": 1, "batch-size": 16, "strategy": "fedbuff", "buffer-size": 2, "delay-sigma": 1.0,
                 "validation-size": 20, "checkpoint-every": 2, "output-dir": str(tmp_path), "run-name": "r"}
    one = lambda o: S.record("k", o, "max-last-5-evals", "val-max-last-5-evals", "benchmarks.reproduce_feddle:record")
    whole = one({**overrides, "run-name": "whole"})
    run_inprocess(overrides)
    (tmp_path / "r" / "summary.json").unlink()  # as if killed after its last checkpoint
    assert S.interrupted(overrides) == tmp_path / "r"
    assert S.interrupted({**overrides, "server-lr": 0.5}) is None  # another configuration starts afresh
    resumed = one(overrides)
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["resumed-after-round"] == 4
    same = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "folder")}
    assert same(resumed) == same(whole) and resumed["config"] == S.config_digest(overrides)
    assert resumed["series"] and resumed["curve"] and resumed["val"] is not None


def test_a_result_is_run_again_only_when_its_resolved_configuration_changed():
    key, overrides = S.job(R.preset("feddle-fmnist", "fedbuff", R.MAIN), 0)
    digest = S.config_digest(overrides)
    assert S.config_digest({**overrides, "server-lr": 0.5}) != digest
    jobs = [(key, overrides)]
    assert S.pending(jobs, {}) == jobs
    assert S.pending(jobs, {key: {"config": digest}}) == []
    assert S.pending(jobs, {key: {}}) == []  # recorded before digests were kept
    assert S.pending(jobs, {key: {"config": "0" * 16}}) == jobs  # the preset changed since


def test_an_option_added_at_its_default_keeps_the_digests_of_finished_runs():
    config = load_config({"preset": R.preset("feddle-fmnist", "feddle-id", R.MAIN)}).to_dict()
    before = {k: v for k, v in config.items() if k != "search-every"}  # as resolved before that option existed
    assert S.digest(before) == S.digest(config)
    assert S.digest({**config, "search-every": "step"}) != S.digest(config)
    assert S.digest({**config, "run-name": "elsewhere", "output-dir": "/tmp"}) == S.digest(config)


def test_series_keeps_every_evaluation_with_the_means_of_the_steps_since_the_last():
    rows = [{"round": 0, "test-accuracy": 0.1, "val-loss": 2.3},
            {"round": 1, "loss-after": 1.0, "accepted": 4}, {"round": 2, "loss-after": 3.0, "accepted": 6,
                                                             "test-accuracy": 0.5, "val-loss": 1.5},
            {"round": 3, "server-train-loss": 0.7, "test-accuracy": 0.6}]
    got = R.series(rows)
    assert [e["round"] for e in got] == [0, 2, 3]
    assert got[1] == {"round": 2, "test-accuracy": 0.5, "val-loss": 1.5, "loss-after": 2.0, "accepted": 5.0}
    assert got[2] == {"round": 3, "test-accuracy": 0.6, "server-train-loss": 0.7}


def test_analysis_rows_reuse_the_tables_runs_and_take_fedft_s_schedule_for_center():
    rows = {c.block: c for c in S.candidates(spec("feddle-fmnist-analysis"), {})}
    table = dict(spec("feddle-fmnist").jobs())
    assert rows["Feddle-ID"].overrides == table["feddle-fmnist/feddle-id-dir0.1-n20/s0"]  # the table's own run
    assert rows["Feddle-ID, atlas-size 40"].point == {"atlas-size": 40}
    fedft = load_config({"preset": R.preset("feddle-fmnist", "fedft", R.MAIN)})
    center = load_config(rows["Center on Fed+FT's server schedule"].overrides)
    assert (center.strategy, center.options["server-train-lr"], center.options["server-train-epochs"]) == (
        "center", fedft.options["server-train-lr"], fedft.options["server-train-epochs"])


def test_the_delivered_updates_row_counts_every_run_with_clients_and_not_center(tmp_path):
    """The clients' schedule is the setting's and seed's, so every method with clients fills the row; Center never."""
    fam, n5 = "feddle-fmnist", (0.1, 5)
    results = {f"{R.preset(fam, 'fedavg', n5)}/s0": {"test": 0.7, "accepted": 1800, "curve": [[0, 0.1]]},
               f"{R.preset(fam, 'fedbuff', n5)}/s0": {"test": 0.7, "accepted": 1900, "curve": [[0, 0.1]]},
               f"{R.preset(fam, 'center', R.MAIN)}/s0": {"test": 0.8, "accepted": 100, "curve": [[0, 0.1]]}}
    sweep = dataclasses.replace(spec(fam), report=tmp_path / "table.md")
    row = next(line for line in R.table(results, sweep).splitlines() if line.startswith("| accepted updates"))
    assert row.split("|")[3:5] == [" — ", " 9.25 "]  # (1800 + 1900) / 2 / 200 steps; Center left out
    assert (tmp_path / "accuracy.png").is_file()


def test_the_table_explains_its_validated_rows_only_where_it_has_them(tmp_path):
    """Fashion-MNIST's table has issue 36's ‡ rows and says what ‡ means; the Animal family's has none and no legend."""
    for fam, validated in (("feddle-fmnist", True), ("feddle-animal", False)):
        text = R.table({}, dataclasses.replace(spec(fam), report=tmp_path / "table.md"))
        rows = [line for line in text.splitlines() if "‡ |" in line]
        assert bool(rows) == validated and text.splitlines()[-1].startswith("‡ a configuration") == validated
        if validated:  # the pull is the papers' method at another λ: its papers' column points at their row
            pull = next(line for line in rows if line.startswith("| Feddle-OOD, pull"))
            assert pull.rstrip(" |").endswith("the papers' method at λ 0.01: the Feddle-OOD row")


def test_step_size_sums_the_coefficients_over_the_atlas_in_the_runs_second_half_only():
    result = {"series": [{"round": 0}, {"round": 50, "c-mean": 1.0}, {"round": 100, "c-mean": 0.5},
                         {"round": 150, "c-mean": 0.002}, {"round": 200, "c-mean": 0.004}]}
    assert R.step_size(result, 20) == pytest.approx(20 * (0.002 + 0.004) / 2)
    assert R.step_size({"series": [{"round": 0}, {"round": 200, "server-train-loss": 0.1}]}, 20) is None


def _lane_result(key, overrides):
    """A run that, while it runs, sees another process append its own result to the same file."""
    S.append(Path(overrides["path"]), {"key": "other-lane", "test": 0.5})
    return {"key": key, "test": 0.9, "val": 0.9, "seconds": 1.0}


def test_run_all_returns_the_results_another_process_appended_while_it_ran(tmp_path):
    path = tmp_path / "runs.jsonl"
    got = S.run_all([("mine", {"path": str(path)})], path, 1, _lane_result, progress=lambda *_: None)
    assert sorted(got) == ["mine", "other-lane"]
    assert got["other-lane"]["test"] == 0.5


def _fails_on_odd(key, overrides):
    if overrides["n"] % 2:
        raise RuntimeError(f"Expected all tensors to be on the same device ({key})")
    return {"key": key, "test": 0.5 + overrides["n"] / 10, "val": None, "seconds": 1.0}


def test_a_run_that_raises_is_named_and_the_other_runs_results_are_kept(tmp_path):
    """One failing run (a device error on a GPU, a missing dataset) must not lose the runs beside it."""
    path = tmp_path / "runs.jsonl"
    heard: list[str] = []
    jobs = [(f"run{n}", {"n": n}) for n in range(4)]
    with pytest.raises(S.RunsFailed) as failed:
        S.run_all(jobs, path, 2, _fails_on_odd, progress=lambda text, *_: heard.append(text))
    assert sorted(failed.value.failed) == ["run1", "run3"]
    assert "RuntimeError: Expected all tensors to be on the same device (run1)" in str(failed.value)
    assert sorted(S.load_results(path)) == ["run0", "run2"]  # the others ran to the end and were kept
    assert sum("FAILED" in text for text in heard) == 2


def test_select_takes_the_first_candidate_within_one_standard_error_of_the_best_validation_score():
    """The one-standard-error rule on seed 100's validation split (1000 samples: SE ≈ 1.3 points at 80 %):
    the simplest candidate within it wins over a better but costlier one; test scores never matter; nothing is
    chosen while a candidate is missing; the baselines beside the candidates are not chosen among."""
    sweep = spec("feddle-fmnist-select")
    preset = R.preset("feddle-fmnist", "feddle-id", R.MAIN)
    jobs = [(p, j) for _, pre, p, j in sweep.rows() if pre == preset]
    vals = [0.70, 0.799, 0.80, 0.81] + [0.5] * (len(jobs) - 4)  # best 0.81, SE 1.24 points: 0.799 is within
    results = {}
    for (_, [(key, overrides)]), val in zip(jobs, vals):
        results[key] = {"key": key, "config": S.config_digest(overrides), "val": val, "test": 1 - val}
    assert S.choices(sweep, results)[preset].point == jobs[1][0]
    results[key]["val"] = 0.95  # the last candidate far ahead: only it is within one SE
    assert S.choices(sweep, results)[preset].point == jobs[-1][0]
    del results[key]
    assert S.choices(sweep, results)[preset] is None
    assert S.choices(sweep, results)[R.preset("feddle-fmnist", "fedft", R.MAIN)] is None  # a baseline
