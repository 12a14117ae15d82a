"""A user's own model and data by import path, and examples/tabular, the project that uses hybridfl as a library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from helpers import readme_commands

from common.config import ConfigError
from common.models import build_from_config
from common.splits import load_dataset
from hybridfl.engine.inprocess import InProcessGrid, run_inprocess
from hybridfl.launch.bundle import PROJECT_DIR, app_config
from server_app.config import load_config

EXAMPLE = PROJECT_DIR / "examples" / "tabular"


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch):
    """The example's package importable, as it is where its Flower app runs (and a test module for bad code)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


# What a user might get wrong, for the error tests (imported as tests/test_user_task.py's own module).
def not_a_module(input_shape, num_classes):
    return "a string"


def frozen_only(input_shape, num_classes):
    return torch.nn.Linear(input_shape[0], num_classes).requires_grad_(False)


def five_outputs(input_shape, num_classes):
    return torch.nn.Linear(input_shape[0], 5)


def wrong_width(input_shape, num_classes):
    return torch.nn.Linear(7, num_classes)


def three_things(root):
    return np.zeros((4, 2), np.float32), np.zeros(4, np.int64), 2


def float_labels(root):
    return np.zeros((4, 2), np.float32), np.zeros(4, np.float32)


@pytest.mark.parametrize("name", ["common", "strategies"])
def test_a_users_package_named_as_one_of_hybridfls_is_refused_naming_the_clash(tmp_path, monkeypatch, name):
    """A user's own `common/` cannot be imported (hybridfl's comes first on every path): the error says so, instead
    of the import failing inside hybridfl's package."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "nets.py").write_text("def mlp(input_shape, num_classes):\n    raise AssertionError\n")
    monkeypatch.setenv("HYBRIDFL_USER_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=f"'{name}' in {tmp_path} has the name of hybridfl's package '{name}'"):
        build_from_config({**load_config({}).to_dict(), "model": f"{name}.nets:mlp"}, (1, 8, 8), 10, seed=0)
    (tmp_path / "clash_free_net.py").write_text("import torch\n\ndef mlp(input_shape, num_classes):\n"
                                                "    return torch.nn.Linear(64, num_classes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # beside it, a module of another name is the user's own
    monkeypatch.delitem(sys.modules, "clash_free_net", raising=False)  # imported below, forgotten after the test
    model = {**load_config({}).to_dict(), "model": "clash_free_net:mlp"}
    assert build_from_config(model, (64,), 10, seed=0).out_features == 10


def test_a_user_loader_and_factory_give_the_data_and_model_the_contract_says():
    data = load_dataset("tabular_task.task:breast_cancer")
    assert data.x.shape == (569, 30) and data.x.dtype == np.float32 and data.num_classes == 2
    cfg = load_config({"preset": "tabular_task:presets/fedavg"})
    a = build_from_config(cfg.to_dict(), data.x.shape[1:], 2, seed=3)
    b = build_from_config(cfg.to_dict(), data.x.shape[1:], 2, seed=3)
    c = build_from_config(cfg.to_dict(), data.x.shape[1:], 2, seed=4)
    assert a(torch.from_numpy(data.x[:5])).shape == (5, 2)  # tabular inputs as they are: no image adapter
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # the run's seed fixes it
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert [n for n, _ in a.named_parameters()][-2:] == ["head.weight", "head.bias"]


@pytest.mark.parametrize("key,value,message", [
    ("model", "no_such_package.nets:make", r"'model' = 'no_such_package.nets:make'.*importable as 'no_such_package"
                                          r".nets' .*must be installed where the run's ServerApp and ClientApps run"),
    ("model", "tabular_task.task:missing", r"module 'tabular_task.task' has no 'missing'"),
    ("model", "tabular_task.task:np", r"a callable; 'tabular_task.task:np' is a module"),
    ("dataset", "no_such_package:load", r"'dataset' = 'no_such_package:load'.*a data loader 'module:function'"),
    ("model", "not a path", r"'model' = 'not a path' is not allowed: expected one of 'cnn'.*or your own model"),
    ("preset", "tabular_task:presets/none", r"'preset' = 'tabular_task:presets/none'.*your own 'package:path'"),
])
def test_an_import_path_that_does_not_resolve_fails_at_start_naming_key_value_and_why(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"preset": "tabular_task:presets/fedavg", key: value})


@pytest.mark.parametrize("key,value,message", [
    ("model", "test_user_task:not_a_module", "returning a torch.nn.Module; it returned a str"),
    ("model", "test_user_task:frozen_only", "a module with trainable parameters"),
    ("dataset", "test_user_task:three_things", "returning an ArrayDataset or \\(x, y\\) arrays; it returned a tuple"),
    ("dataset", "test_user_task:float_labels", "integer labels 0..K-1; got float32"),
    ("model", "cnn", r"'model' = 'cnn'.*for inputs of shape \(30,\): the built-in models take images"),
    ("model", "test_user_task:five_outputs", r"one score per class: \(4, 2\) for 4 samples of 2 classes; it "
                                             r"returned \(4, 5\)"),
    ("model", "test_user_task:wrong_width", r"takes this data's inputs; on a batch of shape \(4, 30\) it raised "
                                            r"RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("model", "torch.nn:Linear", r"a model factory called as factory\(input_shape, num_classes\) -> torch.nn.Module; "
                                 r"factory\(\(30,\), 2\) raised TypeError"),
])
def test_a_factory_or_loader_that_returns_the_wrong_thing_fails_naming_what_was_expected(tmp_path, key, value,
                                                                                         message):
    """Each at start, on the server, before any client is asked: the model is built and run on 4 samples."""
    with pytest.raises(ConfigError, match=message):
        run_inprocess({"preset": "tabular_task:presets/fedavg", key: value, "output-dir": str(tmp_path)})


@pytest.mark.parametrize("preset,floor", [("fedavg", 0.9), ("fedbuff", 0.9), ("feddle-id", 0.9), ("fedmerge", 0.9)])
def test_the_example_projects_presets_learn_in_process(tmp_path, preset, floor):
    out = run_inprocess({"preset": f"tabular_task:presets/{preset}", "output-dir": str(tmp_path), "run-name": preset})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["dataset"] == "tabular_task.task:breast_cancer"
    assert summary["total-failures"] == 0 and summary["best-test-accuracy"] >= floor


def test_a_holdout_of_a_few_samples_per_client_is_flagged_at_start(tmp_path, flower_log):
    """The example's FedMerge protocol holds out 20 % of partitions of ~85 samples: 8 test samples for one client,
    whose personalised accuracy moves in steps of 12.5 points: said at start, before the plots."""
    run_inprocess({"preset": "tabular_task:presets/fedmerge", "num-rounds": 1, "output-dir": str(tmp_path)})
    assert any("client-test-fraction 0.2 leaves a client 8 test samples" in m and "steps of 12 points" in m
               for m in flower_log)


def test_a_users_own_serverapp_trains_with_a_hybridfl_strategy_through_flower_start():
    from client_app.app import app as client_app
    from tabular_task.own_server import app

    # the nodes' run_config is the example's config table, as under `flwr run`: its preset declares the task's code
    grid = InProcessGrid(client_app, 4, override_config=app_config(EXAMPLE))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    app(grid, context)
    result = context.state["result"]
    assert result["rounds"] == 12 and result["accuracy"] >= 0.9  # the example's protocol


def test_the_apps_own_config_table_counts_and_hybridfls_defaults_do_not():
    from server_app.app import user_keys

    defaults = {"lr": 0.05, "num-rounds": 20}  # hybridfl's defaults: its own pyproject lists every key so
    assert user_keys(defaults, {}) == {}
    assert user_keys({**defaults, "preset": "tabular_task:presets/fedmerge"}, {"lr": 0.1}) == {
        "preset": "tabular_task:presets/fedmerge", "lr": 0.1}
    # The example's table declares its own method's keys at their defaults: they count once set, for that method
    table = {**defaults, "preset": "tabular_task:presets/fedavgm", "server-momentum": 0.9, "clip-norm": 0.0}
    assert user_keys(table, {}) == {"preset": "tabular_task:presets/fedavgm"}  # the preset's 0.5 stands
    assert user_keys({**table, "clip-norm": 0.3}, {"server-momentum": 0.7}) == {
        "preset": "tabular_task:presets/fedavgm", "clip-norm": 0.3, "server-momentum": 0.7}
    assert user_keys({**table, "preset": "tabular_task:presets/fedavg", "clip-norm": 0.3}, {}) == {
        "preset": "tabular_task:presets/fedavg"}  # FedAvg has no clip-norm: the declaration is not its


def test_a_users_method_keys_pass_flower_run_c_packed_unless_the_app_declares_them():
    """Flower's `flwr run -c` refuses keys the app does not declare: hybridfl's own app carries a user's method keys
    in `method-options`; the example app declares its method's keys; a key neither can carry is refused by name."""
    from hybridfl.launch.flwr_cli import run_config_arg

    assert run_config_arg({"preset": "x", "clip-norm": 0.1, "server-momentum": 0.5}) == (
        'preset="x" method-options="{ clip-norm = 0.1, server-momentum = 0.5 }"')
    assert run_config_arg({"clip-norm": 0.1, "preset": "x"}, EXAMPLE) == 'clip-norm=0.1 preset="x"'
    with pytest.raises(ConfigError, match=r"'lr' = 0.1 .*declares in \[tool.flwr.app.config\]"):
        run_config_arg({"lr": 0.1}, EXAMPLE)
    cfg = load_config({"preset": "tabular_task:presets/fedavgm", "method-options": "{ clip-norm = 0.1 }"})
    assert cfg.options["clip-norm"] == 0.1 and cfg.options["server-momentum"] == 0.5
    with pytest.raises(ConfigError, match="method-options.*not also given on their own \\(clip-norm\\)"):
        load_config({"preset": "tabular_task:presets/fedavgm", "method-options": "{ clip-norm = 0.1 }",
                     "clip-norm": 0.2})
    with pytest.raises(ConfigError, match="method-options.*a TOML inline table"):
        load_config({"method-options": "clip-norm"})


@pytest.mark.e2e
def test_the_example_readmes_commands_run_as_written(tmp_path):
    """Each command of examples/tabular/README.md, as a user runs it in a copy of the folder: it exits 0 and its run
    completed (Flower's `flwr run` exits 0 either way: its run's summary says). The local SuperLink `flwr run`
    starts is stopped here, by its port."""
    import shlex
    import shutil

    from hybridfl.launch.processes import flower_env, free_port

    project = tmp_path / "tabular"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("outputs", "__pycache__", ".flwr*"))
    env = {**flower_env(tmp_path / "flwr-home"), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    commands = readme_commands(project / "README.md")
    assert [c.split()[:2] for c in commands] == [["hybridfl", "run"]] * 4 + [["hybridfl", "options"], ["flwr", "run"]]
    try:
        for command in commands:
            done = subprocess.run(shlex.split(command), cwd=project, env=env, capture_output=True, text=True,
                                  timeout=1200)
            assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    finally:
        port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
        subprocess.run(["pkill", "-f", f"flower-superlink .*--port {port}"], check=False)
    runs = sorted((project / "outputs").iterdir())
    assert len(runs) == 5  # the four `hybridfl run`s and Flower's
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["total-failures"] == 0 and summary["best-test-accuracy"] >= 0.9, run.name
    # the project's own method ran in-process, on Flower's simulation and on a deployment: every step of each has
    # the server's momentum and the norm that the method's own client side (ClippingClient) reported from the nodes
    own = [r for r in runs if json.loads((r / "summary.json").read_text())["config"]["strategy"]
           == "tabular_task.fedavgm:FedAvgM"]
    assert len(own) == 3
    for run in own:
        steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "momentum-norm" in r]
        assert steps and all(r["train-delta-norm"] > 0 for r in steps), run.name


def test_hybridfls_apps_are_flower_components_as_they_are(tmp_path):
    """Flower's own check of a component reference (its static read of the module) accepts hybridfl's apps named
    directly, and a user's module that re-exports one with `__all__`; a bare re-export is the case Flower refuses
    (README says so)."""
    from flwr.supercore.object_ref import validate

    assert validate("server_app.app:app", project_dir=PROJECT_DIR) == (True, None)
    assert validate("client_app.app:app", project_dir=PROJECT_DIR) == (True, None)
    (tmp_path / "mine.py").write_text("from server_app.app import app\n\n__all__ = [\"app\"]\n")
    (tmp_path / "bare.py").write_text("from server_app.app import app\n")
    assert validate("mine:app", project_dir=tmp_path) == (True, None)
    ok, why = validate("bare:app", project_dir=tmp_path)
    assert not ok and "Unable to find attribute app" in why
