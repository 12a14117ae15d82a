"""Messages between the ServerApp and its nodes: who is who, what is sent, what comes back.

``NodeDirectory`` learns which client (partition) each node holds, so sampling, seeds and
aggregation order depend on stable client ids, not on the random node ids of a run.
``Dispatcher`` turns a strategy's :class:`~strategies.base.Payload` into train/evaluate messages
tagged with the model version they carry; :func:`collect` polls for their replies, and
:func:`parse_reply` turns a train reply back into an :class:`~strategies.base.Update`, or says why
it cannot be used.
"""

from __future__ import annotations

import functools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid

from common.codecs import (
    PLAIN,
    WireCodecs,
    apply_difference,
    decode,
    encode_model,
    encoded_nbytes,
    full_codec,
    model_digest,
)
from common.config import make_options
from common.params import BadArrays, ParamSpec, extras_from_record, extras_to_record
from common.protocol import (
    ARRAYS,
    BASE_VERSION,
    CONFIG,
    EXTRAS,
    METRICS,
    MODEL_BASE,
    NUM_EXAMPLES,
    PARTITION_ID,
    REPLY_KEYS,
    TRAIN_SEED,
    VERSION,
)
from common.training import derive_seed
from flower_internals.replies import ReplyPuller, push
from strategies.base import Payload, Update

POLL_INTERVAL_S = 0.05
POLL_MAX_INTERVAL_S = 0.25
T = TypeVar("T")
LOGGED_NODES = 20  # partitions named in the "clients connected" line


class RejectedReply(ValueError):
    """A reply that cannot enter a strategy; the reason is logged and counted by the runner."""


# The largest count or id a reply may carry when nothing tighter is known: float64 holds every integer up to 2^53,
# and no partition, version or dataset of a run comes near it
MAX_COUNT = 2**53


def reply_number(metrics: Mapping[str, Any], key: str, low: float = -math.inf, high: float = math.inf,
                 integral: bool = False) -> float:
    """``metrics[key]`` as a float, or :class:`RejectedReply` saying why not: a finite number (not a list, not NaN
    or ±inf) in [`low`, `high`], a whole one where `integral`."""
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RejectedReply(f"'{key}' is a {type(value).__name__}, not a number")
    if not math.isfinite(value) or not low <= value <= high or (integral and value != int(value)):
        span = f"a whole number in [{low:g}, {high:g}]" if integral else f"a finite number in [{low:g}, {high:g}]"
        raise RejectedReply(f"'{key}' = {value!r} is not {span}")
    return float(value)


def rejecting(parse: Callable[..., T]) -> Callable[..., T]:
    """`parse` with anything it raises turned into a :class:`RejectedReply`: no value a hostile or broken device
    sends reaches the runner as another exception."""

    @functools.wraps(parse)
    def guarded(*args: Any, **kwargs: Any) -> T:
        try:
            return parse(*args, **kwargs)
        except RejectedReply:
            raise
        except Exception as err:  # a reply is data: whatever it breaks while being read, it is rejected
            raise RejectedReply(f"malformed reply ({type(err).__name__}: {err})") from err

    return guarded


def unavailable(reply: Message) -> bool:
    """Whether `reply` is the SuperLink's word that it no longer holds the message or its reply (Flower's
    ``MESSAGE_UNAVAILABLE``, ``REPLY_MESSAGE_UNAVAILABLE``: lost in a restart, expired, its node removed): a loss
    by the link, not the device's failure. Only the SuperLink sends these as itself; a device's reply carries its
    own node (the SuperLink refuses a reply from another), and hybridfl's puller signs a reply it could not pull
    with the device's node, so a device cannot pass its failure off as the link's."""
    return (reply.has_error() and reply.metadata.src_node_id == SUPERLINK_NODE_ID
            and reply.error.code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE))


@rejecting
def parse_reply(msg: Message, spec: ParamSpec, max_examples: int = MAX_COUNT, codecs: WireCodecs = PLAIN) -> Update:
    """The :class:`Update` in a train reply (``sent`` left for the caller), or :class:`RejectedReply`.

    Every value is checked before anything uses it: ``num-examples`` a whole number in [1, `max_examples`] (a
    device's lie about its size would otherwise set its weight in every example-weighted mean), ``partition-id``
    and ``base-version`` whole numbers (the runner compares them with what it dispatched), every other metric a
    finite number, the update decoded as the run's ``update-codec`` says (common/codecs.py: every key, dtype,
    shape and value checked) into finite float32 of the model's layout; whatever else a reply breaks while being
    read rejects it too (:func:`rejecting`)."""
    if msg.has_error():
        raise RejectedReply(f"error reply (code {msg.error.code}): {msg.error.reason}")
    content = msg.content
    if ARRAYS not in content.array_records or METRICS not in content.metric_records:
        raise RejectedReply(f"reply lacks '{ARRAYS}' or '{METRICS}' records")
    metrics = content[METRICS]
    for key in REPLY_KEYS:
        if key not in metrics:
            raise RejectedReply(f"reply metrics lack '{key}'")
    examples = reply_number(metrics, NUM_EXAMPLES, 1, max_examples, integral=True)
    client = reply_number(metrics, PARTITION_ID, 0, MAX_COUNT, integral=True)
    base = reply_number(metrics, BASE_VERSION, 0, MAX_COUNT, integral=True)
    rest = {k: reply_number(metrics, k) for k in metrics if k not in REPLY_KEYS}
    try:
        delta = torch.from_numpy(decode(content[ARRAYS], codecs.update_codec, spec.numel, codecs))
        extras = extras_from_record(content[EXTRAS]) if EXTRAS in content.array_records else {}
    except BadArrays as err:
        raise RejectedReply(str(err)) from err
    return Update(int(client), int(base), delta, int(examples), extras, rest)


def read_update(reply: Message, client: int, version: int, sent: Payload, spec: ParamSpec, max_examples: int,
                codecs: WireCodecs, max_update_ratio: float) -> Update:
    """The update `reply` brings to `client`'s train message of model `version`, which carried `sent`: parsed
    (:func:`parse_reply`), for that client and version, and no larger than ``max-update-ratio`` allows; else
    :class:`RejectedReply`.

    Size: ‖Δ‖ ≤ `max_update_ratio` · max(‖ω^τ‖, 1), ω^τ the model it started from (0: no bound; norms in float64,
    where a finite float32 update's norm cannot overflow)."""
    update = parse_reply(reply, spec, max_examples, codecs)
    if (update.client, update.base_version) != (client, version):
        raise RejectedReply(f"reply is for client {update.client} at version {update.base_version}, "
                            f"but client {client} was sent version {version}")
    update.sent = sent
    if max_update_ratio:
        size, start = (float(torch.linalg.vector_norm(t, dtype=torch.float64)) for t in (update.delta, update.start))
        if size > max_update_ratio * max(start, 1.0):
            raise RejectedReply(f"update norm {size:.3g} is over max-update-ratio {max_update_ratio:g} x the norm of "
                                f"the model it started from ({start:.3g})")
    return update


@rejecting
def parse_metrics(msg: Message) -> tuple[int, dict[str, float]]:
    """(partition id, metrics) of a query or an evaluate reply, every value checked as :func:`parse_reply` checks
    a train reply's, or :class:`RejectedReply`."""
    if msg.has_error():
        raise RejectedReply(f"error reply (code {msg.error.code}): {msg.error.reason}")
    if METRICS not in msg.content.metric_records or PARTITION_ID not in msg.content[METRICS]:
        raise RejectedReply(f"reply lacks its '{METRICS}' record or its '{PARTITION_ID}'")
    metrics = msg.content[METRICS]
    values = {k: reply_number(metrics, k) for k in metrics}
    client = reply_number(values, PARTITION_ID, 0, MAX_COUNT, integral=True)
    return int(client), {k: v for k, v in values.items() if k != PARTITION_ID}


class Pace:
    """The wait between pulls for replies: `first` seconds after a pull that brought something, twice as long after
    each one that brought nothing, up to `most` (at least `first`). Every pull is a request the SuperLink answers
    (about 6 ms of its CPU each, measured on a 2-core machine): a ServerApp waiting for a slow device at a steady
    20 pulls a second kept the SuperLink at 9 % of a core and itself at 3 %, doing nothing (benchmarks/
    idle_deployment.py); at the defaults it asks 4 times a second after three pulls that brought nothing, and a reply
    that ends a quiet spell waits at most `most` for its pull. Replies that keep coming keep the short wait."""

    def __init__(self, first: float = POLL_INTERVAL_S, most: float = POLL_MAX_INTERVAL_S) -> None:
        self.first, self.most = first, max(first, most)
        self.next = first

    def wait(self) -> None:
        """Wait before the next pull, and make the wait after it longer."""
        time.sleep(self.next)
        self.next = min(2 * self.next, self.most)

    def reset(self) -> None:
        """Something came: the next wait is `first` again."""
        self.next = self.first

    def after(self, brought: bool) -> None:
        """After a pull: :meth:`reset` if it brought something, else :meth:`wait`."""
        if brought:
            self.reset()
        else:
            self.wait()


def collect(replies: ReplyPuller, message_ids: Iterable[str], timeout: float, pace: Pace | None = None
            ) -> list[Message]:
    """Replies to `message_ids` that arrive within `timeout` seconds (pulled at `pace`: default, :class:`Pace`'s),
    each as soon as its own objects are in; those not in by then are given up."""
    pace = pace or Pace()
    pending = set(message_ids)
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending:
        arrived = replies.pull(pending)
        got.extend(arrived)
        pending -= {m.metadata.reply_to_message_id for m in arrived}
        if not pending or time.monotonic() >= deadline:
            break
        pace.after(bool(arrived))
    for message_id in pending:
        replies.discard(message_id)
    return got


# A query's answer is a few bytes: one not in by then is lost, or queued behind a SuperLink's backlog (asking again
# then costs one small message per such node and minute, well under wait-nodes-s's default of 120 s)
ASK_AGAIN_S = 60.0


class NodeDirectory:
    """Which node holds which client partition, learned by a ``query`` message to each new node.

    A node without a usable answer within `ask_again_s` is asked again, unless its answer is on its way (listed by
    the SuperLink, still uploading): Flower's SuperNode drops a message whose objects it failed to pull and never
    answers it (300 load-test devices that gave up after 60 s lost 41 queries: the run then waited for them until
    wait-nodes-s ended it); one whose answer was refused is not asked again sooner. Answers come through `replies`
    (default: a puller of its own), each as soon as its own objects are in: with Flower's ``Grid.pull_messages``
    one answer still uploading held every other, and 1000 devices behind a busy edge left the directory waiting on
    uploads for its whole ``wait-nodes-s`` while 963 answers sat in the SuperLink. Its waits, and those of the
    replies collected through it, go at `pace` (default: a :class:`Pace` of its own)."""

    def __init__(self, grid: Grid, num_clients: int = MAX_COUNT, ask_again_s: float = ASK_AGAIN_S,
                 replies: ReplyPuller | None = None, pace: Pace | None = None) -> None:
        self.grid, self.num_clients = grid, num_clients  # a node naming a partition outside [0, num_clients) is ignored
        self.ask_again_s = ask_again_s
        self.replies = replies or ReplyPuller(grid)
        self.pace = pace or Pace()
        self.node_of: dict[int, int] = {}  # client (partition id) -> node id
        self._asked: dict[str, tuple[int, float]] = {}  # query message id -> (node id, when asked)

    @property
    def clients(self) -> list[int]:
        return sorted(self.node_of)

    def poll(self) -> set[int]:
        """Ask connected nodes not yet known which partition they hold, record the answers that are in
        (without waiting), and return the ids of the nodes connected now."""
        nodes, now = set(self.grid.get_node_ids()), time.monotonic()
        for m in [m for m, (node, asked) in self._asked.items() if node not in nodes or (
                now - asked > self.ask_again_s and not self.replies.downloading(m))]:
            del self._asked[m]  # the node is gone, or is asked again below
            self.replies.discard(m)
        known = set(self.node_of.values()) | {node for node, _ in self._asked.values()}
        new = sorted(nodes - known)
        if new:
            self._asked.update(zip(push(self.grid, lambda: [
                Message(RecordDict({CONFIG: ConfigRecord({})}), dst_node_id=n, message_type=MessageType.QUERY)
                for n in new]), ((n, now) for n in new)))
        for reply in self.replies.pull(list(self._asked)):
            # a node that did not describe itself usably is asked again only once its query's time is up
            node, _ = self._asked[reply.metadata.reply_to_message_id]
            try:
                client, _ = parse_metrics(reply)
            except RejectedReply as err:
                log(WARNING, "node %d did not describe itself: %s", node, err)
                continue
            if not 0 <= client < self.num_clients:
                log(WARNING, "node %d says it holds partition %d, not one of this run's [0, %d)", node, client,
                    self.num_clients)
                continue
            if client in self.node_of and self.node_of[client] != node and self.node_of[client] in nodes:
                log(WARNING, "nodes %d and %d both hold partition %d; using %d", self.node_of[client], node,
                    client, self.node_of[client])
                continue
            self.node_of[client] = node  # a restarted SuperNode comes back under a new node id
            del self._asked[reply.metadata.reply_to_message_id]
        return nodes

    def wait_for(self, count: int, timeout: float, least: int | None = None) -> None:
        """Block until `count` clients are known, asking at the directory's pace; after `timeout` seconds go on with
        `least` or more (default `count`: all), else raise a clear error."""
        deadline = time.monotonic() + timeout
        self.poll()
        while len(self.node_of) < count:
            if time.monotonic() >= deadline:
                if len(self.node_of) >= (count if least is None else least):
                    log(WARNING, "only %d of %d clients connected within %.0fs: going on without partitions %s",
                        len(self.node_of), count, timeout, sorted(set(range(count)) - set(self.node_of))[:LOGGED_NODES])
                    break
                raise RuntimeError(f"only {len(self.node_of)} of {count} clients connected within {timeout:.0f}s "
                                   f"(partitions {self.clients}); start more SuperNodes or raise wait-nodes-s")
            self.pace.wait()
            known = len(self.node_of)
            self.poll()
            if len(self.node_of) > known:
                self.pace.reset()
        shown = dict(sorted(self.node_of.items())[:LOGGED_NODES])
        rest = len(self.node_of) - len(shown)
        log(INFO, "%d clients connected: partition -> node %s%s", len(self.node_of), shown,
            f" and {rest} more" if rest else "")  # 50 000 clients would write a megabyte


@dataclass
class Dispatcher:
    """Builds train/evaluate messages from a strategy's payload, tagged with the model version.

    `run_config` holds what every message carries (data spec, model, the clients' local recipe, the strategy and
    the options its client side reads); a payload carries arrays, never keys. Each train message gets a seed derived
    from (run seed, client, how many times that client was dispatched): :meth:`next_seed`.
    """

    spec: ParamSpec
    run_config: dict[str, Any]
    seed: int
    dispatches: dict[int, int] = field(default_factory=dict)
    # The record of the last model sent, reused while messages carry that very tensor: the messages of one model
    # version share one copy of its bytes, so messages in the air cost a model per version, not per message.
    _last: tuple[torch.Tensor | None, ArrayRecord | None] = field(default=(None, None), repr=False)
    codecs: WireCodecs = field(init=False)  # the run's (the keys in run_config; none where it has none)
    # model-difference: the model each client's device holds (as a reply confirmed), and the one its message in the
    # air leaves it holding; a copy per client (common/codecs.py)
    held: OrderedDict[int, np.ndarray] = field(default_factory=OrderedDict, repr=False)  # least recently kept first
    held_limit: int = MAX_COUNT  # copies kept at most (``model-copies-mib``)
    _sending: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.codecs = make_options(WireCodecs, self.run_config)

    def next_seed(self, client: int) -> int:
        count = self.dispatches.get(client, 0)
        self.dispatches[client] = count + 1
        return derive_seed(self.seed, client, count)

    def model_nbytes(self, client: int | None, numel: int) -> int:
        """The bytes of the model's values in `client`'s next train message (None: an evaluate message's)."""
        difference = self.codecs.model_difference and client in self.held
        return encoded_nbytes(self.codecs.model_codec if difference else full_codec(self.codecs), numel, self.codecs)

    def settle(self, client: int, reply: Message | None) -> None:
        """`client`'s message is over: with a reply from its device (not an error), the device holds what the
        message carried; otherwise what it holds is unknown, and its next message carries the whole model."""
        sent = self._sending.pop(client, None)
        self.held.pop(client, None)
        if sent is not None and reply is not None and not reply.has_error():
            self.held[client] = sent
            while len(self.held) > self.held_limit:
                self.held.popitem(last=False)

    def message(self, node: int, payload: Payload, version: int, message_type: str = MessageType.TRAIN,
                train_seed: int | None = None, config: Mapping[str, Any] | None = None,
                client: int | None = None) -> Message:
        """The message to `node`; `config` adds a caller's own keys (a Flower ServerApp's evaluate config), which
        cannot change a run key: a clash is an error, not an override. With `client` and ``model-difference``, the
        model travels as the difference from the one that client's device holds (:meth:`settle` once it is over)."""
        config = dict(config or {})
        if clash := sorted(k for k, v in config.items() if k in self.run_config and self.run_config[k] != v):
            raise ValueError(f"a message's config cannot change the run's keys: {', '.join(clash)}")
        config.update(self.run_config)
        config[VERSION] = version
        if train_seed is not None:
            config[TRAIN_SEED] = train_seed
        if client is not None and self.codecs.model_difference:
            held = self.held.get(client)
            model = encode_model(payload.params.detach().cpu().numpy(), self.codecs, held)
            self._sending[client] = apply_difference(held, model, self.codecs)
            config[MODEL_BASE] = "" if held is None else model_digest(held)
        else:
            if self._last[0] is not payload.params:
                self._last = (payload.params, encode_model(payload.params.detach().cpu().numpy(), self.codecs))
            model = self._last[1]
        content = RecordDict({ARRAYS: model, CONFIG: ConfigRecord(config)})
        if payload.arrays:
            content[EXTRAS] = extras_to_record(payload.arrays)
        return Message(content, dst_node_id=node, message_type=message_type, group_id=str(version))
