"""flower_internals/replies.py: replies pulled so that one device's upload holds only its own reply, against a
SuperLink's Runtime API played by Flower's own message and object functions (the internals it relies on:
tests/test_flower_internals.py)."""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.app.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import PullObjectResponse  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesResponse  # pylint: disable=E0611
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.superlink.grid.http_grid import HttpGrid

from common.protocol import METRICS, PARTITION_ID
from flower_internals import replies
from flower_internals.replies import ReplyPuller
from server_app.wire import unavailable

DEVICE = 4242  # the replying device's node


class FakeLink:
    """A SuperLink's Runtime API holding replies; an object of `slow` becomes available after its `unavailable`
    pulls (an upload in progress), an object of `gone` is never found (its device stopped mid-upload)."""

    def __init__(self, replies_: dict[str, Message], slow: str = "", unavailable: int = 0, gone: str = "",
                 corrupt: str = "") -> None:
        self.replies, self.objects, self.owner = {}, {}, {}
        for reply_to, msg in replies_.items():
            msg.metadata.__dict__["_message_id"] = msg.object_id
            self.replies[reply_to] = (message_to_proto(msg), get_object_tree(msg))
            for oid, obj in get_all_nested_objects(msg).items():
                self.objects[oid] = obj.deflate()
                self.owner[oid] = reply_to
        self.slow, self.left, self.gone, self.corrupt, self.confirmed = slow, unavailable, gone, corrupt, []

    def PullMessages(self, request):
        # Flower 1.42's field, or the 1.43 development line's (replies.pull_request sends the one this Flower has)
        nightly = "reply_to_message_ids" in request.DESCRIPTOR.fields_by_name
        ids = request.reply_to_message_ids.vals if nightly else request.message_ids
        found = [self.replies.pop(i) for i in ids if i in self.replies]  # handed out once
        return PullAppMessagesResponse(messages_list=[p for p, _ in found],
                                       message_object_trees=[t for _, t in found])

    def PullObject(self, request):
        owner = self.owner[request.object_id]
        if owner == self.gone:
            return PullObjectResponse(object_found=False, object_available=False)
        if owner == self.slow and self.left > 0:
            self.left -= 1
            return PullObjectResponse(object_found=True, object_available=False)
        content = b"\x00garbage" if owner == self.corrupt else self.objects[request.object_id]
        return PullObjectResponse(object_found=True, object_available=True, object_content=content)

    def ConfirmMessageReceived(self, request):
        self.confirmed.append(request.message_object_id)


def grid_on(link: FakeLink) -> HttpGrid:
    grid = HttpGrid.__new__(HttpGrid)  # no connection: the fake link answers
    grid._client, grid.node = link, Node(node_id=SUPERLINK_NODE_ID)
    grid._run = type("Run", (), {"run_id": 7})()
    return grid


def reply(reply_to: str, value: float) -> Message:
    content = RecordDict({"arrays": ArrayRecord([np.full(3, value, dtype=np.float32)])})
    metadata = Metadata(run_id=7, message_id="", src_node_id=DEVICE, dst_node_id=SUPERLINK_NODE_ID,
                        reply_to_message_id=reply_to,
                        group_id="", ttl=3600.0, message_type="train", created_at=time.time())
    return make_message(metadata=metadata, content=content)


def collect(puller: ReplyPuller, ids: list[str], until: int, timeout: float = 10.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < until and time.monotonic() < deadline:
        got += puller.pull(ids)
        time.sleep(0.01)
    return got


def test_a_reply_still_uploading_holds_only_itself(monkeypatch) -> None:
    monkeypatch.setattr(replies, "BACKOFF_CAP_S", 0.05)
    link = FakeLink({"a": reply("a", 1.0), "b": reply("b", 2.0)}, slow="a", unavailable=40)  # a: ~2 s uploading
    puller = ReplyPuller(grid_on(link))
    first = collect(puller, ["a", "b"], until=1)
    assert [m.metadata.reply_to_message_id for m in first] == ["b"]  # b's objects were in: b did not wait for a
    assert float(first[0].content["arrays"].to_numpy_ndarrays()[0][0]) == 2.0
    second = collect(puller, ["a", "b"], until=1)
    assert [m.metadata.reply_to_message_id for m in second] == ["a"] and link.left == 0
    assert float(second[0].content["arrays"].to_numpy_ndarrays()[0][0]) == 1.0
    assert sorted(link.confirmed) == sorted(m.metadata.message_id for m in first + second)  # each receipt confirmed
    assert puller.pull(["a", "b"]) == []  # the SuperLink handed each reply out once


def test_a_reply_whose_objects_are_gone_is_flowers_error_reply_and_not_confirmed() -> None:
    link = FakeLink({"a": reply("a", 1.0), "b": reply("b", 2.0)}, gone="a")
    got = {m.metadata.reply_to_message_id: m for m in collect(ReplyPuller(grid_on(link)), ["a", "b"], until=2)}
    assert got["a"].has_error() and got["a"].error.code == ErrorCode.MESSAGE_UNAVAILABLE
    # the device's failure, not a message the SuperLink lost: it counts against max-failed-fraction
    assert got["a"].metadata.src_node_id == DEVICE and not unavailable(got["a"])
    assert not got["b"].has_error() and link.confirmed == [got["b"].metadata.message_id]


def test_a_reply_whose_objects_do_not_inflate_is_an_error_reply_not_an_exception() -> None:
    """A broken or hostile device's objects: the puller answers Flower's error for that message (the runtime counts
    a failed update) and hands the other reply over; nothing raises into the server."""
    link = FakeLink({"a": reply("a", 1.0), "b": reply("b", 2.0)}, corrupt="a")
    got = {m.metadata.reply_to_message_id: m for m in collect(ReplyPuller(grid_on(link)), ["a", "b"], until=2)}
    assert got["a"].has_error() and got["a"].error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert "could not be pulled" in got["a"].error.reason and not unavailable(got["a"])
    assert not got["b"].has_error() and link.confirmed == [got["b"].metadata.message_id]


def test_a_discarded_flights_reply_is_never_handed_over(monkeypatch) -> None:
    monkeypatch.setattr(replies, "BACKOFF_CAP_S", 0.05)
    link = FakeLink({"a": reply("a", 1.0)}, slow="a", unavailable=5)
    puller = ReplyPuller(grid_on(link))
    assert puller.pull(["a"]) == []  # handed out by the SuperLink, downloading
    puller.discard("a")  # the runtime gave its flight up
    time.sleep(0.5)
    assert puller.pull(["a"]) == []
    puller.close()


def test_another_grid_is_pulled_by_its_own_pull_messages() -> None:
    class Own:
        def pull_messages(self, ids):
            return [f"reply to {i}" for i in sorted(ids)]

    assert ReplyPuller(Own()).pull(["x", "y"]) == ["reply to x", "reply to y"]


def answer(reply_to: str, partition: int) -> Message:
    """A node's answer to the directory's query: the partition it holds."""
    metadata = Metadata(run_id=7, message_id="", src_node_id=DEVICE, dst_node_id=SUPERLINK_NODE_ID,
                        reply_to_message_id=reply_to,
                        group_id="", ttl=3600.0, message_type=MessageType.QUERY, created_at=time.time())
    return make_message(metadata=metadata, content=RecordDict({METRICS: MetricRecord({PARTITION_ID: partition})}))


def test_the_directory_takes_each_answer_as_it_comes_and_waits_for_one_on_its_way(monkeypatch) -> None:
    """Two nodes asked which partition they hold, node 11's answer still uploading: node 12's is taken at once,
    node 11 is not asked again while its answer comes (even with `ask_again_s` 0, which asks again at every poll a
    node whose answer is not on its way), then both are known, one query each; queries are not counted as the
    devices' update bytes."""
    from flwr.supercore.task_identity import TaskIdentity

    from server_app.wire import NodeDirectory, Pace

    for name, value in (("_task_id", 1), ("_run_id", 7), ("_node_id", 0)):  # a ServerApp's task, run, node
        monkeypatch.setattr(TaskIdentity, name, value)
    monkeypatch.setattr(replies, "BACKOFF_CAP_S", 0.05)
    link = FakeLink({"q11": answer("q11", 0), "q12": answer("q12", 1)}, slow="q11", unavailable=20)
    asked: list[int] = []

    class Grid(HttpGrid):
        def get_node_ids(self):
            return [11, 12]

        def push_messages(self, messages):
            asked.extend(m.metadata.dst_node_id for m in messages)
            return [f"q{m.metadata.dst_node_id}" for m in messages]

    grid = Grid.__new__(Grid)
    grid._client, grid.node, grid._run = link, Node(node_id=SUPERLINK_NODE_ID), type("Run", (), {"run_id": 7})()
    directory = NodeDirectory(grid, 2, ask_again_s=0.0, pace=Pace(0.01, 0.01))
    deadline = time.monotonic() + 10
    while directory.clients != [1] and time.monotonic() < deadline:
        directory.poll()
    assert directory.clients == [1] and directory.replies.downloading("q11")
    directory.wait_for(2, timeout=10)
    assert directory.node_of == {0: 11, 1: 12} and sorted(asked) == [11, 12] and link.left == 0
    assert directory.replies.pulled_replies == 0


def test_a_flights_fate_is_checked_device_first_and_names_how_each_lost_update_was_lost() -> None:
    """`flights.fate`, each outcome alone and in the order it is decided: a device that went offline before its
    message completed loses the update whatever came back; no reply is a timeout; the SuperLink's own word that it
    lost the message is `unavailable`, the same code from a device is the device's `failure`; a reply `read` refuses
    is `rejected` (an update the strategy cannot use too), and only a clean one is accepted, as `read` made it."""
    from flwr.app import Error

    from server_app.flights import Flight, fate
    from server_app.wire import RejectedReply
    from strategies.base import Unusable

    def error_from(node: int, code: int) -> Message:
        metadata = Metadata(run_id=7, message_id="", src_node_id=node, dst_node_id=SUPERLINK_NODE_ID,
                            reply_to_message_id="m", group_id="", ttl=3600.0, message_type="train",
                            created_at=time.time())
        return make_message(metadata=metadata, error=Error(code=code, reason="gone"))

    def read(msg: Message) -> float:  # as the runner's parse: an error reply or a bad value raises RejectedReply
        if msg.has_error():
            raise RejectedReply(f"error reply (code {msg.error.code})")
        value = float(msg.content["arrays"].to_numpy_ndarrays()[0][0])
        if value < 0:
            raise RejectedReply("negative")
        if value > 10:
            raise Unusable("too large for this strategy")
        return value

    flight = Flight(seq=0, client=3, version=1, dispatch_round=0, due_round=-1, payload=None, train_seed=0,
                    device_done=5.0)
    offline = Flight(**{**flight.state(), "device_off": 4.0})
    assert fate(offline, reply("m", 1.0), 30, read)[:2] == (None, "vanished")
    assert "offline at device time 4.0s" in fate(offline, None, 30, read)[2]
    assert fate(flight, None, 30, read) == (None, "timeout", "no reply within 30s")
    lost = fate(flight, error_from(SUPERLINK_NODE_ID, ErrorCode.REPLY_MESSAGE_UNAVAILABLE), 30, read)
    assert lost == (None, "unavailable", "the SuperLink: gone")
    assert fate(flight, error_from(DEVICE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE), 30, read)[:2] == (None, "failure")
    assert fate(flight, error_from(DEVICE, ErrorCode.CLIENT_APP_RAISED_EXCEPTION), 30, read)[:2] == (None, "failure")
    assert fate(flight, reply("m", -1.0), 30, read) == (None, "rejected", "negative")
    assert fate(flight, reply("m", 11.0), 30, read) == (None, "rejected", "too large for this strategy")
    assert fate(flight, reply("m", 2.0), 30, read) == (2.0, "accepted", "")
