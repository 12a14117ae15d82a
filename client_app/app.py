"""The ClientApp: loads the node's partition and runs the local work the server asks for.

The node's partition comes from ``node_config`` (``partition-id``, ``num-partitions``), set by
the simulation engine, by ``flower-supernode --node-config`` in deployment, or by the in-process
engine. An optional ``latency-s`` in ``node_config`` delays every train reply (a slow device), and
``compute-s-per-example`` with ``overhead-s`` pace it as a device profile says (a real fleet:
hybridfl/launch/real_fleet.py); an optional ``data-root`` says where this node keeps the datasets' files, ``cache-dir``
where it keeps its partition for the run (client_app/node_cache.py), ``allow-code`` the user code it runs besides what
its runs declare (client_app/declared.py).
Everything else (data spec, model, local recipe, seed) travels in the message config, so a node
needs no run configuration of its own.

Replies: ``train`` runs the local recipe with the client objective the message names
(``local-objective``: cross-entropy, FedProx's proximal term, ...; common/objectives.py) from the
received model and extra arrays, and returns the *delta* of the trainable parameters plus
``num-examples``, ``partition-id``, ``base-version``, training metrics and the objective's own (with
``loss-gradient`` in the config, also the gradient FedDUAL's code aggregates); ``evaluate`` returns the
received model's loss and accuracy on the node's own held-out splits (personalised evaluation) or, when
the run holds none out, on its partition; ``query`` returns the node's partition id.
An exception inside a handler becomes an error reply (``CLIENT_APP_RAISED_EXCEPTION``). Models and updates
travel as the run's ``model-codec`` and ``update-codec`` say (client_app/wire_codec.py, a Flower mod): handlers
see float32.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from logging import DEBUG, ERROR, INFO

from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from client_app.declared import guard
from client_app.wire_codec import codec_mod
from common.protocol import METRICS, PARTITION_ID
from common.user_code import UndeclaredCode

# When Flower's process handed over to this module (the imports above are Flower's own, already loaded), whether
# torch was imported before it (a warm device's fork server imports it once), and whether this process has handled
# a message yet (deployment: one process per message; simulation: reused).
_LOADED_AT, _TORCH_PRELOADED, _HANDLED = time.time(), "torch" in sys.modules, [0]

# The wire's codecs around every handler: a model decoded on its way in, an update encoded on its way out
app = ClientApp(mods=[codec_mod])

Handler = Callable[[Message, Context], Message]


def error_replies(handler: Handler) -> Handler:
    """Run `handler` importing only the code its run declared (client_app/declared.py ``guard``), and turn an
    exception inside it into an error reply, logged with its traceback (a refused name: with the reason alone)."""

    @functools.wraps(handler)
    def guarded(msg: Message, context: Context) -> Message:
        try:
            with guard(context):
                return handler(msg, context)
        except UndeclaredCode as err:
            log(ERROR, "ClientApp %s refused: %s", msg.metadata.message_type, err)
            reason = f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - any failure on the device becomes an error reply
            log(ERROR, "ClientApp %s failed: %s", msg.metadata.message_type, traceback.format_exc())
            reason = f"{type(err).__name__}: {err}"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)

    return guarded


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) of this node, with a clear error when they are missing."""
    cfg = context.node_config
    if "partition-id" not in cfg or "num-partitions" not in cfg:
        raise ValueError("node_config needs 'partition-id' and 'num-partitions' "
                         "(flower-supernode --node-config 'partition-id=0 num-partitions=N')")
    return int(cfg["partition-id"]), int(cfg["num-partitions"])


def _process_started() -> float | None:
    """This process's start (epoch seconds) from /proc (Linux); None elsewhere."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))  # noqa: SIM115
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _ray_node() -> dict[str, str]:
    """``{"ray-node": ID}`` in a Ray worker (a simulated client on a Ray cluster's node), else nothing."""
    ray = sys.modules.get("ray")  # never imported here: only a Ray worker has it
    if ray is None or not ray.is_initialized():
        return {}
    return {"ray-node": ray.get_runtime_context().get_node_id()}


def _timing(kind: str, started: float, imported: float, timings: dict[str, float]) -> None:
    """One log line per message: where this device's time went (BENCHMARKS "Seconds per update in deployment").
    ``flower-s``: the process's start until this module loaded (a new process per message in deployment; 0
    where processes are reused), ``import-s``: importing the local work (torch), then the work's own parts. At INFO
    for a process's first message (every message on a deployment's devices: a process each), at DEBUG after it (a
    process that serves many, in-process or a simulation's, would fill the run's log)."""
    born = _process_started()
    _HANDLED[0] += 1
    line = {"message": kind, "flower-s": round(_LOADED_AT - born, 3) if born and _HANDLED[0] == 1 else 0.0,
            "import-s": round(imported - started, 3), "torch-preloaded": _TORCH_PRELOADED,
            **{k: round(v, 3) for k, v in timings.items()},
            "handler-s": round(time.time() - started, 3), **_ray_node()}
    log(INFO if _HANDLED[0] == 1 else DEBUG, "device timing %s", json.dumps(line))


@app.train()
@error_replies
def train_handler(msg: Message, context: Context) -> Message:
    """Local training from the received global model; replies with the parameter delta (client_app/work.py)."""
    started = time.time()
    from client_app import work  # torch: only the messages that do local work import it

    imported, timings = time.time(), {}
    reply = work.train_reply(msg, context, *node_partition(context),
                             float(context.node_config.get("latency-s", 0.0)), timings)
    _timing("train", started, imported, timings)
    return reply


@app.evaluate()
@error_replies
def evaluate_handler(msg: Message, context: Context) -> Message:
    """The received model on this node's own held-out splits, or its partition (client_app/work.py)."""
    started = time.time()
    from client_app import work  # as in train_handler

    imported, timings = time.time(), {}
    reply = work.evaluate_reply(msg, context, *node_partition(context), timings)
    _timing("evaluate", started, imported, timings)
    return reply


@app.query()
@error_replies
def query_handler(msg: Message, context: Context) -> Message:
    """Which partition this node holds (the server maps node ids to stable client ids with it)."""
    pid, num_partitions = node_partition(context)
    return Message(RecordDict({METRICS: MetricRecord({PARTITION_ID: pid, "num-partitions": num_partitions})}),
                   reply_to=msg)
