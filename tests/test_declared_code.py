"""Devices run only declared code (client_app/declared.py): a name a message carries by import path is imported only
when the run's configuration at its start or the node's ``allow-code`` declares it; anything else gets an error
reply naming the key, and nothing is imported."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from client_app.declared import check_message, guard
from common.errors import ConfigError
from common.user_code import UndeclaredCode, resolve
from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch.bundle import PROJECT_DIR

EXAMPLE = PROJECT_DIR / "examples" / "tabular"

# A Flower app of the test's own: hybridfl's ClientApp on the devices, and a ServerApp that sends the one node two
# train messages, the run's own and one whose data loader is `rogue:load` (a module of the app whose import writes
# a marker file), and writes what each reply said to the run folder's summary.json.
SERVER = '''
import json, time
from pathlib import Path

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from common.splits import data_spec, task_data
from common.models import build_from_config
from common.params import ParamSpec
from common.protocol import STRATEGY
from server_app.app import RUN_STATE, user_keys
from server_app.config import client_config, load_config
from server_app.wire import Dispatcher
from strategies.base import Payload

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config(user_keys(context.run_config, grid.run.override_config))
    full = task_data(data_spec(cfg))
    model = build_from_config(cfg.to_dict(), full.x.shape[1:], full.num_classes, seed=cfg.seed)
    spec = ParamSpec.of(model)
    deadline = time.monotonic() + 120
    while not (nodes := list(grid.get_node_ids())) and time.monotonic() < deadline:
        time.sleep(0.5)
    own = {**client_config(cfg), STRATEGY: "fedavg"}
    sent = {"declared": own, "undeclared": {**own, "dataset": "rogue:load"}}
    messages = [Dispatcher(spec, config, cfg.seed).message(nodes[0], Payload(spec.flatten(model)), 0, train_seed=1)
                for config in sent.values()]
    replies = {r.metadata.reply_to_message_id: r for r in grid.send_and_receive(messages, timeout=120)}
    said = {}
    for name, msg in zip(sent, messages):
        reply = replies[msg.metadata.message_id]
        said[name] = ({"error": reply.error.reason} if reply.has_error() else
                      {"num-examples": int(reply.content["metrics"]["num-examples"])})
    out = Path(cfg.output_dir) / cfg.run_name
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(said))
    context.state[RUN_STATE] = ConfigRecord({"output-dir": str(out)})  # where run_inprocess finds it
'''
TASK = '''
import math

from torch import nn


def tiny_net(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
'''
ROGUE = '''
import os
from pathlib import Path

Path(os.environ["ROGUE_MARKER"]).write_text("imported on a device")


def load(root):
    raise RuntimeError("never called")
'''
PYPROJECT = '''
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "gate"
version = "0.1.0"

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "gate"

[tool.flwr.app.components]
serverapp = "gate_server:app"
clientapp = "client_app.app:app"

[tool.flwr.app.config]
model = "gate_task:tiny_net"
dataset = "digits"
num-clients = 1
clients-per-round = 1
local-epochs = 1
output-dir = "outputs"
run-name = ""
'''
OWN = {"model": "gate_task:tiny_net", "dataset": "digits", "num-clients": 1, "clients-per-round": 1,
       "local-epochs": 1}


@pytest.fixture
def gate_app(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """The app's folder (importable here, as on the devices from its FAB) and the marker its rogue module writes when
    imported anywhere."""
    app = tmp_path / "app"
    app.mkdir()
    for name, text in (("gate_server.py", SERVER), ("gate_task.py", TASK), ("rogue.py", ROGUE),
                       ("pyproject.toml", PYPROJECT)):
        (app / name).write_text(text)
    marker = tmp_path / "rogue-ran"
    monkeypatch.setenv("ROGUE_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(app))
    yield app, marker
    for module in ("gate_server", "gate_task", "rogue"):
        sys.modules.pop(module, None)


def node(run_config: dict | None = None, **node_config) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1, **node_config},
                   state=RecordDict(), run_config=run_config or {})


def refused(config: dict, context: Context) -> str:
    with pytest.raises(UndeclaredCode) as info:
        check_message(config, context)
    return str(info.value)


def test_a_name_in_the_runs_configuration_passes_any_other_is_refused_naming_key_value_and_how_to_declare():
    context = node({"model": "mypkg.nets:make_net", "lr": 0.1})
    check_message({"model": "mypkg.nets:make_net", "lr": 0.1, "batch-size": 8}, context)
    why = refused({"model": "mypkg.nets:make_net", "dataset": "shutil:rmtree"}, context)
    assert "config key 'dataset' = 'shutil:rmtree'" in why and "nothing was imported" in why
    assert "--node-config 'allow-code=\"shutil:rmtree\"'" in why and "flwr run -c" in why
    # a name declared under another key is declared: the run named that code
    check_message({"dataset": "mypkg.nets:make_net"}, context)


def test_a_name_in_the_runs_method_options_passes():
    context = node({"method-options": "{ teacher = 'mypkg.nets:teacher', clip-norm = 0.1 }"})
    check_message({"teacher": "mypkg.nets:teacher"}, context)
    refused({"teacher": "mypkg.nets:other"}, context)


def test_the_names_of_a_users_preset_and_of_the_presets_it_builds_on_pass(monkeypatch):
    """tabular_task:presets/fedavgm names its method; the protocol it builds on names the loader and the model."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    context = node({"preset": "tabular_task:presets/fedavgm"})
    check_message({"strategy": "tabular_task.fedavgm:FedAvgM", "dataset": "tabular_task.task:breast_cancer",
                   "model": "tabular_task.task:mlp"}, context)
    refused({"model": "tabular_task.task:other"}, context)


def test_the_nodes_allow_list_passes_its_names_and_a_bad_entry_is_refused_naming_the_setting():
    context = node({}, **{"allow-code": "mypkg.nets:make_net, mypkg.data:load"})
    check_message({"model": "mypkg.nets:make_net", "dataset": "mypkg.data:load"}, context)
    refused({"model": "mypkg.nets:make"}, context)
    with pytest.raises(ConfigError, match="config key 'allow-code' = 'mypkg.nets' .*'mypkg.nets' is not one"):
        check_message({"model": "mypkg.nets:make_net"}, node({}, **{"allow-code": "mypkg.nets"}))


def test_registered_names_and_an_image_folder_always_pass():
    check_message({"strategy": "fedbuff", "model": "cnn", "dataset": "imagefolder:cats", "local-objective":
                   "proximal", "partitioner": "dirichlet"}, node())


def test_inside_a_handler_resolve_refuses_an_undeclared_name_whatever_path_reaches_it():
    """The guard under which the ClientApp runs its handlers: a code path that skipped the boundary check still
    imports nothing undeclared; outside it (the server) nothing changes."""
    with guard(node({"model": "json:dumps"})):
        assert resolve("model", "json:dumps", "a function") is json.dumps
        with pytest.raises(UndeclaredCode, match="config key 'dataset' = 'json:loads'"):
            resolve("dataset", "json:loads", "a function")
    assert resolve("dataset", "json:loads", "a function") is json.loads


def test_in_process_the_nodes_run_config_is_the_runs_keys(tmp_path, gate_app):
    """The in-process engine's nodes: the run's keys declare its model; the rogue loader is refused, not imported."""
    _, marker = gate_app
    from gate_server import app

    out = run_inprocess({**OWN, "output-dir": str(tmp_path / "out"), "run-name": "gate"}, server_app=app)
    said = json.loads((out / "summary.json").read_text())
    assert said["declared"]["num-examples"] > 0
    assert "config key 'dataset' = 'rogue:load'" in said["undeclared"]["error"]
    assert "allow-code" in said["undeclared"]["error"]
    assert not marker.exists() and "rogue" not in sys.modules


def test_a_resumed_run_gives_the_checkpoints_code_again(tmp_path, monkeypatch):
    """What a resumed run's launchers pass Flower (hybridfl/launch/job.py ``prepare``: ``hybridfl resume``, ``hybridfl
    run resume=...``, ``make demo ARGS='resume=...'`` in simulation and deployment): the checkpoint's import paths as
    keys of the run (its devices see them declared), the user's keys after them."""
    from hybridfl.launch.job import prepare

    monkeypatch.syspath_prepend(str(EXAMPLE))
    run = run_inprocess({"preset": "tabular_task:presets/fedavgm", "num-rounds": 1, "output-dir": str(tmp_path),
                         "run-name": "short"})
    overrides, folder, _ = prepare({"resume": str(run), "num-rounds": 2})
    assert folder == run
    assert overrides == {"model": "tabular_task.task:mlp", "dataset": "tabular_task.task:breast_cancer",
                         "strategy": "tabular_task.fedavgm:FedAvgM", "num-rounds": 2, "resume": str(run)}
    # and the in-process engine's nodes get them too
    resumed = run_inprocess({"resume": str(run), "num-rounds": 2})
    assert json.loads((resumed / "summary.json").read_text())["total-failures"] == 0


@pytest.mark.e2e
def test_a_deployed_device_answers_an_undeclared_name_with_an_error_and_serves_the_runs_own(tmp_path, gate_app):
    """A real local deployment (hybridfl/launch/deploy_local.py) of the test's app: the device refuses the message that
    names `rogue:load`, naming the key (the rogue module, in the app's FAB on the device, was never imported), and
    trains on the one that names the run's declared model."""
    from hybridfl.launch.deploy_local import deploy_runs

    app, marker = gate_app
    (out,), _ = deploy_runs([{"output-dir": str(tmp_path / "out"), "run-name": "gate"}], tmp_path / "flwr-home",
                            app_dir=app, node_config=f'cache-dir="{tmp_path / "cache"}"')
    said = json.loads((out / "summary.json").read_text())
    assert said["declared"]["num-examples"] > 0
    assert "config key 'dataset' = 'rogue:load'" in said["undeclared"]["error"]
    assert not marker.exists()
    logs = "".join(p.read_text() for p in (out / "flower-logs").glob("*.log"))
    assert "refused: config key 'dataset' = 'rogue:load'" in logs
