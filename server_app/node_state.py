"""The state of nodes that run in the server's own process, kept with the run's checkpoint.

A deployment's and a simulation's nodes keep their ``Context.state`` themselves, and a restart of the server finds
them as they were. The in-process engine's nodes are objects of the server's own process: without this, a killed
run's resume would start them afresh, and a method whose client side keeps state (topk's residual, the model a
model difference applies to, Ditto's personal model) would go on differently from the uninterrupted run. So at each
checkpoint the nodes that ran a message since the last one are written, each to a file of its own,
``<run>/nodes/<partition>-<round>.pt``; the checkpoint names each node's latest file (written before it, so a kill
between the two leaves the previous checkpoint with the files it names), and the files it no longer names are
removed after it. A node with an empty state has no file. Loaded with ``torch.load(weights_only=True)``: plain data
and tensors, nothing that runs code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import log

from server_app.checkpoint import save_whole

FOLDER = "nodes"


@runtime_checkable
class HoldsNodes(Protocol):
    """A grid whose nodes run in this process (hybridfl/engine/inprocess.py): their states are the run's to keep."""

    def changed_node_states(self) -> dict[int, RecordDict]:
        """The states of the nodes that ran a message since the last call, by partition id."""

    def restore_node_states(self, states: Mapping[int, RecordDict]) -> None:
        """Give the nodes of these partitions these states."""


def pack(state: RecordDict) -> dict[str, tuple[str, dict[str, Any]]]:
    """`state` as plain data: each record's kind and its items (an array as its dtype, shape, stype and its bytes as
    a uint8 tensor, which torch.save stores as they are: bytes themselves it pickled at 1.3-1.4x their size)."""
    packed: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, record in state.items():
        if isinstance(record, ArrayRecord):
            packed[name] = ("array", {k: (a.dtype, list(a.shape), a.stype, torch.frombuffer(bytearray(a.data),
                                                                                        dtype=torch.uint8))
                                      for k, a in record.items()})
        else:
            packed[name] = ("metric" if isinstance(record, MetricRecord) else "config", dict(record))
    return packed


def unpack(packed: Mapping[str, tuple[str, dict[str, Any]]]) -> RecordDict:
    """The RecordDict :func:`pack` made."""
    records: dict[str, Any] = {}
    for name, (kind, items) in packed.items():
        if kind == "array":
            records[name] = ArrayRecord({k: Array(dtype=d, shape=tuple(s), stype=t, data=b.numpy().tobytes())
                                         for k, (d, s, t, b) in items.items()})
        else:
            records[name] = (MetricRecord if kind == "metric" else ConfigRecord)(items)
    return RecordDict(records)


def save(grid: HoldsNodes, out: Path, rnd: int, files: Mapping[int, int]) -> dict[int, int]:
    """Write the states of the nodes that changed since the last save; return each node's latest file (partition ->
    round), `files` updated. Each written whole before the checkpoint names it."""
    latest = dict(files)
    for partition, state in grid.changed_node_states().items():
        if not len(state):
            latest.pop(partition, None)
            continue
        path = out / FOLDER / f"{partition}-{rnd}.pt"
        path.parent.mkdir(exist_ok=True)
        save_whole(path, pack(state))
        latest[partition] = rnd
    return latest


def prune(out: Path, files: Mapping[int, int]) -> None:
    """Remove the node files the checkpoint no longer names (a node's older ones, a killed write's)."""
    named = {f"{p}-{r}.pt" for p, r in files.items()}
    for path in (out / FOLDER).glob("*") if (out / FOLDER).is_dir() else ():
        if path.name not in named:
            path.unlink()


def load(grid: HoldsNodes, out: Path, files: Mapping[int, int]) -> None:
    """Give the grid's nodes the states the checkpoint names. A node whose file is missing or does not load (deleted
    for its disk, damaged) starts afresh, as a device that lost its state does, and the run goes on: the warning names
    it, and its method's client side says what it lost (topk's ``residual-lost``)."""
    states = {}
    for partition, rnd in files.items():
        path = out / FOLDER / f"{partition}-{rnd}.pt"
        try:
            states[partition] = unpack(torch.load(io.BytesIO(path.read_bytes()), weights_only=True))
        except (OSError, ValueError, RuntimeError, TypeError, KeyError, AttributeError, EOFError,
                pickle.UnpicklingError) as err:  # a file of another shape (damaged, or not pack's) as a missing one
            log(WARNING, "node %d's state %s does not load (%s: %s): it starts afresh, and the resumed run is not the "
                "uninterrupted one", partition, path, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    grid.restore_node_states(states)
