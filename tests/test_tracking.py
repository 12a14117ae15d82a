"""Experiment tracking (server_app/tracking.py): TensorBoard event files and an MLflow store, read back; a sweep as
one MLflow experiment; a resumed run in its own MLflow run; the checks at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from common.errors import ConfigError
from hybridfl import sweep as sweeps
from hybridfl.engine.inprocess import run_inprocess
from server_app.config import load_config

SHORT = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "local-epochs": 1, "batch-size": 16,
         "num-rounds": 2, "eval-every": 1}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_holds_every_steps_metrics_and_the_merging_weights_as_an_image(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_inprocess({"preset": "fedmerge-digits", **SHORT, "num-clusters": 2, "tracking": "tensorboard",
                         "output-dir": str(tmp_path), "run-name": "tb"})
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    rows = _rows(out)
    accuracy = events.Scalars("test-accuracy")
    assert [e.step for e in accuracy] == [r["round"] for r in rows] == [0, 1, 2]
    assert [e.value for e in accuracy] == pytest.approx([r["test-accuracy"] for r in rows])
    assert [e.value for e in events.Scalars("accepted")] == [r["accepted"] for r in rows]
    assert [e.step for e in events.Scalars("personal-accuracy")] == [0, 1, 2]
    weights = events.Images("merge-weights")  # one image per personalised evaluation: clients x global models
    assert [e.step for e in weights] == [0, 1, 2] and weights[-1].height == 4


@pytest.fixture
def mlflow_reader(monkeypatch):
    """MLflow's client in this process reads the local file store (mlflow ≥ 3 asks to opt in, as the runs do)."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return mlflow


def test_mlflow_holds_params_metrics_and_artifacts_and_a_resumed_run_goes_on_in_it(tmp_path, mlflow_reader):
    mlflow = mlflow_reader

    overrides = {"preset": "fedavg-digits", **SHORT, "tracking": "mlflow", "checkpoint-every": 1,
                 "output-dir": str(tmp_path), "run-name": "ml"}
    out = run_inprocess(overrides)
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = json.loads((out / "tracking.json").read_text())["mlflow-run-id"]
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "fedavg-digits"  # default: the preset
    assert run.data.params["lr"] == str(load_config(overrides).lr) and run.info.run_name == "ml"
    history = lambda: sorted((m.step, m.value) for m in client.get_metric_history(run_id, "test-accuracy"))
    assert [s for s, _ in history()] == [r["round"] for r in _rows(out)]
    assert [v for _, v in history()] == pytest.approx([r["test-accuracy"] for r in _rows(out)])
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "model.pt", "metrics.jsonl", "accuracy.png"} <= artifacts
    assert "checkpoint.pt" not in artifacts
    assert run.data.metrics["summary.final-test-accuracy"] == pytest.approx(_rows(out)[-1]["test-accuracy"])

    run_inprocess({"resume": str(out), "num-rounds": 3})
    assert json.loads((out / "tracking.json").read_text())["mlflow-run-id"] == run_id  # the same MLflow run
    assert [s for s, _ in history()] == [0, 1, 2, 3]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_tracked_sweep_is_one_experiment_with_one_run_per_job_and_keeps_its_digests(tmp_path, monkeypatch,
                                                                                       mlflow_reader):
    mlflow = mlflow_reader

    monkeypatch.chdir(tmp_path)
    spec = {"runs": [{"presets": "fedavg-digits", "grid": {"lr": [0.05, 0.1]}}],
            "overrides": {**SHORT, "tracking": "mlflow", "tracking-uri": (tmp_path / "store").as_uri()}}
    (tmp_path / "tracked.yaml").write_text(yaml.safe_dump(spec))
    sweep = sweeps.load(tmp_path / "tracked.yaml")
    untracked = sweeps.parse({**spec, "overrides": SHORT}, "tracked")
    assert [sweeps.config_digest(o) for _, o in sweep.jobs()] == [sweeps.config_digest(o) for _, o in
                                                                   untracked.jobs()]  # tracking changes no result
    sweeps.run(sweep, workers=1, progress=lambda *_: None)
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "store").as_uri())
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(o["run-name"] for _, o in sweep.jobs())
    assert sorted(r.data.params["lr"] for r in runs) == ["0.05", "0.1"]


def test_an_unknown_backend_or_one_not_installed_fails_at_start_naming_the_extra(monkeypatch):
    with pytest.raises(ConfigError, match="'tracking' = 'wandb'"):
        load_config({"tracking": "wandb"})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"hybridfl\[tracking\]"):
        load_config({"tracking": "mlflow"})
    load_config({"tracking": "tensorboard"})
