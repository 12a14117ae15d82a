"""The runtime's two clocks through the in-process engine: determinism, the delay model, faults."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

from client_app.app import app as client_app
from common.protocol import ARRAYS, BASE_VERSION, CONFIG, METRICS, NUM_EXAMPLES, PARTITION_ID, VERSION
from hybridfl.engine.inprocess import InProcessGrid


def events(out) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wrap(train) -> ClientApp:
    """A ClientApp with `train` as its train handler and the real evaluate/query handlers."""
    app = ClientApp()
    app.train()(train)
    app.evaluate()(lambda msg, context: client_app(msg, context))
    app.query()(lambda msg, context: client_app(msg, context))
    return app


def zero_update(msg: Message, context: Context) -> Message:
    """An instant client: a zero delta, for tests of the runtime's bookkeeping only."""
    arrays = ArrayRecord({k: torch.zeros(v.shape) for k, v in msg.content[ARRAYS].items()})
    metrics = MetricRecord({NUM_EXAMPLES: 1, PARTITION_ID: context.node_config["partition-id"],
                            BASE_VERSION: msg.content[CONFIG][VERSION]})
    return Message(RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=msg)


ASYNC = {"strategy": "fedbuff", "delay-sigma": 5.0, "num-clients": 12, "clients-per-round": 3, "buffer-size": 3,
         "num-rounds": 12, "server-lr": 1.0}


def test_virtual_clock_same_seed_same_events_and_model(small_run):
    a, _ = small_run("a", **ASYNC)
    b, _ = small_run("b", **ASYNC)
    c, _ = small_run("c", **{**ASYNC, "seed": 1})
    key = lambda e: (e["client"], e["base-version"], e["dispatch-round"], e["round"], e["outcome"])
    assert [key(e) for e in events(a)] == [key(e) for e in events(b)]
    assert [key(e) for e in events(a)] != [key(e) for e in events(c)]
    assert digest(a / "model.pt") == digest(b / "model.pt") != digest(c / "model.pt")
    ev = events(a)
    assert any(e["staleness"] > 0 for e in ev)  # updates really arrive late
    assert all(e["round"] >= e["dispatch-round"] for e in ev)
    assert (a / "staleness.png").read_bytes()[:4] == b"\x89PNG"


def test_fedbuff_with_k_equal_n_and_no_delay_is_synchronous_fedavg(small_run):
    common = {"num-clients": 6, "clients-per-round": 4, "num-rounds": 4}
    fedavg, s1 = small_run("fedavg", strategy="fedavg", **common)
    fedbuff, s2 = small_run("fedbuff", strategy="fedbuff", **{"buffer-size": 4, "server-lr": 1.0,
                                                               "weighting": "examples", "delay-sigma": 0.0}, **common)
    assert digest(fedavg / "model.pt") == digest(fedbuff / "model.pt")
    assert s1["final-version"] == s2["final-version"] == 4


def test_observed_delays_follow_the_half_normal(small_run):
    sigma = 20.0
    out, summary = small_run("delays", client_app=wrap(zero_update), strategy="fedavg",
                             **{"num-clients": 100, "clients-per-round": 10, "delay-sigma": sigma, "num-rounds": 200,
                                "partitioner": "iid",
                                "eval-every": 1000})
    delays = np.array([e["round"] - e["dispatch-round"] for e in events(out)])
    assert len(delays) > 1000  # ~160 clients would be in flight: the 100 saturate, fewer than 10 idle per step
    assert abs(delays.mean() - sigma * math.sqrt(2 / math.pi)) < 0.1 * sigma * math.sqrt(2 / math.pi)
    assert (delays == 0).mean() < 0.05  # half-normal, not a point mass at zero
    assert summary["staleness-max"] > 30


def test_no_node_ever_has_two_messages_in_flight(small_run, monkeypatch):
    outstanding: dict[int, int] = defaultdict(int)
    push, pull = InProcessGrid.push_messages, InProcessGrid._execute

    def checked_push(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train":
                outstanding[m.metadata.dst_node_id] += 1
                assert outstanding[m.metadata.dst_node_id] == 1, "two train messages in flight to one node"
        return push(self, messages)

    def checked_execute(self, msg):
        if msg.metadata.message_type == "train":
            outstanding[msg.metadata.dst_node_id] -= 1
        return pull(self, msg)

    monkeypatch.setattr(InProcessGrid, "push_messages", checked_push)
    monkeypatch.setattr(InProcessGrid, "_execute", checked_execute)
    small_run("inflight", client_app=wrap(zero_update), **{**ASYNC, "delay-sigma": 10.0, "num-rounds": 30})


def test_failed_work_is_dispatched_again_to_an_idle_client(small_run):
    answered: dict[str, tuple[int, bool]] = {}  # message id: (client, answered with an update)

    def flaky(msg: Message, context: Context) -> Message:
        client = context.node_config["partition-id"]
        answered[msg.metadata.message_id] = (client, client not in (0, 1))
        if client in (0, 1):
            raise RuntimeError("device unavailable")
        return zero_update(msg, context)

    out, summary = small_run("flaky", client_app=wrap(flaky),
                             **{"num-clients": 8, "clients-per-round": 3, "num-rounds": 10, "strategy": "fedavg"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    # Each failure gets a replacement, so every step still merges 3 updates.
    assert all(r["accepted"] == 3 and r["sampled"] == 3 + r["failures"] for r in rows)
    assert summary["total-failures"] > 0 and summary["final-version"] == 10
    # every event names the train message it answers (as a device's own log does): each message once, its client's
    by_message = {e["message"]: e for e in events(out)}
    assert len(by_message) == len(events(out)) == len(answered)
    assert {m: (e["client"], e["outcome"] == "accepted") for m, e in by_message.items()} == answered


def test_wall_clock_runs_to_the_requested_steps(small_run):
    sent: list[str] = []

    def train(msg: Message, context: Context) -> Message:
        sent.append(msg.metadata.message_id)
        return zero_update(msg, context)

    out, summary = small_run("wall", client_app=wrap(train),
                             **{**ASYNC, "clock": "wall", "concurrency": 5, "delay-sigma": 0.0})
    # every train message has one fate: an event, or in flight when the run ended
    fates = [e["message"] for e in events(out)] + summary["in-flight-at-end"]
    assert sorted(fates) == sorted(set(fates)) and set(sent) <= set(fates) and summary["in-flight-at-end"]
    assert summary["final-version"] == 12  # 12 steps of 3 arrivals, FedBuff K = 3
    assert summary["total-accepted"] == 36
    assert summary["reply-to-dispatch-s"]["count"] >= 36
    latency = summary["reply-to-dispatch-s"]  # each part is within its whole, sample by sample, so the medians too
    assert 0 <= latency["hand-over-median"] <= latency["median"] and 0 <= latency["push-median"] <= latency["median"]
    assert latency["median"] <= latency["p95"] <= latency["p99"]
    assert summary["updates-per-s"] > 0


def test_losing_every_node_fails_with_a_clear_message(small_run):
    calls = []

    def vanishing(msg: Message, context: Context) -> Message:
        calls.append(context.node_id)
        if len(calls) > 6:  # after two steps of 3, every node that is asked goes away
            grid.disconnect(context.node_id)
            raise RuntimeError("node lost")
        return zero_update(msg, context)

    grid = InProcessGrid(wrap(vanishing), num_nodes=3)
    with pytest.raises(RuntimeError, match="no reachable client for 1s"):
        small_run("gone", grid=grid, **{"num-clients": 3, "clients-per-round": 3, "num-rounds": 10,
                                         "wait-nodes-s": 1.0})
    assert list(grid.get_node_ids()) == []


class SilentGrid(InProcessGrid):
    """Nodes that answer the server's queries but never a train message (a device that hangs in training): every
    dispatch times out."""

    def pull_messages(self, message_ids):
        return super().pull_messages([i for i in message_ids if i in self._pending
                                      and self._pending[i].metadata.message_type != MessageType.TRAIN])


@pytest.mark.parametrize("clock", ["virtual", "wall"])
def test_a_time_budget_ends_the_run_with_the_round_under_way_evaluated_and_saved(small_run, clock):
    """time-budget-s ends a run of 100 000 rounds after its budget, in the round under way: that round is the last
    line of metrics.jsonl, evaluated though eval-every never came, checkpointed, and the run ends with its summary."""
    run = {**ASYNC, "clock": clock, "num-rounds": 100_000, "eval-every": 100_000, "checkpoint-every": 100_000,
           "time-budget-s": 1.0, **({"concurrency": 3, "delay-sigma": 0.0} if clock == "wall" else {})}
    out, summary = small_run(clock, client_app=wrap(zero_update), **run)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 1 < rows[-1]["round"] < 100_000 and [r["round"] for r in rows if "test-accuracy" in r] == [
        0, rows[-1]["round"]]
    assert summary["train-seconds"] >= 1.0 and summary["final-version"] > 0
    assert (out / "checkpoint.pt").exists()
    from common.errors import ConfigError
    with pytest.raises(ConfigError, match="time-budget-s.*0 with loop = 'flower'"):
        small_run("flower", **{"loop": "flower", "time-budget-s": 5.0})


class StaleListGrid(InProcessGrid):
    """The node of the `victim`-th context goes away when its first train message is taken, yet stays in the node
    list (the SuperLink's list lags the node's end); each push to it records how many node lists had been read."""

    def __init__(self, *args, victim: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim, self.lists, self.gone, self.pushed_at = list(self.contexts)[victim], 0, False, []

    def get_node_ids(self):
        self.lists += 1
        return [*self.contexts, *([self.victim] if self.gone else [])]

    def push_messages(self, messages):
        messages = list(messages)
        self.pushed_at += [self.lists for m in messages if m.metadata.dst_node_id == self.victim
                           and m.metadata.message_type == MessageType.TRAIN]
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        due = [i for i in message_ids if i in self._pending]
        if not self.gone and any(self._pending[i].metadata.dst_node_id == self.victim
                                 and self._pending[i].metadata.message_type == MessageType.TRAIN for i in due):
            self.gone = True
            self.disconnect(self.victim)
        return super().pull_messages(message_ids)


def test_a_device_the_superlink_calls_unavailable_waits_for_a_fresh_node_list(small_run):
    """A node answered for as unavailable is not sent another message until a node list read after that failure
    lists it again (the wall clock re-reads the list at most every second: from its cached list a gone device got
    message after message, each failing at once, until the run's failure budget was spent)."""
    def slow(msg: Message, context: Context) -> Message:  # 60 updates on 3 nodes last 2 s at least: a refresh
        time.sleep(0.1)
        return zero_update(msg, context)

    grid = StaleListGrid(wrap(slow), num_nodes=4, victim=2)  # every idle client is kept busy: the victim is re-sent
    run = {**ASYNC, "num-clients": 4, "clients-per-round": 2, "buffer-size": 2, "num-rounds": 30, "clock": "wall",
           "concurrency": 4, "delay-sigma": 0.0, "max-failed-fraction": 1.0}
    _, summary = small_run("stale", grid=grid, **run)
    assert grid.gone and len(grid.pushed_at) >= 2 and summary["total-failures"] >= 1
    assert all(b > a for a, b in zip(grid.pushed_at, grid.pushed_at[1:])), grid.pushed_at


class LosingGrid(InProcessGrid):
    """A SuperLink restarted during the pushes numbered in `lose`: the messages are registered (and never
    answered: nobody asks for them), their objects refused, as Flower's HttpGrid raises it; `lost_train` the ids
    of the train messages so lost."""

    def __init__(self, *args, lose: set[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lose, self.calls, self.lost_train = lose, 0, []

    def push_messages(self, messages):
        self.calls += 1
        ids = list(super().push_messages(messages))
        if self.calls in self.lose:
            self.lost_train += [m.metadata.message_id for m in messages
                                if m.metadata.message_type == MessageType.TRAIN]
            raise ObjectPushError(ids[0], self._run.run_id, "a session the restarted SuperLink lost")
        return ids


def test_a_push_the_superlink_loses_is_pushed_again_and_the_run_ends_as_without_it(small_run, caplog):
    """Queries, train and evaluation messages whose push failed once or twice in a row are built and pushed again:
    the same events and model as the run without the failures, the lost train messages listed in `pushed-again` (a
    SuperLink may deliver one and a device answer it); a push refused three times ends the run naming it."""
    run = {**ASYNC, "num-rounds": 6}
    clean, clean_summary = small_run("clean", **run)
    calls = LosingGrid(client_app, num_nodes=12, lose=set())
    small_run("count", grid=calls, **run)
    n = calls.calls  # the last: the final federated evaluation's, pushed after 4 failed tries in the lossy run
    assert n > 6
    lose = {1, 3, 4, 6, n + 4}  # the first query, one train push twice, another, the final evaluation
    losing = LosingGrid(client_app, num_nodes=12, lose=lose)
    lost, lost_summary = small_run("lost", grid=losing, **run)
    key = lambda e: (e["client"], e["base-version"], e["dispatch-round"], e["round"], e["outcome"])
    assert [key(e) for e in events(lost)] == [key(e) for e in events(clean)]
    assert digest(lost / "model.pt") == digest(clean / "model.pt")
    untimed = lambda out: [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                           for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert untimed(lost) == untimed(clean)
    assert lost_summary["client-eval"] == clean_summary["client-eval"] is not None
    assert caplog.text.count("pushing them again") == len(lose)
    assert clean_summary["pushed-again"] == [] and len(losing.lost_train) >= 3  # pushes 3, 4 and 6 held train messages
    assert lost_summary["pushed-again"] == losing.lost_train
    assert not set(losing.lost_train) & {e["message"] for e in events(lost)}
    with pytest.raises(RuntimeError, match="refused the objects of 3 messages 3 times in a row"):
        small_run("refused", grid=LosingGrid(client_app, num_nodes=12, lose={4, 5, 6}), **run)


def test_a_run_whose_every_dispatch_times_out_fails_naming_the_timeouts(small_run):
    """Timeouts count against max-failed-fraction like failures: the run stops once clients-per-round dispatches
    have ended, all lost, instead of completing at model version 0."""
    with pytest.raises(RuntimeError, match=r"round \d+: 3 of the run's 3 dispatches failed, were rejected or timed out "
                                           r"\(3 timed out after reply-timeout-s = 0.2\).*no reply within 0s"):
        small_run("silent", grid=SilentGrid(client_app, num_nodes=3),
                  **{"num-clients": 3, "clients-per-round": 3, "num-rounds": 4, "reply-timeout-s": 0.2})


def test_a_run_that_accepts_no_update_fails_even_when_failures_are_allowed(small_run):
    """max-failed-fraction = 1 lets every dispatch fail along the way; a run that ends without a single accepted
    update still learned nothing, and fails saying so."""
    with pytest.raises(RuntimeError, match=r"the run accepted no update in 2 rounds \(0 failed, 0 rejected, 0 "
                                           r"unavailable at the SuperLink, \d+ timed "
                                           r"out"):
        small_run("silent", grid=SilentGrid(client_app, num_nodes=3),
                  **{"num-clients": 3, "clients-per-round": 3, "num-rounds": 2, "reply-timeout-s": 0.1,
                     "max-failed-fraction": 1.0})


class RestartedGrid(InProcessGrid):
    """A SuperLink that lost the first `lose` train messages pushed (a restart from its database before it had
    stored them): their replies are Flower's own "Message Unavailable", as the SuperLink itself answers them."""

    def __init__(self, *args, lose: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lose, self.lost = lose, []

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        trains = [i for i, m in zip(ids, messages, strict=True) if m.metadata.message_type == MessageType.TRAIN]
        self.lost += trains[:self.lose - len(self.lost)]
        return ids

    def pull_messages(self, message_ids):
        return [self._numbered(create_message_error_unavailable_ins_message(r.metadata.reply_to_message_id,
                                                                             self._run.run_id))
                if r.metadata.reply_to_message_id in self.lost else r for r in super().pull_messages(message_ids)]


def test_messages_the_superlink_lost_are_counted_apart_and_not_against_max_failed_fraction(small_run):
    """A SuperLink restart that loses a whole round's messages (3 of the run's first 3) does not end a run whose
    devices are fine: each is an ``unavailable`` event, counted in metrics.jsonl and the summary, left out of
    max-failed-fraction (0.5 here, which as failures they would pass: test below); the run goes on to its last
    round, other clients sampled in the lost ones' place."""
    run = {**ASYNC, "num-rounds": 6, "max-failed-fraction": 0.5}
    grid = RestartedGrid(client_app, num_nodes=12, lose=3)
    out, summary = small_run("restarted", grid=grid, **run)
    lost = [e for e in events(out) if e["outcome"] == "unavailable"]
    assert sorted(e["message"] for e in lost) == sorted(grid.lost) and len(grid.lost) == 3
    assert all("Message Unavailable" in e["reason"] for e in lost)
    assert summary["total-unavailable"] == 3 and summary["total-failures"] == 0
    assert summary["total-accepted"] >= 3 and summary["final-version"] >= 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 6 and sum(r["unavailable"] for r in rows) == 3
    fates = [e["message"] for e in events(out)] + summary["in-flight-at-end"]
    assert sorted(fates) == sorted(set(fates))  # each train message one fate, the lost ones too


def test_a_device_cannot_pass_its_failure_off_as_the_superlink_s_loss(small_run):
    """A device that answers with the SuperLink's error code (a broken or hostile one) is a failed update: its reply
    carries its own node, so it counts against max-failed-fraction and ends the run."""
    def posing(msg: Message, context: Context) -> Message:
        return Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, "Error: Message Unavailable"), reply_to=msg)

    with pytest.raises(RuntimeError, match=r"3 of the run's 3 dispatches failed.*Message Unavailable"):
        small_run("posing", client_app=wrap(posing), **{"num-clients": 3, "clients-per-round": 3, "num-rounds": 4,
                                                        "max-failed-fraction": 0.5})


def test_validation_split_is_evaluated_beside_the_test_split_and_summarised(small_run):
    out, summary = small_run(**{"validation-size": 20})
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "test-accuracy" in r]
    assert all("val-accuracy" in r and "val-loss" in r for r in evals)
    assert summary["val-max-last-5-evals"] == max(r["val-accuracy"] for r in evals[-5:])
    _, plain = small_run("plain")
    assert plain["val-max-last-5-evals"] is None


def test_default_run_folders_never_collide_and_named_ones_are_reused(tmp_path, monkeypatch):
    from server_app import outputs
    from server_app.config import load_config

    monkeypatch.setattr(outputs.time, "strftime", lambda fmt: "20261122-120000")  # all in the same second
    cfg = load_config({"preset": "feddle-animal/feddle-id-dir0.1-n20", "seed": 3, "output-dir": str(tmp_path)})
    names = [outputs.run_dir(cfg).name for _ in range(3)]
    base = "feddle-animal-feddle-id-dir0.1-n20-s3-20261122-120000"
    assert names == [base, f"{base}-2", f"{base}-3"]
    named = load_config({"run-name": "mine", "output-dir": str(tmp_path)})
    assert outputs.run_dir(named) == outputs.run_dir(named) == tmp_path / "mine"
    users = load_config({"preset": "tabular_task:presets/fedavg", "seed": 3, "output-dir": str(tmp_path)})
    assert outputs.run_dir(users).name == "tabular_task-presets-fedavg-s3-20261122-120000"  # a package:path preset
    own = load_config({"preset": "tabular_task:presets/fedavg", "strategy": "fedbuff", "seed": 3,
                       "output-dir": str(tmp_path)})
    assert outputs.run_dir(own).name == "fedbuff-breast_cancer-s3-20261122-120000"  # not the preset's method


def test_the_time_left_reads_in_the_largest_sensible_units():
    from server_app.run import duration

    assert [duration(s) for s in (0.4, 42, 60, 425, 3599.6, 7980)] == ["0s", "42s", "1m00s", "7m05s", "1h00m", "2h13m"]


def test_a_rounds_line_keeps_every_strategy_step_it_held(small_run):
    """FedAsync steps on every update: a round holds several steps, each kept in `steps` with the version it made
    and its own measures; the line's top is the last step's (the model the round ends with)."""
    out, summary = small_run("steps", strategy="fedasync", **{"delay-sigma": 1.0, "num-rounds": 6})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    steps = [s for r in rows for s in r["steps"]]
    assert [s["version"] for s in steps] == list(range(1, summary["final-version"] + 1))  # none lost, in order
    assert sum(len(r["steps"]) for r in rows) == sum(r["accepted"] for r in rows)  # one step per update
    several = [r for r in rows if len(r["steps"]) > 1]
    assert several and all(r["alpha-t"] == r["steps"][-1]["alpha-t"] for r in several)
    assert any(len({s["alpha-t"] for s in r["steps"]}) > 1 for r in several)  # per-update measures, not one copy


def test_a_server_trained_run_learns_without_a_client_update(small_run):
    """Center trains on the server's data alone: a run in which no client reply arrives (every dispatch still on
    its way) has still made a model each round, and completes; the same run of FedBuff made none, and fails."""
    job = {"num-rounds": 2, "delay-sigma": 50.0, "clients-per-round": 2, "central-size": 40}
    _, summary = small_run("center", strategy="center", **job)
    assert summary["final-version"] == 2 and summary["total-accepted"] == 0
    with pytest.raises(RuntimeError, match=r"the run accepted no update in 2 rounds .*still on its way"):
        small_run("fedbuff", strategy="fedbuff", **job)


class ForgetfulGrid(InProcessGrid):
    """Its first node drops the first query it is sent, as Flower's SuperNode drops a message whose objects it could
    not pull (never answering it); its second node answers its first query with no partition id (a broken device)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first, self.second = list(self.contexts)
        self.queries: list[int] = []

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for i in ids:
            node = self._pending[i].metadata.dst_node_id
            self.queries.append(node)
            if node == self.first and self.queries.count(node) == 1:
                del self._pending[i]
        return ids

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        for reply in replies:
            if reply.metadata.src_node_id == self.second and self.queries.count(self.second) == 1:
                del reply.content[METRICS][PARTITION_ID]
        return replies


def test_a_node_without_a_usable_answer_is_asked_again_once_its_query_s_time_is_up():
    """The node directory asks a node again when its query's answer is lost or refused, after `ask_again_s` and not
    sooner: both nodes are known after their second query, one query each before that time; never asking again,
    the wait for both fails naming the one that answered."""
    from server_app.wire import NodeDirectory

    grid = ForgetfulGrid(client_app, num_nodes=2)
    directory = NodeDirectory(grid, 2, ask_again_s=2.0)  # five polls take far less, on a loaded machine too
    started = time.monotonic()
    for _ in range(5):
        directory.poll()
    assert directory.clients == [] and sorted(grid.queries) == sorted([grid.first, grid.second])
    directory.wait_for(2, timeout=10.0)
    assert time.monotonic() - started >= 2.0 and directory.clients == [0, 1]
    assert sorted(grid.queries) == sorted([grid.first, grid.second] * 2)
    never = NodeDirectory(ForgetfulGrid(client_app, num_nodes=2), 2, ask_again_s=math.inf)
    with pytest.raises(RuntimeError, match=r"only 0 of 2 clients connected within 1s \(partitions \[\]\)"):
        never.wait_for(2, timeout=1.0)


def test_a_pull_that_brings_nothing_doubles_the_wait_up_to_the_longest_and_one_that_brings_a_reply_restores_it(
        monkeypatch):
    """The pace of pulls for replies: 0.05, 0.1, 0.2, then the longest (0.25) after pulls that bring nothing; the
    first wait again after one that brings something; a longest under the first is the first."""
    from server_app import wire

    slept: list[float] = []
    monkeypatch.setattr(wire.time, "sleep", slept.append)
    pace = wire.Pace(0.05, 0.25)
    for brought in (False, False, False, False, False, True, False, True, True, False):
        pace.after(brought)
    assert slept == [0.05, 0.1, 0.2, 0.25, 0.25, 0.05, 0.05]
    slept.clear()
    short = wire.Pace(0.5, 0.1)
    short.after(False)
    short.after(False)
    assert slept == [0.5, 0.5]


def test_a_directory_waiting_for_a_node_that_never_comes_asks_a_few_times_a_second_not_twenty():
    """Paced, a second's wait for a node that never answers is at most 7 pulls (waits of 0.05, 0.1, 0.2, 0.25, ...
    s: 1.1 s after six), where a steady 0.05 s made about 20, each a request the SuperLink answers."""
    from server_app.wire import NodeDirectory

    grid = ForgetfulGrid(client_app, num_nodes=2)
    pulls = []
    pull = grid.pull_messages
    grid.pull_messages = lambda ids: (pulls.append(1), pull(ids))[1]
    never = NodeDirectory(grid, 2, ask_again_s=math.inf)
    with pytest.raises(RuntimeError, match="only 0 of 2 clients connected within 1s"):
        never.wait_for(2, timeout=1.0)
    assert 2 <= len(pulls) <= 7


def test_collecting_replies_that_do_not_come_goes_at_the_pace_given_and_gives_them_up_at_the_timeout():
    """The evaluation's wait for replies (`collect`) pulls at the pace it is given (the run's): a second's wait for
    replies that never come is at most 7 pulls at the default pace (about 20 at the steady 0.05 s it had before); the
    replies not in by then are discarded."""
    from server_app.wire import Pace, collect

    class Silent:  # a ReplyPuller whose replies never arrive
        def __init__(self) -> None:
            self.pulls, self.discarded = 0, []

        def pull(self, pending):
            self.pulls += 1
            return []

        def discard(self, message_id):
            self.discarded.append(message_id)

    paced = Silent()
    assert collect(paced, ["a", "b"], 1.0, Pace()) == [] and sorted(paced.discarded) == ["a", "b"]
    assert 2 <= paced.pulls <= 7


def test_a_poll_counts_the_replies_in_hand_before_a_deadline_and_not_the_servers_own_pull_time(monkeypatch):
    """The wall clock's table of flights, on a fake clock: a flight is given up only when its deadline passed before
    the pull that asked for it (a pull that takes long is the server's time), and the flights of one poll arrive
    replies first, so a round closing on them counts the replies in hand (CI saw 5 given up close a round, and fail
    the run on max-failed-fraction, beside 10 replies pulled in the same poll)."""
    from types import SimpleNamespace

    from server_app import flights as F

    clock = [0.0]
    monkeypatch.setattr(F.time, "perf_counter", lambda: clock[0])

    class Puller:
        def __init__(self) -> None:
            self.answers: list[list[str]] = []
            self.discarded: list[str] = []

        def pull(self, ids: list[str]) -> list:
            clock[0] += 100.0  # a slow pull: past every deadline by its end
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in self.answers.pop(0)]

        def discard(self, message_id: str) -> None:
            self.discarded.append(message_id)

    table = F.Flights(F.Flight(seq=i, client=i, version=0, dispatch_round=1, due_round=-1, payload=None,
                               train_seed=0, message_id=m, sent_at=0.0) for i, m in enumerate("abc"))
    puller = Puller()
    puller.answers = [["c"], []]
    clock[0] = 10.0  # asked within the 60 s: nothing late, though the pull ends at 110 s
    assert table.poll(puller, 60.0) and [f.message_id for f in table.arrived()] == ["c"]
    assert puller.discarded == []
    assert table.poll(puller, 60.0)  # asked at 110 s: a and b are late now
    assert [f.message_id for f in table.arrived()] == ["c", "a", "b"]  # the reply first, then dispatch order
    assert puller.discarded == ["a", "b"] and table.replies["a"] is None and table.replies["c"] is not None
    assert not table.poll(puller, 60.0)  # nothing left to wait for
