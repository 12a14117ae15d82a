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
version staler. The pacing and the heartbeat reach under Flower's public API: they live in flower_internals/supernode.py
with the internals they rely on, checked when it starts (:func:`~flower_internals.supernode.pace`) and by
``tests/test_flower_internals.py``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flower_internals.supernode import IDLE_WAIT_S, LOOP, Pacer, pace, run_supernode, space_heartbeats


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
    run_supernode()


if __name__ == "__main__":
    main()
