"""A SuperNode that asks for its next message soon after it answers: Flower's SuperNode with its two fixed waits paced.

    python -m client_app.supernode [--idle-wait-s S] [--heartbeat-s H] [flower-supernode's flags]

Flower 1.42's SuperNode loop (``flwr/supernode/start_client_internal.py``) asks the SuperLink for one message, waits
for its ClientApp's reply checking every 0.5 s, pushes it, asks again, and **sleeps 3 s whenever nothing is waiting**.
Right after a reply the server sends the node its next message within a fraction of a second (the asynchronous
runtime refills the freed slot at once; a synchronous round's next message follows its last reply), but by then the
node has asked, found nothing, and gone to sleep for 3 s: on `benchmarks/deploy_overhead.py` that sleep was most
of the 3.5 s per update that stayed outside the training with the warm executor.

This is Flower's own ``flower-supernode`` (its command line, connection, authentication and message handling) with
the two waits paced:

- after each reply it pushes, the idle wait starts at ``FIRST_WAIT_S`` and doubles up to Flower's 3 s: a node asks
  about seven more times in the 3 s after a reply, then as Flower's does; a node without work costs the SuperLink
  what it costs under Flower; ``--idle-wait-s S`` makes that ceiling S (a large fleet's idle asks are most of its
  SuperLink's load: docs/how-to/sizing.md);
- ``--heartbeat-s H`` declares a heartbeat interval of H seconds instead of Flower's 30 (the SuperLink accepts
  10 to 1800 and deactivates a node after two intervals without one): Flower's node beats every 17.5-22.5 s, so
  a thousand idle nodes send the SuperLink 50 heartbeats a second, in the one loop where the ServerApp's own
  heartbeat waits (docs/how-to/sizing.md); its cost: a vanished node is noticed after 2 H instead of 60 s;
- the check for its own ClientApp's reply (a read of the node's in-memory state, no network) runs every
  ``LOCAL_CHECK_S`` instead of 0.5 s.

This hides the poll for every strategy, synchronous rounds too, and adds no staleness; sending each node a second
message ahead (the issue's first idea) would hide it only for asynchronous strategies, each such update one model
version staler. What it uses of Flower is checked when it starts (:func:`pace`) and pinned by
``tests/test_warm_executor.py``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from types import ModuleType
from typing import Any

import flwr

IDLE_WAIT_S = 3.0  # Flower's wait when nothing is waiting: the pacing's ceiling
REPLY_CHECK_S = 0.5  # Flower's wait between checks for the ClientApp's reply
FIRST_WAIT_S = 0.05
LOCAL_CHECK_S = 0.02
LOOP = "flwr.supernode.start_client_internal"
# where Flower 1.42's SuperNode reads its heartbeat interval: the interval it declares (ActivateNode, each
# SendNodeHeartbeat) and the sender's wait between beats
HEARTBEAT_MODULES = ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")
HEARTBEAT_NAME = "HEARTBEAT_DEFAULT_INTERVAL"


class Pacer:
    """Stands in for the loop module's ``time``: its two fixed sleeps paced, everything else the real module."""

    def __init__(self, first_wait_s: float = FIRST_WAIT_S, local_check_s: float = LOCAL_CHECK_S,
                 idle_wait_s: float = IDLE_WAIT_S) -> None:
        self.first_wait_s, self.local_check_s, self.idle_wait_s = first_wait_s, local_check_s, idle_wait_s
        self.next_wait_s = idle_wait_s

    def replied(self) -> None:
        self.next_wait_s = self.first_wait_s

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_WAIT_S:
            seconds, self.next_wait_s = self.next_wait_s, min(2 * self.next_wait_s, self.idle_wait_s)
        elif seconds == REPLY_CHECK_S:
            seconds = self.local_check_s
        time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def pace(loop: ModuleType, pacer: Pacer) -> None:
    """Put `pacer` in place of `loop`'s ``time`` and tell it of every reply pushed; raise, naming what moved, if
    `loop` is not the SuperNode loop this was written against (Flower 1.42)."""
    source = inspect.getsource(loop)
    for needle in (f"time.sleep({IDLE_WAIT_S:g})", f"time.sleep({REPLY_CHECK_S:g})", "_push_messages(", "import time"):
        if needle not in source:
            raise RuntimeError(f"flwr {flwr.__version__}: {loop.__name__} has no `{needle}`; client_app/supernode.py "
                               "paces Flower 1.42's SuperNode loop: run Flower's own flower-supernode instead")
    push = loop._push_messages

    def push_and_pace(*args: Any, **kwargs: Any) -> None:
        push(*args, **kwargs)
        pacer.replied()

    loop._push_messages = push_and_pace
    loop.time = pacer


def check_heartbeat(interval_s: float) -> None:
    """Raise ValueError, naming the range, if Flower's SuperLink would refuse `interval_s`."""
    from flwr.common.constant import HEARTBEAT_MAX_INTERVAL, HEARTBEAT_MIN_INTERVAL

    if not HEARTBEAT_MIN_INTERVAL <= interval_s <= HEARTBEAT_MAX_INTERVAL:
        raise ValueError(f"--heartbeat-s {interval_s:g}: seconds, {HEARTBEAT_MIN_INTERVAL} to "
                         f"{HEARTBEAT_MAX_INTERVAL} (what Flower's SuperLink accepts; its SuperNode: 30)")


def space_heartbeats(interval_s: float) -> None:
    """Make this process's Flower SuperNode connections declare, and beat at, `interval_s` (a module global each of
    :data:`HEARTBEAT_MODULES` reads at every use); raise, naming what moved, if one lacks it (Flower 1.42), or if
    the SuperLink would refuse `interval_s` (:func:`check_heartbeat`)."""
    check_heartbeat(interval_s)
    modules = [importlib.import_module(name) for name in HEARTBEAT_MODULES]
    for module in modules:
        if not isinstance(getattr(module, HEARTBEAT_NAME, None), (int, float)):
            raise RuntimeError(f"flwr {flwr.__version__}: {module.__name__} has no {HEARTBEAT_NAME}; "
                               "client_app/supernode.py spaces Flower 1.42's heartbeats: drop --heartbeat-s")
    for module in modules:
        setattr(module, HEARTBEAT_NAME, interval_s)


def main() -> None:
    """``flower-supernode`` with its waits paced (``--idle-wait-s``, the idle ceiling, and ``--heartbeat-s``, taken
    out of its flags); exit 2 naming a bad value, 1 with one line if this Flower's loop is not the one it paces."""
    parser = argparse.ArgumentParser(prog="python -m client_app.supernode", add_help=False, allow_abbrev=False)
    parser.add_argument("--idle-wait-s", type=float, default=IDLE_WAIT_S)
    parser.add_argument("--heartbeat-s", type=float, default=None)
    ours, sys.argv[1:] = parser.parse_known_args(sys.argv[1:])
    if not 0 < ours.idle_wait_s < float("inf"):
        parser.error(f"--idle-wait-s {ours.idle_wait_s:g}: seconds, > 0 (Flower's SuperNode: {IDLE_WAIT_S:g})")
    try:
        if ours.heartbeat_s is not None:
            space_heartbeats(ours.heartbeat_s)
        pace(importlib.import_module(LOOP), Pacer(idle_wait_s=ours.idle_wait_s))
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:
        sys.exit(f"error: {err}")
    from flwr.supernode.cli import flower_supernode

    flower_supernode()


if __name__ == "__main__":
    main()
