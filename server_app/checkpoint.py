"""``<run>/checkpoint.pt``: everything a killed run needs to go on as if it had never stopped.

It holds the round it was written after, the run's configuration, the model layout, the strategy's
whole state, the runner's (its random generators, the dispatches in flight with the payloads they
carry, each client's dispatch count), the recorder's position in metrics.jsonl / events.jsonl and
torch's global generator. It is written atomically (a temporary file, then a rename), so a kill
leaves the previous checkpoint or the new one, never half of one.

Loading runs no code from the file: ``torch.load(weights_only=True)`` rebuilds tensors and plain data and
only the classes of :data:`ALLOWED`, and refuses anything else (a crafted file's callable) before calling it.
Those few objects stay objects under an allow-list, not converted to plain data and back, because a strategy's
state is every attribute it has (``Strategy.state_dict``): the allow-list is one line, converters would be one
per type in the runner and the strategies, and the files keep their format.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.config import ConfigError
from strategies.base import Payload, Update

CHECKPOINT = "checkpoint.pt"
FORMAT = 2  # 2: the runtime's tick is a round (issue 50): "round", and the flights' dispatch and due rounds
# The classes a checkpoint holds besides tensors and plain data: the payloads of the flights in the air (runner),
# the updates of a part-full buffer (FedBuff) and Feddle's out-of-domain head (an nn.Linear)
ALLOWED = (Payload, Update, nn.Linear)
_cache: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}  # path -> ((mtime, size), checkpoint)


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
    try:
        with torch.serialization.safe_globals(list(ALLOWED)):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # torch's message wraps the unpickler's (which names what it refused)
        inner = str(err.__context__ or err)
        refused = re.search(r"GLOBAL ([\w.]+)", inner)
        if refused is None:
            raise _bad(folder, f"{CHECKPOINT} is unreadable, corrupt or truncated ({inner})") from None
        raise _bad(folder, f"{CHECKPOINT} would load {refused.group(1)!r}, which no hybridfl checkpoint holds: "
                           "refused without running anything (a checkpoint holds tensors, plain data and "
                           f"{', '.join(c.__name__ for c in ALLOWED)})") from None
    except Exception as err:
        raise _bad(folder, f"{CHECKPOINT} is unreadable, corrupt or truncated ({type(err).__name__}: {err})") from err
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


def write_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    """Write `state` (plus the format tag) to ``folder/checkpoint.pt`` atomically; return the path."""
    path = Path(folder) / CHECKPOINT
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def check_layout(folder: Path, state: dict[str, Any], names: tuple[str, ...],
                 shapes: tuple[tuple[int, ...], ...]) -> None:
    """The checkpoint's model layout must be this run's (the same trainable tensors, shapes and order)."""
    saved = list(zip(state["layout"]["names"], map(tuple, state["layout"]["shapes"])))
    here = list(zip(names, shapes))
    if saved != here:
        differ = sorted({n for n, s in set(saved) ^ set(here)}) or ["(their order)"]
        raise _bad(folder, f"its model differs from this run's ({len(saved)} trainable tensors there, {len(here)} "
                           f"here; differing: {', '.join(differ[:3])})")
