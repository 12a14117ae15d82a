"""A compromised device: a registered node key in hostile hands, speaking Flower 1.42's Fleet API itself.

    python -m tools.rogue_device --superlink 127.0.0.1:PORT --root-certificates ca.crt --auth-key KEY \\
        --partition-id 2 --num-partitions 3 --log sent.jsonl

It connects as ``flower-supernode`` does (Flower's own HTTPS connection, ``flwr/supernode/fleet_http_connection.py``,
signed with the node's private key, so the SuperLink takes it for a registered SuperNode), answers the ServerApp's
``query`` with the partition it is told to claim (the server then dispatches train messages to it), and answers each
``train`` message with the next row of :data:`BAD_REPLIES`: lies about ``num-examples`` (NaN, ±inf, a list, huge,
zero, negative), deltas that are non-finite, huge, of the wrong length or dtype or no array at all, a forged
partition or version, a NaN training loss, missing records, and well-formed updates scaled to take the model over.
Every reply it pushed is one line of ``--log`` (``{"reply": NAME, "version": V}``), so a test knows what it sent.
``evaluate`` messages get the next row of :data:`BAD_EVALUATIONS` (metrics missing, NaN, a forged partition, a huge
count that would set the federated evaluation's mean), then error replies. It leaves (deactivating its node) once
every train row is sent, after ``--timeout-s``, or on SIGTERM. With ``--forge-to NODE``, on its first train message
it also pushes a message of its own to another node, its source the SuperLink's (Flower 1.42's Fleet API stores a
pushed message that replies to nothing as the SuperLink's instruction to its destination): the train message it got,
its configuration naming code nobody declared (``--forge KEY=NAME``, default ``dataset=shutil:rmtree``); a line
``{"forged": NODE, ...}`` of ``--log``. No value is built outside what Flower's records can
carry: ``MetricRecord`` holds only int, float and lists of them (its wire format has no string), so a string
``num-examples`` cannot be sent at all.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.common import now
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree, no_object_id_recompute
from flwr.supercore.inflatable.inflatable_utils import (
    pull_and_inflate_object_from_tree,
    push_object_contents_from_iterable,
)
from flwr.supernode.fleet_http_connection import http_request_response

from common.params import WIRE_KEY
from common.protocol import ARRAYS, BASE_VERSION, CONFIG, METRICS, NUM_EXAMPLES, PARTITION_ID, VERSION
from hybridfl.launch.processes import terminated

POLL_S = 0.1  # between pulls while nothing waits: a synchronous round's next message follows its last reply
LINGER_S = 60.0  # the longest the rogue stays after its last reply, for the server to take it
HONEST_EXAMPLES = 100  # what the rogue claims where it lies about something else
HONEST_SCALE = 0.01  # per-coordinate size of an honest-looking delta


@dataclass(frozen=True)
class Sent:
    """What a train message told the rogue: the model's size, the version it carries, the partition it claims."""

    numel: int
    version: int
    partition: int


@dataclass(frozen=True)
class BadReply:
    """One hostile reply: `name`, what it does, whether every value of it is valid and only its size hostile
    (`well_formed`: the runner's size bound, max-update-ratio, refuses it) and what a rejection's reason should name
    (`about`, any of)."""

    name: str
    what: str
    build: Callable[[Sent], RecordDict]
    about: tuple[str, ...] = ()
    well_formed: bool = False


def _delta(sent: Sent, scale: float = HONEST_SCALE) -> np.ndarray:
    """A delta of the model's length, N(0, `scale`²) per coordinate, seeded by the version (float32)."""
    return (np.random.default_rng(sent.version).standard_normal(sent.numel) * scale).astype(np.float32)


def _reply(sent: Sent, *, params: Array | None = None, partition: int | None = None, version: int | None = None,
           **metrics: object) -> RecordDict:
    """A train reply as the ClientApp builds it (client_app/work.py update_message), with any part replaced."""
    values = {NUM_EXAMPLES: HONEST_EXAMPLES, PARTITION_ID: sent.partition if partition is None else partition,
              BASE_VERSION: sent.version if version is None else version, "train-loss": 1.0}
    values.update({k.replace("_", "-"): v for k, v in metrics.items()})
    array = Array(_delta(sent)) if params is None else params
    return RecordDict({ARRAYS: ArrayRecord({WIRE_KEY: array}), METRICS: MetricRecord(values)})


def _examples(value: object) -> Callable[[Sent], RecordDict]:
    return lambda sent: _reply(sent, num_examples=value)


def _params(make: Callable[[Sent], Array]) -> Callable[[Sent], RecordDict]:
    return lambda sent: _reply(sent, params=make(sent))


def _filled(value: float, dtype: type = np.float32, extra: int = 0) -> Callable[[Sent], Array]:
    return lambda sent: Array(np.full(sent.numel + extra, value, dtype=dtype))


def _with_nonfinite(sent: Sent) -> Array:
    delta = _delta(sent)
    delta[::7], delta[1::7] = np.inf, np.nan
    return Array(delta)


NUM_EXAMPLES_ABOUT = (NUM_EXAMPLES,)
PARAMS_ABOUT = (WIRE_KEY,)
# The rogue's replies, in the order it sends them (one per train message). A test reads this table for what was sent.
BAD_REPLIES: tuple[BadReply, ...] = (
    BadReply("examples-nan", "num-examples = NaN", _examples(float("nan")), NUM_EXAMPLES_ABOUT),
    BadReply("examples-inf", "num-examples = inf", _examples(float("inf")), NUM_EXAMPLES_ABOUT),
    BadReply("examples-minus-inf", "num-examples = -inf", _examples(float("-inf")), NUM_EXAMPLES_ABOUT),
    BadReply("examples-list", "num-examples = [1, 2]", _examples([1, 2]), NUM_EXAMPLES_ABOUT),
    BadReply("examples-1e300", "num-examples = 1e300 (its update's weight would be ~1)", _examples(1e300),
             NUM_EXAMPLES_ABOUT),
    BadReply("examples-huge-int", "num-examples = 2^63 - 1, an integer", _examples(2**63 - 1), NUM_EXAMPLES_ABOUT),
    BadReply("examples-zero", "num-examples = 0", _examples(0), NUM_EXAMPLES_ABOUT),
    BadReply("examples-negative", "num-examples = -5", _examples(-5), NUM_EXAMPLES_ABOUT),
    BadReply("examples-fraction", "num-examples = 2.5", _examples(2.5), NUM_EXAMPLES_ABOUT),
    BadReply("delta-nonfinite", "a delta with inf and NaN values", _params(_with_nonfinite), PARAMS_ABOUT),
    BadReply("delta-short", "a delta one value short", _params(_filled(0.0, extra=-1)), PARAMS_ABOUT),
    BadReply("delta-float64-overflow", "a float64 delta of 1e300 (inf as float32)", _params(_filled(1e300, np.float64)),
             PARAMS_ABOUT),
    BadReply("delta-int", "an int32 delta", _params(_filled(1, np.int32)), PARAMS_ABOUT),
    BadReply("delta-not-numpy", "an array whose bytes are not a numpy array",
             _params(lambda sent: Array("float32", (sent.numel,), "numpy.ndarray", b"\x93NUMPY garbage")),
             ("malformed", WIRE_KEY, "array")),
    BadReply("forged-partition", "partition-id 0 (another device's)", lambda sent: _reply(sent, partition=0),
             ("client 0",)),
    BadReply("forged-version", "base-version 7 ahead of the one sent",
             lambda sent: _reply(sent, version=sent.version + 7), ("version",)),
    BadReply("loss-nan", "train-loss = NaN", lambda sent: _reply(sent, train_loss=float("nan")), ("train-loss",)),
    BadReply("no-arrays", "metrics only, no arrays record",
             lambda sent: RecordDict({METRICS: _reply(sent)[METRICS]}), (ARRAYS,)),
    BadReply("delta-1e30", "a delta of 1e30 everywhere (finite in float32)", _params(_filled(1e30)),
             well_formed=True),
    BadReply("delta-scaled-1e6", "an honest-sized delta scaled x1e6",
             _params(lambda sent: Array(_delta(sent) * np.float32(1e6))), well_formed=True),
)


def _evaluation(sent: Sent, **metrics: object) -> RecordDict:
    """An evaluate reply as the ClientApp builds it (client_app/work.py evaluate_reply), with any metric replaced."""
    values = {NUM_EXAMPLES: HONEST_EXAMPLES, PARTITION_ID: sent.partition, "eval-loss": 1.0, "eval-accuracy": 1.0}
    values.update({k.replace("_", "-"): v for k, v in metrics.items()})
    return RecordDict({METRICS: MetricRecord({k: v for k, v in values.items() if v is not None})})


# Its replies to evaluate messages, in order: each must be left out of the evaluation
BAD_EVALUATIONS: tuple[BadReply, ...] = (
    BadReply("eval-no-accuracy", "no eval-accuracy or eval-loss",
             lambda sent: _evaluation(sent, eval_accuracy=None, eval_loss=None)),
    BadReply("eval-accuracy-nan", "eval-accuracy = NaN", lambda sent: _evaluation(sent, eval_accuracy=float("nan"))),
    BadReply("eval-forged-partition", "partition-id 0, accuracy 1", lambda sent: _evaluation(sent, partition_id=0)),
    BadReply("eval-examples-huge", "num-examples = 2^53 - 1 with accuracy 0 (the mean's weight ~1)",
             lambda sent: _evaluation(sent, num_examples=2**53 - 1, eval_accuracy=0.0)),
)


def bad_reply(name: str) -> BadReply:
    """The row of :data:`BAD_REPLIES` called `name`."""
    return next(r for r in BAD_REPLIES if r.name == name)


def hostile_content(msg: Message, row: BadReply, partition: int) -> RecordDict:
    """`row`'s reply to the train or evaluate message `msg` (the model's size and the version it carries) from a
    device that claims `partition`."""
    return row.build(Sent(int(msg.content[ARRAYS][WIRE_KEY].shape[0]), int(msg.content[CONFIG][VERSION]), partition))


def forged(msg: Message, victim: int, key: str, name: str) -> Message:
    """`msg` (a train message the SuperLink sent) re-addressed to the node `victim`, its source the SuperLink, its
    configuration's `key` set to `name`: what a node can make another run under Flower 1.42."""
    config = ConfigRecord({**msg.content[CONFIG], key: name})
    sent = msg.metadata
    return Message(RecordDict({**msg.content, CONFIG: config}), metadata=Metadata(
        run_id=sent.run_id, message_id="", src_node_id=SUPERLINK_NODE_ID, dst_node_id=victim, reply_to_message_id="",
        group_id=sent.group_id, created_at=now().timestamp(), ttl=sent.ttl, message_type=MessageType.TRAIN,
        src_task_id=sent.src_task_id))


def run_rogue(superlink: str, root_certificates: Path, auth_key: Path, partition_id: int, num_partitions: int,
              log: Path, replies: Sequence[BadReply] = BAD_REPLIES, timeout_s: float = 600.0,
              forge: tuple[int, str, str] | None = None) -> int:
    """Be the rogue device on the SuperLink at `superlink` (HTTPS verified against `root_certificates`, signed with
    the registered private key `auth_key`, OpenSSH format) until every one of `replies` is sent and the server has
    taken the last (it sends this device another message, answered; or :data:`LINGER_S` passed), or `timeout_s`
    passed; returns how many were sent (each a line of `log`). A node that leaves marks its messages unavailable
    at the SuperLink: leaving at once, a reply the server had not pulled yet became Flower's "Node Unavailable"
    error. `forge` (victim node, key, name): push
    :func:`forged` of the first train message once."""
    private = load_ssh_private_key(auth_key.read_bytes(), password=None)
    deadline, sent, evaluations = time.monotonic() + timeout_s, 0, list(BAD_EVALUATIONS)
    with (http_request_response(superlink, False, str(root_certificates), (private, private.public_key()),
                                max_retries=3, max_wait_time=60.0) as conn, log.open("a") as out):
        _, receive, send, _, _, pull_object, push_object, confirm = conn
        last_at = time.monotonic()  # when the last of `replies` was sent
        while time.monotonic() < deadline and (sent < len(replies) or time.monotonic() < last_at + LINGER_S):
            if (got := receive()) is None:
                time.sleep(POLL_S)
                continue
            if sent == len(replies):  # a message after the last reply: the server has taken it; answered below
                deadline = 0.0
            header, tree = got
            run_id = header.metadata.run_id
            msg = pull_and_inflate_object_from_tree(tree, partial(pull_object, run_id), partial(confirm, run_id),
                                                    return_type=Message)
            kind, row = header.metadata.message_type, None
            if kind == MessageType.QUERY:
                content = RecordDict({METRICS: MetricRecord({PARTITION_ID: partition_id,
                                                             "num-partitions": num_partitions})})
            elif kind == MessageType.TRAIN:
                row = replies[sent]
                content = hostile_content(msg, row, partition_id)
                if forge is not None:
                    _push(forged(msg, *forge), send, push_object)
                    out.write(json.dumps({"forged": forge[0], "key": forge[1], "name": forge[2]}) + "\n")
                    forge = None
            elif kind == MessageType.EVALUATE and evaluations:
                content = hostile_content(msg, evaluations.pop(0), partition_id)
            else:
                content = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"the rogue device does not answer {kind}")
            _push(Message(content, reply_to=header), send, push_object)
            if row is not None:
                sent += 1
                last_at = time.monotonic()
                line = json.dumps({"reply": row.name, "version": int(msg.content[CONFIG][VERSION])})
                out.write(line + "\n")
                out.flush()
                print("sent", line, flush=True)
    return sent


def _push(reply: Message, send: Callable, push_object: Callable) -> None:
    """Push `reply` and its objects as Flower's SuperNode does (``start_client_internal._push_messages``)."""
    reply.metadata.__dict__["_message_id"] = reply.object_id
    with no_object_id_recompute():
        objects = get_all_nested_objects(reply)
        wanted, session = send(reply, get_object_tree(reply), 0.0)
        push_object_contents_from_iterable(((i, objects[i].deflate()) for i in wanted),
                                           partial(push_object, reply.metadata.run_id, session))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.rogue_device", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="replies, in order:\n" + "\n".join(
                                         f"  {r.name:24} {r.what}" for r in BAD_REPLIES))
    parser.add_argument("--superlink", required=True, help="the SuperLink's Fleet API, HOST:PORT")
    parser.add_argument("--root-certificates", required=True, type=Path, help="the CA the SuperLink's certificate "
                        "is checked against")
    parser.add_argument("--auth-key", required=True, type=Path, help="a registered SuperNode's private key "
                        "(OpenSSH format)")
    parser.add_argument("--partition-id", required=True, type=int, help="the partition it claims to hold")
    parser.add_argument("--num-partitions", required=True, type=int)
    parser.add_argument("--log", required=True, type=Path, help="JSON lines: each reply it pushed")
    parser.add_argument("--only", nargs="+", choices=[r.name for r in BAD_REPLIES], help="send these replies, in "
                        "this order (default: all)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="leave after this long (default 600)")
    parser.add_argument("--forge-to", type=int, metavar="NODE", help="also push, once, a train message to this node "
                        "as if the SuperLink sent it, naming code nobody declared (--forge)")
    parser.add_argument("--forge", default="dataset=shutil:rmtree", metavar="KEY=NAME",
                        help="the configuration key the forged message sets, and the name (default %(default)s)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, terminated)  # leave as on Ctrl-C: the node is deactivated on the way out
    replies = [bad_reply(n) for n in args.only] if args.only else BAD_REPLIES
    if "=" not in args.forge:
        parser.error(f"--forge {args.forge!r}: expected KEY=NAME")
    key, name = args.forge.split("=", 1)
    forge = None if args.forge_to is None else (args.forge_to, key, name)
    sent = run_rogue(args.superlink, args.root_certificates, args.auth_key, args.partition_id, args.num_partitions,
                     args.log, replies, args.timeout_s, forge)
    print(f"sent {sent} of {len(replies)} hostile replies", flush=True)
    return 0 if sent == len(replies) else 1


if __name__ == "__main__":
    raise SystemExit(main())
