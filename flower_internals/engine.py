"""What the in-process engine (hybridfl/engine/inprocess.py) needs of Flower that its public API does not give: the
``Run`` record a Grid reports, and the sender Flower's ServerApp process gives every message it makes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

# Flower internals this module relies on (checked by tests/test_flower_internals.py)
RELIES_ON = ("flwr.supercore.run:Run.create_empty", "flwr.supercore.task_identity:TaskIdentity.task_id",
             "flwr.supercore.task_identity:TaskIdentity.run_id", "flwr.supercore.task_identity:TaskIdentity.node_id",
             "flwr.common.constant:SUPERLINK_NODE_ID")

__all__ = ["Run", "act_as_serverapp", "empty_run"]


def empty_run(run_id: int, override_config: Mapping[str, Any] | None = None) -> Run:
    """Flower's record of run `run_id`, its run-config overrides `override_config`, nothing else filled in."""
    run = Run.create_empty(run_id)
    run.override_config = dict(override_config or {})
    return run


def act_as_serverapp(run_id: int) -> None:
    """Make the messages this process creates carry the sender Flower's ServerApp process gives them (task 1 of run
    `run_id`, the SuperLink's node), as the in-process engine's ServerApp runs here with no SuperLink."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
