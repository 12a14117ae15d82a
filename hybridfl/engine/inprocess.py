"""The in-process engine: a Flower ``Grid`` that hands each ``Message`` to a ClientApp in this process.

It runs the real ServerApp and ClientApp objects with no SuperLink, no Ray and no threads, so a
run is deterministic and fast: tests and benchmarks use it. Each node has its own ``Context``
(``node_config`` with ``partition-id``/``num-partitions``, persistent ``state``), as in Flower's
runtimes. Pushed messages are executed lazily, when their replies are pulled.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from client_app.app import app as default_client_app
from common.cohort_step import release as release_cohort
from common.user_code import import_paths
from flower_internals.engine import Run, act_as_serverapp, empty_run
from hybridfl.engine.cohort import train_cohort
from server_app.app import RUN_STATE
from server_app.app import app as default_server_app
from server_app.config import load_config

Cohort = Callable[[list[Message], Mapping[int, Context]], Mapping[str, Message]]


class InProcessGrid(Grid):
    """A Grid over `num_nodes` in-process nodes running `client_app`.

    Args:
        client_app: the ClientApp every node runs.
        num_nodes: node i holds partition i of `num_nodes`.
        override_config: what ``run.override_config`` reports (the user's run-config overrides), and each node's
            ``run_config``: the keys the run started with, which declare the user code the nodes may run
            (client_app/declared.py), as Flower's runtimes fuse them (no app config table here).
        run_id: the run's id.
        node_config: more keys for every node's ``node_config`` (``latency-s``: a slow device).
        cohort: trains train messages together, replying to those it serves by message id
            (:func:`hybridfl.engine.cohort.train_cohort`); the rest go to `client_app` one by one. When a pull asks for
            a train message not yet trained, the cohort trains it with every other train message in flight not yet
            offered to it (up to `cohort_size`), and keeps their replies until they are pulled: an asynchronous
            run's pull asks for the few replies due at that step, while ten or more messages are in flight, each
            update a function of its message alone.
        cohort_size: at most this many messages in one cohort, besides those due (its memory: C copies of the
            parameters, their gradients and optimizer state, and each client's data).
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, override_config: Mapping[str, Any] | None = None,
                 run_id: int = 1, node_config: Mapping[str, Any] | None = None, cohort: Cohort | None = None,
                 cohort_size: int = 32) -> None:
        self.client_app = client_app
        self.cohort, self.cohort_size = cohort, cohort_size
        self._run = empty_run(run_id, override_config)
        # Messages take their sender from the process's task identity, as in Flower's ServerApp process.
        act_as_serverapp(run_id)
        # Node ids unrelated to partition ids, as in Flower's runtimes.
        ids = random.Random(run_id).sample(range(1, 2**31), num_nodes)
        self.contexts = {
            node: Context(run_id=run_id, node_id=node,
                          node_config={"partition-id": i, "num-partitions": num_nodes,
                                       "cache-dir": "",  # this process keeps every partition in memory
                                       **(node_config or {})},
                          state=RecordDict(), run_config=dict(self._run.override_config))
            for i, node in enumerate(ids)
        }
        self._pending: dict[str, Message] = {}
        self._offered: set[str] = set()  # pending messages the cohort has seen (those it serves: in _ahead)
        self._ahead: dict[str, Message] = {}  # replies trained ahead, by the id of the message they answer
        self._count = 0
        self._ran: set[int] = set()  # nodes whose ClientApp ran since the last checkpoint: their state may differ

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def disconnect(self, node: int) -> None:
        """Take `node` offline: it leaves the node list and its pending messages fail with NODE_UNAVAILABLE."""
        self.contexts.pop(node, None)

    def changed_node_states(self) -> dict[int, RecordDict]:
        """The states of the nodes whose ClientApp ran since the last call, by partition (server_app/node_state.py;
        the cohort never changes a state: it serves no client side that keeps one)."""
        changed = {int(c.node_config["partition-id"]): c.state for n, c in self.contexts.items() if n in self._ran}
        self._ran.clear()
        return changed

    def restore_node_states(self, states: Mapping[int, RecordDict]) -> None:
        for context in self.contexts.values():
            if (partition := int(context.node_config["partition-id"])) in states:
                context.state = states[partition]

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def get_nodes(self) -> Iterable[Any]:
        return []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            self._count += 1
            msg_id = f"in-process-{self._count}"
            msg.metadata.__dict__["_message_id"] = msg_id
            msg.metadata.__dict__["_run_id"] = self._run.run_id
            self._pending[msg_id] = msg
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        messages = [self._pending.pop(i) for i in message_ids if i in self._pending]
        if self.cohort is not None:
            self._train_in_flight(messages)
        return [self._reply(m) for m in messages]

    def _train_in_flight(self, due: list[Message]) -> None:
        """Train the due train messages the cohort has not seen with the in-flight ones it has not seen either."""
        def unseen(m: Message) -> bool:
            return m.metadata.message_type == MessageType.TRAIN and m.metadata.message_id not in self._offered

        now = [m for m in due if unseen(m)]
        if not now:
            return
        cohort = now + [m for m in self._pending.values() if unseen(m)][:max(0, self.cohort_size - len(now))]
        if len(cohort) > 1:
            self._offered.update(m.metadata.message_id for m in cohort)
            self._ahead.update(self.cohort(cohort, self.contexts))

    def _reply(self, msg: Message) -> Message:
        msg_id = msg.metadata.message_id
        self._offered.discard(msg_id)
        reply = self._ahead.pop(msg_id, None)
        if reply is None or msg.metadata.dst_node_id not in self.contexts:  # a node gone since: its error reply
            return self._execute(msg)
        return self._numbered(reply)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _execute(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        if node not in self.contexts:
            reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, f"node {node} is not connected"), reply_to=msg)
        else:
            self._ran.add(node)
            try:
                reply = self.client_app(msg, self.contexts[node])
            except Exception as err:  # noqa: BLE001 - as Flower's runtimes do: failures become error replies
                reply = Message(Error(ErrorCode.UNKNOWN, f"{type(err).__name__}: {err}"), reply_to=msg)
        return self._numbered(reply)

    def _numbered(self, reply: Message) -> Message:
        self._count += 1
        reply.metadata.__dict__["_message_id"] = f"in-process-{self._count}"
        return reply


def cohort_training(setting: str) -> bool:
    """Whether the in-process nodes train a pull's clients together: ``on``, ``off``, or ``auto`` — when the nodes
    (device ``auto``) train on CUDA, where it pays (BENCHMARKS, "Cohort training")."""
    if setting != "auto":
        return setting == "on"
    from common.devices import resolve_device

    return resolve_device("auto").type == "cuda"


def run_inprocess(overrides: Mapping[str, Any] | None = None, client_app: ClientApp | None = None,
                  server_app: ServerApp | None = None, grid: InProcessGrid | None = None) -> Path:
    """Run the ServerApp over in-process nodes with these run-config overrides; return the output folder.

    `client_app` (default: the project's) runs on every node; pass `grid` instead to control the nodes.
    """
    overrides = dict(overrides or {})
    cfg = load_config(overrides)
    cohort = None if client_app is not None or not cohort_training(cfg.cohort_training) else train_cohort
    grid = grid or InProcessGrid(client_app or default_client_app, cfg.num_clients, cohort=cohort,
                                 cohort_size=cfg.cohort_size)
    grid.run.override_config = overrides
    # The nodes' run_config: the keys the run started with; a resumed run's code keys again, as `hybridfl resume`
    # passes them (the checkpoint's values: the nodes cannot read it)
    run_config = {**(import_paths(cfg.to_dict()) if cfg.resume else {}), **overrides}
    for node in grid.contexts.values():
        node.run_config = dict(run_config)
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
    try:
        (server_app or default_server_app)(grid, context)
    finally:
        release_cohort()
    return Path(str(context.state[RUN_STATE]["output-dir"]))
