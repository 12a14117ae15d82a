"""The ServerApp: builds the run from its configuration (``server_app.run``), drives it, writes the outputs.

The configuration is ``configs/<preset>.yaml`` (or a user's ``package:path`` preset) overlaid with exactly the
keys the user set (:func:`user_keys`: ``flwr run -c``, which Flower hands over as ``grid.run.override_config``, and
a user's Flower app's own config table); with ``resume`` it is the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from server_app.config import RunConfig, load_config, option_specs
from server_app.presets import read_preset
from server_app.run import build_run

app = ServerApp()
RUN_STATE = "hybridfl-run"  # ConfigRecord left in the ServerApp's context.state: {"output-dir": ...}


def user_keys(run_config: Mapping[str, Any], override_config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys the user set: those passed with ``flwr run -c``, and those of the Flower app's own
    ``[tool.flwr.app.config]`` that differ from their defaults (a user's project names its preset there; hybridfl's
    own table lists every key at its default, so none of its keys count). A key of the app's table that hybridfl does
    not know is a user's own method's, declared so that ``-c`` may set it: it counts when the run's method declares
    it and it differs from that method's default."""
    defaults = {k: spec.default for k, spec in {**RunConfig.specs(), **option_specs()}.items()}
    own = {k: v for k, v in run_config.items() if k in defaults and v != defaults[k]}
    given = {**own, **override_config}
    theirs = {k: v for k, v in run_config.items() if k not in defaults and k not in given}
    if theirs and not given.get("resume"):
        preset = given.get("preset", RunConfig.preset)
        method = option_specs(str(given.get("strategy") or read_preset(preset).get("strategy", RunConfig.strategy)))
        given = {**{k: v for k, v in theirs.items() if k in method and v != method[k].default}, **given}
    return given


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = build_run(grid, load_config(user_keys(context.run_config, grid.run.override_config)))
    context.state[RUN_STATE] = ConfigRecord({"output-dir": str(run.out)})
    run.execute()
