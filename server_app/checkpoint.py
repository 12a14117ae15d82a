"""``<run>/checkpoint.pt``: everything a killed run needs to go on as if it had never stopped.

It holds the round it was written after, the run's configuration, the model layout, the strategy's
whole state, the runner's (its random generators, the dispatches in flight with the payloads they
carry, each client's dispatch count), the recorder's position in metrics.jsonl / events.jsonl and
torch's global generator, and, where the nodes run in this process, which file of ``<run>/nodes/`` holds each
node's state (server_app/node_state.py). It is written atomically (a temporary file, then a rename), so a kill
leaves the previous checkpoint or the new one, never half of one.

Loading runs no code from the file: ``torch.load(weights_only=True)`` rebuilds tensors and plain data and
only the classes of :data:`ALLOWED`, and refuses anything else (a crafted file's callable) before calling it.
Those few objects stay objects under an allow-list, not converted to plain data and back, because a strategy's
state is every attribute it has (``Strategy.state_dict``): the allow-list is one line, converters would be one
per type in the runner and the strategies, and the files keep their format. The strategy's state is nested as
bytes of its own (:func:`pack_state`): the configuration read first names the strategy, whose
``checkpoint_types`` join the allow-list for its state alone; a state holding any other class is refused when it
is saved (at the run's start, and at every checkpoint), naming the field, rather than when it is resumed.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.config import ConfigError
from strategies.base import Payload, Update, strategy_class

CHECKPOINT = "checkpoint.pt"
# 2: the runtime's tick is a round (issue 50); 3: the strategy's state nested as bytes, loaded with its declared
# types (issue 58)
FORMAT = 3
# The classes a checkpoint holds besides tensors and plain data: the payloads of the flights in the air (runner),
# the updates of a part-full buffer (FedBuff) and Feddle's out-of-domain head (an nn.Linear)
ALLOWED = (Payload, Update, nn.Linear)
_cache: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}  # path -> ((mtime, size), checkpoint)


def _global_name(obj: Any) -> str:
    """How a pickle names a class or function (``module.name``), as torch's weights-only loader lists it."""
    return f"{obj.__module__}.{obj.__name__}"


def _unsafe(data: bytes, allowed: tuple[Any, ...]) -> set[str]:
    """The classes and functions a pickled `data` would rebuild beyond torch's own, ALLOWED and `allowed`."""
    found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    return set(found) - {_global_name(c) for c in (*ALLOWED, *allowed)}


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _round_trip(data: bytes, allowed: tuple[Any, ...]) -> str | None:
    """Why `data` would not load back under the checkpoint's rules, or None if it does."""
    if unsafe := _unsafe(data, allowed):
        return f"holds {', '.join(sorted(unsafe))}, which a checkpoint loads only if checkpoint_types declares it"
    try:
        with torch.serialization.safe_globals([*ALLOWED, *allowed]):
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever the loader refuses (a deque: "Can only append to lists")
        inner = err.__context__ or err  # torch wraps the unpickler's own message in a page of advice
        return f"does not load back under torch's weights-only loader ({type(inner).__name__}: {inner})"
    return None


def pack_state(state: dict[str, Any], owner: type) -> bytes:
    """A strategy's state (``owner``: its class) as the bytes a checkpoint holds, checked to load back; a TypeError
    naming the first field that does not (a class neither tensors and plain data, ALLOWED, nor
    ``owner.checkpoint_types``; or a container torch's weights-only loader cannot rebuild, such as a deque)."""
    data = _saved(state)
    if _round_trip(data, owner.checkpoint_types):
        for name, value in state.items():
            if why := _round_trip(_saved(value), owner.checkpoint_types):
                raise TypeError(f"{owner.__name__}'s state cannot round-trip through a checkpoint: its field "
                                f"{name!r} ({type(value).__module__}.{type(value).__qualname__}) {why}; declare the "
                                f"class in {owner.__name__}.checkpoint_types, or keep the field as tensors and plain "
                                "data (docs/adding-a-method.md, \"State and checkpoints\")")
    return data


def unpack_state(data: bytes, owner: type, folder: Path) -> dict[str, Any]:
    """The strategy state :func:`pack_state` made, loaded with ``owner.checkpoint_types`` allowed and nothing else
    (a ConfigError on ``resume`` naming anything more, before it runs)."""
    return _weights_only(io.BytesIO(data), folder, (*ALLOWED, *owner.checkpoint_types))


def _weights_only(source: Any, folder: Path, allowed: tuple[Any, ...] = ALLOWED) -> Any:
    """``torch.load(weights_only=True)`` of `source` with `allowed` rebuilt by name, or a ConfigError on
    ``resume`` saying why not (what it refused, or that the file is damaged)."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # torch's message wraps the unpickler's (which names what it refused)
        inner = str(err.__context__ or err)
        refused = re.search(r"GLOBAL ([\w.]+)", inner)
        if refused is None:
            raise _bad(folder, f"{CHECKPOINT} is unreadable, corrupt or truncated ({inner})") from None
        raise _bad(folder, f"{CHECKPOINT} would load {refused.group(1)!r}, which no hybridfl checkpoint holds: "
                           "refused without running anything (a checkpoint holds tensors, plain data, "
                           f"{', '.join(c.__name__ for c in ALLOWED)} and the strategy's declared "
                           "checkpoint_types)") from None
    except Exception as err:
        raise _bad(folder, f"{CHECKPOINT} is unreadable, corrupt or truncated ({type(err).__name__}: {err})") from err


def _bad(folder: Path, why: str) -> ConfigError:
    return ConfigError("resume", str(folder), "a run folder whose checkpoint.pt can be resumed",
                       f"cannot resume {folder}: {why}")


def _load(folder: Path) -> tuple[tuple[int, int], dict[str, Any]]:
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        raise _bad(folder, f"it has no {CHECKPOINT} (is it a run folder? was checkpoint-every 0?)")
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _cache.get(str(path))
    if cached and cached[0] == stamp:
        return cached
    state = _weights_only(path, folder)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = "a " + type(state).__name__ if not isinstance(state, dict) else \
            f"format {state['format']!r}" if "format" in state else "a dict without a format tag"
        raise _bad(folder, f"{CHECKPOINT} is not a hybridfl checkpoint of format {FORMAT} (found {found})")
    return stamp, state


def read_config(folder: Path) -> dict[str, Any]:
    """The configuration (every key) the run in `folder` was written with. The checkpoint stays cached
    for the :func:`read_checkpoint` that restores the run (a ServerApp reads both)."""
    stamp, state = _load(folder)
    _cache.clear()
    _cache[str(Path(folder) / CHECKPOINT)] = (stamp, state)
    return dict(state["config"])


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """The checkpoint of run folder `folder`, or a ConfigError (key ``resume``) saying why it cannot be used.
    It leaves the cache: a restored run should not hold the checkpoint in memory a second time."""
    _, state = _load(folder)
    _cache.pop(str(Path(folder) / CHECKPOINT), None)
    return state


def read_strategy_state(folder: Path) -> dict[str, Any]:
    """The strategy's state in run `folder`'s checkpoint, as its strategy (the configuration names it) loads it: to
    look inside a run (its per-client models, its buffers) without resuming it."""
    state = read_checkpoint(folder)
    return unpack_state(state["strategy"], strategy_class(state["config"]["strategy"]), Path(folder))


def write_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    """Write `state` (plus the format tag) to ``folder/checkpoint.pt`` atomically; return the path."""
    path = Path(folder) / CHECKPOINT
    save_whole(path, {"format": FORMAT, **state})
    return path


def save_whole(path: Path, obj: Any) -> None:
    """``torch.save`` `obj` to `path` whole or not at all: a temporary file, fsynced, then renamed."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_layout(folder: Path, state: dict[str, Any], names: tuple[str, ...],
                 shapes: tuple[tuple[int, ...], ...]) -> None:
    """The checkpoint's model layout must be this run's (the same trainable tensors, shapes and order)."""
    saved = list(zip(state["layout"]["names"], map(tuple, state["layout"]["shapes"])))
    here = list(zip(names, shapes))
    if saved != here:
        differ = sorted({n for n, s in set(saved) ^ set(here)}) or ["(their order)"]
        raise _bad(folder, f"its model differs from this run's ({len(saved)} trainable tensors there, {len(here)} "
                           f"here; differing: {', '.join(differ[:3])})")
