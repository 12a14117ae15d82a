"""Messages to and from Flower's SuperLink: replies pulled so that one device's upload holds only its own reply,
messages pushed again when the SuperLink loses their push.

Flower 1.42's ``Grid.pull_messages`` (flwr/superlink/grid/http_grid.py) asks the SuperLink for the replies it holds
(the SuperLink hands each reply out once and forgets it) and then pulls each reply's objects in turn, every missing
object retried after 1 s, doubling to 10 s, for up to 500 tries or two hours. A SuperNode registers its reply before
it uploads the reply's objects, so a reply still uploading holds every other reply of that call: on a narrow link
for the seconds of its upload plus the backoff's overshoot; from a device switched off mid-upload until the
SuperLink's object session expires (measured: 185 s, BENCHMARKS "A heterogeneous fleet"). :class:`ReplyPuller` takes
the same steps with each reply's objects pulled in a thread of its own, retried from 50 ms doubling to 0.5 s (longer
when many are downloading: :data:`UNAVAILABLE_ASKS_PER_S`): a
reply is handed over as soon as its own objects are in, and a reply whose objects never come is Flower's own error
reply (``MESSAGE_UNAVAILABLE``) once the SuperLink drops them or :data:`MAX_WAIT_S` passes; so is a reply
whose objects do not inflate (a broken or hostile device's), counted by the runtime as a failed update.

:func:`push`: ``Grid.push_messages`` registers the messages, then uploads their objects in a push session; a
SuperLink killed and restarted from its database during that upload answered an upload with "stored: false"
(most likely one stored but not acknowledged before the kill), and Flower raised ``ObjectPushError`` out of the
ServerApp (seen once on the engine test's SuperLink restart). The messages are built and pushed again: a new
session, new message ids.

Flower internals it uses (:data:`RELIES_ON` and :func:`check`, run by tests/test_flower_internals.py, which fails
naming the one that moved): ``HttpGrid._runtime_client`` (``PullMessages``, ``PullObject``,
``ConfirmMessageReceived``), ``HttpGrid._run``, ``HttpGrid.node``, the ServerAppIo requests, and
``flwr.supercore.inflatable``'s object functions and errors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from logging import WARNING
from typing import Any

from flwr.app import Message, MessageType, Metadata
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
from flwr.supercore.date import now
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    ObjectPushError,
    ObjectUnavailableError,
    inflate_object_from_contents,
)
from flwr.superlink.grid.http_grid import HttpGrid

RELIES_ON = ("flwr.app.message:make_message", "flwr.proto.message_pb2:ConfirmMessageReceivedRequest",
             "flwr.proto.runtime_pb2:PullAppMessagesRequest", "flwr.supercore.constant:SYSTEM_MESSAGE_TYPE",
             "flwr.supercore.date:now", "flwr.supercore.inflatable.inflatable_object:iterate_object_tree",
             "flwr.supercore.inflatable.inflatable_protobuf_utils:make_pull_object_fn_protobuf",
             "flwr.supercore.inflatable.inflatable_utils:ObjectPullError",
             "flwr.supercore.inflatable.inflatable_utils:ObjectPushError",
             "flwr.supercore.inflatable.inflatable_utils:ObjectUnavailableError",
             "flwr.supercore.inflatable.inflatable_utils:inflate_object_from_contents",
             "flwr.superlink.grid.http_grid:HttpGrid", "flwr.proto.recorddict_pb2:StringList")

INITIAL_BACKOFF_S, BACKOFF_CAP_S = 0.05, 0.5  # an object still uploading is asked for again this soon ...
# ... while the downloads together ask at most this often a second: the SuperLink's one loop also serves the fleet
# (a thousand nodes' queries, their answers uploading through a busy edge, would otherwise ask 2000 times a second)
UNAVAILABLE_ASKS_PER_S = 50.0
# Requests of all downloads in flight at once: they share Flower's Runtime API client (one pool of 100 connections)
# with the ServerApp's heartbeat, which a SuperLink fails a run without for 60 s; a thousand answers at once must
# not hold every connection
ASKS_AT_ONCE = 8
MAX_WAIT_S = 600.0  # an object not in by then is given up (Flower's own pull waits up to two hours)
PUSH_ATTEMPTS = 3  # a push whose session the SuperLink lost, tried this often (a restart takes one)


def push(grid: Grid, build: Callable[[], list[Message]], attempts: int = PUSH_ATTEMPTS,
         abandoned: list[str] | None = None) -> list[str]:
    """The ids of `build()`'s messages pushed to the SuperLink. A push whose objects the SuperLink refuses
    (``ObjectPushError``: its push session lost with a restart) is built and pushed again, up to `attempts` times
    in all: fresh messages, because a message's id is its content's hash and the same message cannot be stored
    twice. The messages a failed push registered are left to the SuperLink; where it had stored all of their
    objects before it lost the session, it still delivers them and a device may answer one, a reply nobody pulls:
    their ids are appended to `abandoned`, so that every message sent can be accounted for."""
    attempt = 1
    while True:
        msgs = build()
        try:
            return list(grid.push_messages(msgs))
        except ObjectPushError as err:
            if abandoned is not None:  # Flower sets each message's id before it pushes any
                abandoned.extend(m.metadata.message_id for m in msgs if m.metadata.message_id)
            if attempt == attempts:
                raise RuntimeError(f"the SuperLink refused the objects of {len(msgs)} messages {attempts} times "
                                   f"in a row: {err}") from err
            attempt += 1
            log(WARNING, "pushing %d messages failed (%s); pushing them again (attempt %d of %d)", len(msgs), err,
                attempt, attempts)


def pull_request(reply_to: list[str]) -> PullAppMessagesRequest:
    """The ServerAppIo request for the replies to `reply_to`: Flower 1.42's ``message_ids``, or, on the 1.43
    development line (benchmarks compare it, BENCHMARKS "A thousand devices"), its ``reply_to_message_ids`` list."""
    if "reply_to_message_ids" in PullAppMessagesRequest.DESCRIPTOR.fields_by_name:
        from flwr.proto.recorddict_pb2 import StringList  # pylint: disable=E0611

        return PullAppMessagesRequest(reply_to_message_ids=StringList(vals=reply_to))
    return PullAppMessagesRequest(message_ids=reply_to)


class ReplyPuller:
    """``pull(message_ids)``: the replies to `message_ids` whose objects are all in; the others keep downloading,
    each in a daemon thread of its own, for a later call (:meth:`discard` a message given up). For a grid that is not
    Flower's ``HttpGrid`` (the in-process engine's), its own ``pull_messages``."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self._http = isinstance(grid, HttpGrid)
        self._downloading: dict[str, Future[Message]] = {}  # by the id of the message replied to
        self._stop = threading.Event()  # this run's downloads end at their next retry once it is set
        # train replies whose objects were all pulled, and those objects' bytes as the SuperLink stored them: what
        # the devices sent over the wire (the runtime reads it per round)
        self.pulled_replies, self.pulled_bytes = 0, 0
        self._count = threading.Lock()
        self._asking = threading.BoundedSemaphore(ASKS_AT_ONCE)

    def pull(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        if not self._http:
            return list(self.grid.pull_messages(wanted))
        asked = sorted(wanted - set(self._downloading))
        if asked:
            res = self.grid._runtime_client.PullMessages(pull_request(asked))
            for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
                future: Future[Message] = Future()
                self._downloading[proto.metadata.reply_to_message_id] = future
                threading.Thread(target=self._download, args=(proto, tree, future, self._stop), name="reply-pull",
                                 daemon=True).start()
        done = [reply_to for reply_to in wanted & set(self._downloading) if self._downloading[reply_to].done()]
        return [self._downloading.pop(reply_to).result() for reply_to in done]

    def downloading(self, message_id: str) -> bool:
        """Whether the SuperLink listed the reply to `message_id` and its objects are still coming."""
        return message_id in self._downloading

    def discard(self, message_id: str) -> None:
        """Forget the reply to `message_id` (its flight was given up): its download is left to end by itself."""
        self._downloading.pop(message_id, None)

    def close(self) -> None:
        """Stop every download of this run (each ends at its next retry); later pulls start afresh."""
        self._stop.set()
        self._stop = threading.Event()

    def _bounded(self, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`call` made while at most :data:`ASKS_AT_ONCE` of this puller's requests are in flight."""
        def bounded(arg: Any) -> Any:
            with self._asking:
                return call(arg)
        return bounded

    def _download(self, proto: Any, tree: Any, future: Future[Message], stop: threading.Event) -> None:
        """One reply's objects pulled (as Flower's pull_messages does, each retried with a shorter backoff), its
        receipt confirmed, the message inflated. Whatever fails (objects never uploaded, objects a device made that
        do not inflate, the SuperLink gone) is Flower's error reply for that message, sent as from the reply's own
        sender, so that the runtime counts a failed update (not a message the SuperLink lost:
        :func:`server_app.wire.unavailable`): a download never raises into the server."""
        grid, reply_to = self.grid, proto.metadata.reply_to_message_id
        run_id = grid._run.run_id
        try:
            msg_id = proto.metadata.message_id
            pull = self._bounded(make_pull_object_fn_protobuf(pull_object_protobuf=grid._runtime_client.PullObject,
                                                              node=grid.node, run_id=run_id))
            contents: dict[str, bytes] = {}
            deadline = time.monotonic() + MAX_WAIT_S
            for object_id in (t.object_id for t in iterate_object_tree(tree)):
                delay = INITIAL_BACKOFF_S
                while object_id not in contents:
                    try:
                        contents[object_id] = pull(object_id)
                    except ObjectUnavailableError:
                        if time.monotonic() > deadline or stop.wait(delay):
                            raise ObjectPullError(object_id, "not uploaded in time") from None
                        delay = min(2 * delay, max(BACKOFF_CAP_S, len(self._downloading) / UNAVAILABLE_ASKS_PER_S))
            if proto.metadata.message_type == MessageType.TRAIN:
                with self._count:
                    self.pulled_replies += 1
                    self.pulled_bytes += sum(len(c) for c in contents.values())
            message = inflate_object_from_contents(msg_id, contents)
            message.metadata.__dict__["_message_id"] = msg_id
            self._bounded(grid._runtime_client.ConfirmMessageReceived)(
                ConfirmMessageReceivedRequest(node=grid.node, run_id=run_id, message_object_id=msg_id))
        except Exception as err:  # noqa: BLE001 - any failure is this reply's, counted by the runtime
            message = make_message(
                metadata=Metadata(run_id=run_id, message_id="", src_node_id=proto.metadata.src_node_id,
                                  dst_node_id=grid.node.node_id, message_type=SYSTEM_MESSAGE_TYPE, group_id="",
                                  ttl=0, reply_to_message_id=reply_to, created_at=now().timestamp()),
                error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                            reason=f"the reply could not be pulled from the SuperLink ({type(err).__name__}: "
                                   f"{err})"))
        future.set_result(message)


def check() -> list[str]:
    """What :data:`RELIES_ON` cannot say: the attributes HttpGrid sets (each message's id, before its push), the
    arguments of the object pull function, the Runtime API client's calls; one line per thing that moved."""
    import inspect

    from flwr.supercore.inflatable import inflatable_protobuf_utils

    source = inspect.getsource(HttpGrid)
    moved = [f"HttpGrid no longer sets {attr!r}" for attr in ("def _runtime_client(self)", "self.node =",
                                                                "self._run = run") if attr not in source]
    pushed = inspect.getsource(HttpGrid.push_messages)  # push() reads a failed push's ids from its messages
    sets_id, pushes = pushed.find('msg.metadata.__dict__["_message_id"]'), pushed.find("_try_push_messages")
    if not 0 <= sets_id < pushes:
        moved.append("HttpGrid.push_messages no longer sets each message's id before it pushes")
    params = set(inspect.signature(inflatable_protobuf_utils.make_pull_object_fn_protobuf).parameters)
    if params != {"pull_object_protobuf", "node", "run_id"}:
        moved.append(f"make_pull_object_fn_protobuf takes {sorted(params)}")
    client = HttpGrid.__init__.__globals__.get("RuntimeHttpClient")
    moved += [f"RuntimeHttpClient.{name} is gone" for name in ("PullMessages", "PullObject", "ConfirmMessageReceived")
              if not hasattr(client, name)]
    return moved
