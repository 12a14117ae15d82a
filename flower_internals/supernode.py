"""Flower's SuperNode loop with its two fixed waits paced, and its heartbeat spaced (client_app/supernode.py is the
command, and says why)."""

from __future__ import annotations

import importlib
import inspect
import time
from types import ModuleType
from typing import Any

import flwr

# Flower internals this module relies on (checked by tests/test_flower_internals.py; :func:`pace` checks the loop's
# source when it starts)
RELIES_ON = ("flwr.supernode.start_client_internal:_push_messages",
             "flwr.supernode.fleet_http_connection:HEARTBEAT_DEFAULT_INTERVAL",
             "flwr.supercore.heartbeat:HEARTBEAT_DEFAULT_INTERVAL",
             "flwr.common.constant:HEARTBEAT_MIN_INTERVAL", "flwr.common.constant:HEARTBEAT_MAX_INTERVAL",
             "flwr.supernode.cli:flower_supernode")
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


def check(loop: ModuleType | None = None) -> list[str]:
    """What :func:`pace` needs of Flower's SuperNode `loop` (default: :data:`LOOP`) that :data:`RELIES_ON` cannot
    say: the two fixed sleeps it paces, the push it hears replies from, the ``time`` it replaces; one line each
    missing."""
    loop = loop or importlib.import_module(LOOP)
    source = inspect.getsource(loop)
    return [f"{loop.__name__} has no `{needle}`" for needle in
            (f"time.sleep({IDLE_WAIT_S:g})", f"time.sleep({REPLY_CHECK_S:g})", "_push_messages(", "import time")
            if needle not in source]


def pace(loop: ModuleType, pacer: Pacer) -> None:
    """Put `pacer` in place of `loop`'s ``time`` and tell it of every reply pushed; raise, naming what moved, if
    `loop` is not the SuperNode loop this was written against (Flower 1.42)."""
    for moved in check(loop):
        raise RuntimeError(f"flwr {flwr.__version__}: {moved}; client_app/supernode.py paces Flower 1.42's "
                           "SuperNode loop: run Flower's own flower-supernode instead")
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
                               "flower_internals/supernode.py spaces Flower 1.42's heartbeats: drop --heartbeat-s")
    for module in modules:
        setattr(module, HEARTBEAT_NAME, interval_s)


def run_supernode() -> None:
    """Flower's ``flower-supernode``, its flags read from ``sys.argv``."""
    from flwr.supernode.cli import flower_supernode

    flower_supernode()
