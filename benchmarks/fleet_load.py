"""A thousand devices on one SuperLink (issue 69): a fleet load generator, the load it holds, what it costs.

    python -m benchmarks.fleet_load --devices N --minutes M [--processes P] [--concurrency C] [--database]
                                    [--idle-s S] [--heartbeat-s H] [--no-edge] [--fault KIND@SECONDS ...]
                                    [--resume-steps K] [--dataset digits|fashion-mnist] [--workdir DIR]

Starts on loopback a SuperLink with the compose file's security (TLS with a private CA, SuperNode authentication,
process isolation; Flower's in-memory state, or SQLite with ``--database``), the edge in front of it (nginx,
hybridfl/launch/edge, sized for N devices), registers N device keys through the Control API, and runs hybridfl's
ServerApp (``flwr run``, its SuperExec) with FedBuff on the wall clock for M minutes (``time-budget-s``) while N
devices, in P processes of this module, answer it.

Each device is a real Fleet API client: Flower 1.42's own transport (``http_request_response``: HTTPS through the
edge, its own registered key signing every request, its heartbeat thread), and Flower's SuperNode's pacing (a pull
every 3 s while idle, at once after a reply: ``flower-supernode``'s loop, the load a stock fleet makes). A message
is answered by hybridfl's own ClientApp, in the device's process (no SuperExec or process per message: the load is
the protocol, not the device's runtime): the papers' CNN on scikit-learn's digits (188 k parameters), trained for
real; a fleet larger than digits' 1438 training samples takes ``--dataset fashion-mnist``, LeNet-5 on Fashion-MNIST
(164 k parameters: messages of about the same size, 56 000 training samples). A device's loop
ends by itself at the end of the run's time (and a grace), every wait in it is bounded.

Printed (and written to <workdir>/figures.json): updates accepted per second, the ServerApp's reply→dispatch latency
(p50, p99: the runtime's own, summary.json), the devices' pull latency (p50, p99 of every Fleet ``PullMessages``),
CPU (mean, % of one core), peak RSS and RSS growth per hour over training (from :data:`TRAIN_WARM_UP_S` after the
first update event to the last) of the SuperLink, the ServerApp and the edge, and the devices' replies against
the run's outcomes, reconciled by message id. With ``--resume-steps K`` the run, once completed, is resumed from its
checkpoint for K more steps on the same SuperLink and devices, as ``hybridfl resume`` would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from cryptography.hazmat.primitives import serialization
from flwr.app import Context, RecordDict
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    iterate_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import (
    inflate_object_from_contents,
    pull_objects,
    push_object_contents_from_iterable,
)
from flwr.supernode import fleet_http_connection
from flwr.supernode.fleet_http_connection import http_request_response

from client_app.app import app
from common.config import ConfigError
from common.splits import check_partitions, data_spec
from flower_internals import supernode
from flower_internals.control import register_keys
from hybridfl.launch import edge
from hybridfl.launch.deploy_local import superexec
from hybridfl.launch.flwr_cli import check_completed, flwr_run, run_status, write_connection
from hybridfl.launch.job import prepare
from hybridfl.launch.processes import flower_env
from server_app.evaluation import EVAL_WAVE
from tools import hostile_client

CONNECTION = "fleet-load"
IDLE_S = 3.0  # flower-supernode's wait after a pull that found nothing (--idle-s: a fleet paced slower)
RAMP_S = 30.0  # the devices start spread over this long, at least (a fleet does not connect in one instant) ...
RAMP_S_PER_DEVICE = 0.1  # ... and at most 10 a second: 1000 at once left activations unanswered for 30 s
RECONNECT_S = 10.0  # a device whose connection failed tries again after this long
# a SuperLink saturated by devices connecting left the operator's `flwr ls` unanswered for 30 s (1000 devices) while
# its run went on: the load generator waits this long before it calls the SuperLink gone
UNREACHABLE_S = 300.0
# a resumed run's bound past its query phase and its evaluation (--resume-steps: a few steps); devices gone for
# good keep it waiting the whole wait-nodes-s before it goes on without them
RESUME_S = 600.0
# devices keep answering this long past the run's time: its last round, and its evaluation on every client (in
# waves of EVAL_WAVE, each picked up within a device's idle wait): 1000 devices gone after 120 s left its waves to
# time out one by one
GRACE_S = 120.0
GRACE_S_PER_WAVE = 15.0
SAMPLE_S = 1.0
PROBE_TIMEOUT_S = 30.0  # Flower's ServerApp gives a heartbeat call as long (ProtobufClient's timeout)
STOP = threading.Event()  # a worker's devices leave (their nodes deactivated) once it is set: SIGTERM
# hybridfl's ClientApp keeps its task (data, model) per process between messages (client_app/work.py), as a device
# does: a process's devices run it one at a time
CLIENT_APP = threading.Lock()
# FedBuff on the wall clock, as the digits preset, for a fleet: every device one partition of digits, C updates
# in flight, a step every C/2 arrivals; the run fails past the product's default max-failed-fraction (0.8): at 0.5
# a SuperLink restart under CI's load, catching the first round's 10 messages with 2 accepted, ended the run
RUN = {"preset": "fedbuff-digits", "clock": "wall", "delay-sigma": 0.0, "partitioner": "iid", "local-epochs": 1,
       "num-rounds": 10**9, "eval-every": 50, "wait-nodes-s": 600.0}
# --dataset: the task every device trains; a model of about the digits CNN's size, so that a message weighs the same
DATASETS = {"digits": {}, "fashion-mnist": {"dataset": "fashion-mnist", "model": "lenet"}}
# the processes' memory growth is stated over training, from this long after its first update event: the query
# phase (every device describing itself) and the first steps fill caches a steady state keeps
TRAIN_WARM_UP_S = 300.0
REPLY_TIMEOUT_S = 120.0


# -- a device ---------------------------------------------------------------------------------------------------

class Record:
    """A worker process's log: one JSON line per device event (connected, replied, failed), and every pull's
    latency, written at the end."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock, self.pulls = path, threading.Lock(), []
        self.out = path.open("a", buffering=1)

    def event(self, **fields: Any) -> None:
        with self.lock:
            self.out.write(json.dumps({"t": round(time.time(), 4), **fields}) + "\n")

    def close(self) -> None:
        with self.lock:
            self.out.close()
        self.path.with_suffix(".pulls.npy").write_bytes(np.asarray(self.pulls, dtype=np.float32).tobytes())


class Unreachable(Exception):
    """Flower's connection gave up (where a SuperNode would exit its process)."""


def _unreachable(code: int, message: str | None = None, **_: Any) -> None:
    raise Unreachable(f"exit code {code}: {message}")


def device(i: int, n: int, address: str, ca: bytes, key: Path, until: float, record: Record,
           idle_s: float = IDLE_S) -> None:
    """Device `i` of `n` (partition i), the holder of `key`: connected (again, after :data:`RECONNECT_S`, whenever
    its connection fails) and answering messages until `until`."""
    private = serialization.load_ssh_private_key(key.read_bytes(), None)
    keys = (private, private.public_key())
    while time.time() < until and not STOP.is_set():
        try:
            serve(i, n, address, ca, keys, until, record, idle_s)
            reason = "the connection ended (Flower logged why)"  # its context swallows an error in the loop
        except Exception as err:  # noqa: BLE001 - a device that lost the SuperLink tries again, counted
            reason = f"{type(err).__name__}: {err}"[:300]
        if time.time() < until and not STOP.is_set():
            record.event(device=i, event="disconnected", reason=reason)
            STOP.wait(RECONNECT_S)


def serve(i: int, n: int, address: str, ca: bytes, keys: tuple[Any, Any], until: float, record: Record,
          idle_s: float) -> None:
    """One connection of device `i`: Flower's SuperNode loop (`idle_s` after a pull that found nothing), its
    ClientApp run here."""
    with http_request_response(address, False, ca, authentication_keys=keys, max_wait_time=until - time.time()) as (
            node_id, receive, send, _, _, pull_object, push_object, confirm):
        record.event(device=i, event="connected", node=node_id)
        context = Context(run_id=0, node_id=node_id, node_config={"partition-id": i, "num-partitions": n},
                          state=RecordDict(), run_config={})
        while time.time() < until and not STOP.is_set():
            asked = time.monotonic()
            got = receive()
            record.pulls.append(time.monotonic() - asked)
            if got is None:
                STOP.wait(max(0.0, min(idle_s, until - time.time())))
                continue
            message, tree = got
            run_id, msg_id = message.metadata.run_id, message.metadata.message_id
            stage = "pull"  # then "train", then "push" once the SuperLink registered the reply
            try:
                # as long as Flower's SuperNode waits (PULL_MAX_TIME: 2 h) within the device's time: a query's
                # objects came after 60 s at 300 devices (the ServerApp uploads a message's objects after it lists it)
                contents = pull_objects([t.object_id for t in iterate_object_tree(tree)],
                                        partial(pull_object, run_id), max_time=max(1.0, until - time.time()))
                message = inflate_object_from_contents(msg_id, contents)
                message.metadata.__dict__["_message_id"] = msg_id
                confirm(run_id, msg_id)
                context.run_id = run_id
                stage = "train"
                with CLIENT_APP:
                    started = time.monotonic()
                    reply = app(message, context)
                reply.metadata.__dict__["_message_id"] = reply.object_id
                with no_object_id_recompute():
                    objects = get_all_nested_objects(reply)
                    to_push, session = send(reply, get_object_tree(reply), time.monotonic() - started)
                    stage = "push"
                    push_object_contents_from_iterable(
                        ((o, objects[o].deflate()) for o in objects if o in to_push),
                        partial(push_object, run_id, session))
                record.event(device=i, event="replied", kind=message.metadata.message_type, message=msg_id,
                             reply=reply.metadata.message_id, error=reply.has_error(),
                             seconds=round(time.monotonic() - started, 4))
            except Exception as err:  # noqa: BLE001 - a device's failure is counted, the device goes on
                record.event(device=i, event="failed", kind=message.metadata.message_type, message=msg_id,
                             stage=stage, reason=f"{type(err).__name__}: {err}"[:300])


def worker(first: int, count: int, n: int, address: str, certs: Path, until: float, log: Path,
           idle_s: float, heartbeat_s: float | None) -> None:
    """Devices `first` .. `first + count - 1` in this process, one thread each, started over :data:`RAMP_S`, beating
    every `heartbeat_s` (None: Flower's SuperNode's interval)."""
    import torch

    torch.set_num_threads(1)
    if heartbeat_s is not None:
        supernode.space_heartbeats(heartbeat_s)
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    # Flower's connection ends the whole process when it cannot activate its node (flwr_exit): one device's
    # failure here, which `device` counts and retries
    fleet_http_connection.flwr_exit = _unreachable
    record = Record(log)
    ca = (certs / "ca.crt").read_bytes()
    threads, ramp = [], max(RAMP_S, RAMP_S_PER_DEVICE * n)
    for k, i in enumerate(range(first, first + count)):
        t = threading.Thread(target=device, args=(i, n, address, ca, certs / f"supernode-{i}", until, record, idle_s),
                             name=f"device-{i}", daemon=True)
        t.start()
        threads.append(t)
        STOP.wait(ramp / count if k < count - 1 else 0.0)
    for t in threads:
        t.join(max(0.0, until - time.time()) + 30.0)
    record.close()


# -- the server side --------------------------------------------------------------------------------------------

def register(home: Path, certs: Path, n: int) -> float:
    """Register the public keys of devices 0 .. n-1 through the Control API (one connection, in this process:
    ``flwr supernode register`` is a process per key); returns the seconds it took."""
    started = time.monotonic()
    register_keys(home, CONNECTION, [certs / f"supernode-{i}.pub" for i in range(n)])
    return time.monotonic() - started


def serverapp_pid(superexec_pid: Callable[[], int], link_port: int) -> int:
    """The run's ServerApp process (``flwr-serverapp`` on this SuperLink), else its SuperExec: the ServerApp is the
    process to measure, and it outlives a SuperExec that died until that one is reaped (its parent monitor)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any(a.endswith("flwr-serverapp") for a in cmd[:2]) and any(str(link_port) in a for a in cmd):
            return proc.pid
    return superexec_pid()


class Sampler(threading.Thread):
    """CPU time and RSS of named process trees, every :data:`SAMPLE_S`: mean CPU (% of one core), peak RSS, and the
    RSS series from which :meth:`figures` states the growth per hour over training. A root is looked up at every
    sample (a restarted process is another pid); a root may be several processes (the devices'), measured
    together. Training is seen in the run's `events` file, one line per update's
    fate (accepted, failed, rejected, timed out): from its first line to its last growth (the final evaluation adds
    none)."""

    def __init__(self, roots: dict[str, Callable[[], int | list[int]]], events: Path) -> None:
        super().__init__(daemon=True)
        self.roots, self.events, self.stop = roots, events, threading.Event()
        self.cpu: dict[str, list[float]] = {k: [] for k in roots}
        self.series: dict[str, list[tuple[float, Any, float]]] = {k: [] for k in roots}  # (t, pids, MiB)
        self.t0 = time.monotonic()
        self.training: tuple[float, float] | None = None  # (first update event, last), in this sampler's clock
        self.size = 0

    def tree(self, pid: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def run(self) -> None:
        last: dict[str, tuple[Any, float, float]] = {}
        while not self.stop.wait(SAMPLE_S):
            self.sample(last)

    def sample(self, last: dict[str, tuple[Any, float, float]]) -> None:
        """One sample of every root (`last`: each root's pids, CPU seconds and time at the sample before)."""
        for name, root in self.roots.items():
            pid, cpu, rss = root(), 0.0, 0.0
            for proc in [p for one in (pid if isinstance(pid, list) else [pid]) for p in self.tree(one)]:
                try:
                    times, mem = proc.cpu_times(), proc.memory_info()
                except psutil.NoSuchProcess:
                    continue
                cpu += times.user + times.system + times.children_user + times.children_system
                rss += mem.rss
            now = time.monotonic()
            pid = tuple(pid) if isinstance(pid, list) else pid
            if name in last and last[name][0] == pid:  # not across a restart
                self.cpu[name].append(100 * (cpu - last[name][1]) / (now - last[name][2]))
            last[name] = (pid, cpu, now)
            if rss:
                self.series[name].append((now - self.t0, pid, rss / 2**20))
        self.watch(time.monotonic() - self.t0)

    def watch(self, now: float) -> None:
        """Training's first and last update event so far: when the events file first grew, and last."""
        with contextlib.suppress(FileNotFoundError):
            if (size := self.events.stat().st_size) != self.size:
                self.size, self.training = size, (self.training[0] if self.training else now, now)

    def growth(self, name: str) -> float | None:
        """RSS growth in % per hour of process `name`'s latest pid over training, from :data:`TRAIN_WARM_UP_S` after
        its first update event and the process's own first minute: the slope of a least-squares line through its
        samples over their mean (None: under 5 minutes)."""
        points = self.series[name]
        if not points or not self.training:
            return None
        (start, end), pid = self.training, points[-1][1]
        born = min(t for t, p, _ in points if p == pid)
        kept = np.array([(t, m) for t, p, m in points
                         if p == pid and max(start + TRAIN_WARM_UP_S, born + 60.0) <= t <= end])
        if len(kept) < 2 or kept[-1, 0] - kept[0, 0] < 300.0:
            return None
        slope = np.polyfit(kept[:, 0], kept[:, 1], 1)[0]
        return round(float(100 * slope * 3600 / kept[:, 1].mean()), 2)

    def window(self) -> list[float]:
        """The seconds of training the growth is stated over (from its warm-up's end to its last update event);
        empty when training was shorter than its warm-up."""
        if not self.training or self.training[0] + TRAIN_WARM_UP_S >= self.training[1]:
            return []
        return [round(self.training[0] + TRAIN_WARM_UP_S, 1), round(self.training[1], 1)]

    def figures(self) -> dict[str, dict[str, float | None]]:
        return {name: {"cpu-mean-%": round(float(np.mean(v)), 1) if v else 0.0,
                       "rss-peak-mib": round(max((m for *_, m in self.series[name]), default=0.0), 1),
                       "rss-growth-%-per-h": self.growth(name)} for name, v in self.cpu.items()}


class LoopProbe(threading.Thread):
    """The SuperLink's answer time: every :data:`SAMPLE_S`, one ``/health`` request straight to its port (no edge),
    a line each in `path` (written as it goes: a run that fails before its figures keeps it). Flower 1.42 answers
    ``/health`` in the SuperLink's event loop (an ``async`` route) and the ServerApp's heartbeat, as every Fleet and
    Runtime route, in the loop's pool of worker threads (a plain ``def`` route; anyio's 40): the probe's wait is the
    loop's, a lower bound of the heartbeat's."""

    def __init__(self, port: int, ca: Path, path: Path) -> None:
        super().__init__(daemon=True)
        self.url, self.ca, self.path, self.stop = f"https://127.0.0.1:{port}/health", str(ca), path, threading.Event()
        self.seconds: list[float] = []
        self.unanswered = 0

    def run(self) -> None:
        import httpx

        with self.path.open("a", buffering=1) as out, httpx.Client(verify=self.ca, timeout=PROBE_TIMEOUT_S) as client:
            while not self.stop.wait(SAMPLE_S):
                asked = time.monotonic()
                try:
                    ok = client.get(self.url).is_success
                except httpx.HTTPError:
                    ok = False
                took = time.monotonic() - asked
                if ok:
                    self.seconds.append(took)
                else:
                    self.unanswered += 1
                out.write(json.dumps({"t": round(time.time(), 3), "s": round(took, 4), "ok": ok}) + "\n")

    def figures(self) -> dict[str, float | int]:
        got = np.asarray(self.seconds)
        return {**pcts(got), "max": round(float(got.max()), 4) if got.size else 0.0, "unanswered": self.unanswered}


def pcts(values: np.ndarray) -> dict[str, float]:
    if not values.size:
        return {}
    return {"p50": round(float(np.percentile(values, 50)), 4), "p99": round(float(np.percentile(values, 99)), 4),
            "count": int(values.size)}


def flower_version() -> str:
    """The version of the distribution whose ``flwr`` is imported: flwr, or flwr-nightly installed over it in a
    separate environment (whose ``flwr.__version__`` still reads flwr's metadata)."""
    import importlib.metadata

    import flwr

    here = Path(flwr.__file__).resolve()
    for name in ("flwr-nightly", "flwr"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if Path(dist.locate_file("flwr/__init__.py")).resolve() == here:
            return f"{name} {dist.version}"
    return f"flwr {flwr.__version__}"


def reconcile(events: list[dict[str, Any]], in_flight: list[str], pushed_again: list[str],
              device: list[dict[str, Any]], killed: set[int]) -> dict[str, Any]:
    """Every train reply the devices sent, by message id, against the run's fates of its train messages (an event
    each, in flight when the run ended, or pushed again: a push the SuperLink lost in a restart, sent again under a
    new id, whose first message it may still deliver): each reply's fate by kind; ``reconciled`` when no message has
    two fates, every reply has one, and no update was accepted that no device logged sending, except from devices of a
    process killed (`killed`: its log may end between a reply's push and its line). A reply is sent once the SuperLink
    registered it: logged replied, or failed while its objects were pushed (a SuperLink killed mid-upload may have
    stored them and not said so: their fates, e.g. accepted, are also counted apart as ``push-failed``)."""
    replied = {d["message"] for d in device if d["event"] == "replied" and d["kind"] == "train"}
    push_failed = {d["message"] for d in device
                   if d["event"] == "failed" and d["kind"] == "train" and d.get("stage") == "push"} - replied
    fates: dict[str, list[str]] = {}
    for e in events:
        if "message" in e:  # a refused strategy step is no message's fate
            fates.setdefault(e["message"], []).append(e["outcome"])
    for m in in_flight:
        fates.setdefault(m, []).append("in flight at the end")
    for m in pushed_again:
        fates.setdefault(m, []).append("pushed again")
    sent = replied | push_failed
    twice = sorted(m for m, f in fates.items() if len(f) > 1)
    unknown = [e for e in events if e.get("message") not in sent and e["outcome"] == "accepted"]
    unexplained = [e for e in unknown if e["client"] not in killed]
    replies = Counter(fates[m][0] if m in fates else "no fate" for m in sent)
    return {"train-replies": len(sent), "by-fate": dict(replies),
            "push-failed": dict(Counter(fates[m][0] if m in fates else "no fate" for m in push_failed)),
            "fates-without-a-device-reply": dict(Counter(f[0] for m, f in fates.items() if m not in sent)),
            "accepted-from-a-killed-device-log": len(unknown) - len(unexplained),
            "device-failures": sum(d["event"] == "failed" for d in device),
            "two-fates": len(twice), "accepted-without-a-device-reply": len(unexplained),
            "replies-without-a-fate": sorted(m for m in sent if m not in fates)[:10],
            "reconciled": not twice and not unexplained and "no fate" not in replies}


def load_figures(device: list[dict[str, Any]], logs: list[Path], sampler: Sampler, registered_s: float,
                 args: argparse.Namespace) -> dict[str, Any]:
    """What the load cost and how the devices fared, from their logs (`device`: their lines) and the sampler: a
    run's figures whether it completed or not (the ceiling is found by a run that did not)."""
    pulls = np.concatenate([np.frombuffer(log.with_suffix(".pulls.npy").read_bytes(), dtype=np.float32)
                            for log in logs if log.with_suffix(".pulls.npy").exists()] or [np.zeros(0)])
    replies = [d for d in device if d["event"] == "replied"]
    return {
        "flower": flower_version(), "dataset": args.dataset, "devices": args.devices, "processes": args.processes,
        "idle-s": args.idle_s, "heartbeat-s": args.heartbeat_s, "concurrency": args.concurrency,
        "state": "sqlite" if args.database else "in-memory", "edge": not args.no_edge, "minutes": args.minutes,
        "link-rate": None if args.no_edge else args.link_rate,
        "connected": len({d["device"] for d in device if d["event"] == "connected"}),
        "register-s": round(registered_s, 1), "pull-s": pcts(pulls),
        "device-replies": {"train": sum(r["kind"] == "train" for r in replies),
                           "other": sum(r["kind"] != "train" for r in replies),
                           "errors": sum(r["error"] for r in replies),
                           "failed": sum(d["event"] == "failed" for d in device),
                           "disconnections": sum(d["event"] == "disconnected" for d in device)},
        "processes-cost": sampler.figures(), "rss-growth-over-s": sampler.window(),
    }


def figures(run: Path, summary: dict[str, Any], before: int, device: list[dict[str, Any]], killed: set[int],
            resumed: dict[str, Any] | None) -> dict[str, Any]:
    """What item 2 of issue 69 asks of a completed run, from its own files (`summary` and the first `before`
    events: the run before any resume) and the devices' log lines (`device`); the replies reconciled over the run
    and its resumed part."""
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    in_flight, pushed_again = ([*summary[key], *(resumed or {}).get(key, [])]
                               for key in ("in-flight-at-end", "pushed-again"))
    reconciliation = reconcile(events, in_flight, pushed_again, device, killed)
    outcomes: dict[str, int] = {}
    for e in events[:before]:
        outcomes[e["outcome"]] = outcomes.get(e["outcome"], 0) + 1
    return {
        "train-seconds": round(summary["train-seconds"], 1),
        "accepted-per-s": round(outcomes.get("accepted", 0) / summary["train-seconds"], 3),
        "outcomes": outcomes, "final-test-accuracy": summary["final-test-accuracy"],
        "reply-to-dispatch-s": {k: round(v, 4) if isinstance(v, float) else v
                                for k, v in summary["reply-to-dispatch-s"].items()},
        "reconciliation": reconciliation, "resumed": resumed,
    }


def resume(run: Path, steps: int, env: dict[str, str], log: Path, grace: float) -> dict[str, Any]:
    """The run continued from its checkpoint for `steps` more steps (``hybridfl resume``'s overrides: the run folder
    and a larger num-rounds), on the same SuperLink and devices: where it started, what it did, what it left out."""
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    last = json.loads(metrics[-1])["round"]
    overrides, _, _ = prepare({"resume": str(run), "num-rounds": last + steps})
    run_id, status = flwr_run(env, CONNECTION, overrides, timeout=RUN["wait-nodes-s"] + RESUME_S + grace, log=log,
                              unreachable_s=UNREACHABLE_S)
    check_completed(run_id, status, run)
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[len(metrics):]]
    summary = json.loads((run / "summary.json").read_text())
    return {"from-step": last, "resumed-after-round": summary["resumed-after-round"],
            "steps": [after[0]["round"], after[-1]["round"]], "accepted": sum(m["accepted"] for m in after),
            "final-test-accuracy": summary["final-test-accuracy"],
            **{key: summary[key] for key in ("in-flight-at-end", "lost-at-resume", "pushed-again")}}


FAULTS = ("restart-superlink", "restart-edge", "drop-devices", "replace-devices")


def fault(text: str) -> tuple[str, float]:
    """``KIND@SECONDS`` (seconds after the devices start) of a ``--fault``."""
    kind, _, at = text.partition("@")
    try:
        seconds = float(at)
    except ValueError:
        seconds = -1.0
    if kind not in FAULTS or seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: KIND@SECONDS, KIND one of {', '.join(FAULTS)}, SECONDS ≥ 0")
    return kind, seconds


class Workers:
    """The device processes: started, killed for good (their devices vanish), or killed and started again with the
    same devices and keys (they come back as new processes)."""

    def __init__(self, server: hostile_client.Server, cmd: Callable[[int, int], list[str]], env: dict[str, str],
                 n: int, processes: int) -> None:
        self.server, self.cmd, self.env = server, cmd, env
        per = -(-n // processes)
        self.parts = [(first, min(per, n - first)) for first in range(0, n, per)]
        self.names = {first: f"devices-{first}" for first, _ in self.parts}
        self.killed: set[int] = set()  # the devices of every process killed
        for first, count in self.parts:
            server.procs.start(self.names[first], cmd(first, count), env)

    def hit(self, kind: str) -> list[int]:
        """Kill the last process not hit before; start its devices again for ``replace-devices``. Its devices."""
        first, count = next(p for p in reversed(self.parts) if not self.names[p[0]].endswith(("-dropped", "-again")))
        self.server.procs.kill(self.names[first])
        devices = list(range(first, first + count))
        self.killed |= set(devices)
        if kind == "replace-devices":
            self.names[first] += "-again"
            self.server.procs.start(self.names[first], self.cmd(first, count), self.env)
        else:
            self.names[first] += "-dropped"
        return devices

    def processes(self) -> list[subprocess.Popen]:
        """The device processes of the fleet now: a process killed for good or replaced is not one of them."""
        return [p for name, p in self.server.procs.procs if name in self.names.values()]

    def stop(self) -> None:
        """SIGTERM: the devices leave (nodes deactivated) and write their logs."""
        procs = [p for p in self.processes() if p.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(90)


def inject(schedule: list[tuple[str, float]], server: hostile_client.Server, workers: Workers, run: Path,
           done: threading.Event, record: list[dict[str, Any]]) -> None:
    """Each fault of `schedule` at its time after the run's first update event (the first line of
    `run`/events.jsonl, an update's fate: every device connected and training under way; its round 0 was too early
    under CI's load, where the first round's replies took 25 s), unless the run is `done` first; what was done, when
    and how long it took goes to `record`."""
    events = run / "events.jsonl"
    while not (events.exists() and events.stat().st_size):
        if done.wait(0.5):
            return
    t0 = time.monotonic()
    for kind, at in sorted(schedule, key=lambda f: f[1]):
        if done.wait(max(0.0, t0 + at - time.monotonic())):
            return
        started = time.monotonic()
        entry: dict[str, Any] = {"fault": kind, "at-s": round(started - t0, 1)}
        try:
            if kind.startswith("restart-"):
                server.restart(kind.removeprefix("restart-"))
            else:
                entry["devices"] = len(workers.hit(kind))
        except Exception as err:  # noqa: BLE001 - a fault that failed is recorded with the run's figures, not lost
            entry["error"] = f"{type(err).__name__}: {err}"[:300]
        entry["took-s"] = round(time.monotonic() - started, 1)
        entry["events-before"] = len(events.read_text().splitlines())  # the run's events up to the fault's end
        print(f"fault: {entry}", flush=True)
        record.append(entry)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--processes", type=int, default=4, help="device processes (each one torch thread)")
    parser.add_argument("--concurrency", type=int, default=20, help="updates in flight (the wall clock's)")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="a device's wait after a pull that found "
                        "nothing (Flower's SuperNode: 3 s)")
    parser.add_argument("--heartbeat-s", type=float, default=None, help="the devices' heartbeat interval "
                        "(`python -m client_app.supernode --heartbeat-s`; default Flower's 30 s)")
    parser.add_argument("--reply-timeout-s", type=float, default=REPLY_TIMEOUT_S, help="how long the run waits for "
                        "a message's reply (a device's message lost in a fault is counted after it; the final client "
                        "evaluation waits this long for a lost one)")
    parser.add_argument("--database", action="store_true", help="the SuperLink's state in SQLite, not in memory")
    parser.add_argument("--resume-steps", type=int, default=0, help="after the run, resume it from its checkpoint "
                        "for this many more steps, as `hybridfl resume` does (the devices stay)")
    parser.add_argument("--no-edge", action="store_true", help="devices straight to the SuperLink")
    parser.add_argument("--link-rate", type=int, default=edge.LINK_RATE, help="the edge's asks for work a second to "
                        "the SuperLink from all devices (`hybridfl edge --link-rate`)")
    parser.add_argument("--dataset", choices=DATASETS, default="digits", help="what every device trains: digits' "
                        "CNN, or LeNet-5 on Fashion-MNIST (`make data`) for a fleet above digits' 1438 samples")
    parser.add_argument("--workdir", type=Path, default=None, help="default: outputs/fleet-load/<time>")
    parser.add_argument("--fault", type=fault, action="append", default=[], metavar="KIND@SECONDS",
                        help=f"a fault SECONDS after the run's first update event, KIND one of "
                        f"{', '.join(FAULTS)}: the SuperLink or the edge killed (SIGKILL) and started again; the last "
                        "device process killed for good, or killed and started again with the same devices "
                        "(repeatable)")
    parser.add_argument("--worker", nargs=3, type=int, metavar=("FIRST", "COUNT", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        first, count, n = args.worker
        worker(first, count, n, args.address, args.workdir / "certs", args.until,
               args.workdir / "devices" / f"devices-{first}.jsonl", args.idle_s, args.heartbeat_s)
        return 0
    if args.devices < 2 or args.processes < 1 or args.concurrency < 1 or args.minutes <= 0 or args.idle_s <= 0 \
            or args.resume_steps < 0 or args.reply_timeout_s <= 0 or args.link_rate < 1:
        parser.error("--devices ≥ 2, --processes ≥ 1, --concurrency ≥ 1, --minutes > 0, --idle-s > 0, "
                     "--resume-steps ≥ 0, --reply-timeout-s > 0, --link-rate ≥ 1")
    if not args.no_edge and args.devices / args.idle_s > args.link_rate:
        print(f"warning: {args.devices} devices asking every {args.idle_s:g} s when idle make "
              f"{args.devices / args.idle_s:.0f} asks a second, above the edge's --link-rate {args.link_rate}: their "
              "asks wait and are retried at the edge, and a round reaches its devices late (docs/how-to/sizing.md)",
              file=sys.stderr)
    if args.heartbeat_s is not None:
        try:
            supernode.check_heartbeat(args.heartbeat_s)
        except ValueError as err:
            parser.error(str(err))
    kinds = Counter(kind for kind, _ in args.fault)
    if kinds["restart-superlink"] and not args.database:
        parser.error("--fault restart-superlink needs --database (an in-memory SuperLink loses its runs)")
    if kinds["restart-edge"] and args.no_edge:
        parser.error("--fault restart-edge needs the edge (not --no-edge)")
    if kinds["drop-devices"] + kinds["replace-devices"] >= min(args.processes, args.devices):
        parser.error("--fault drop-devices / replace-devices: each hits another device process, and one must "
                     "stay untouched: fewer than --processes of them")
    workdir = (args.workdir or Path("outputs") / "fleet-load" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "devices").mkdir(exist_ok=True)
    overrides, run, cfg = prepare({**RUN, **DATASETS[args.dataset], "num-clients": args.devices,
                                   "clients-per-round": max(1, args.concurrency // 2),
                                   "buffer-size": max(1, args.concurrency // 2), "concurrency": args.concurrency,
                                   "reply-timeout-s": args.reply_timeout_s,
                                   "time-budget-s": 60.0 * args.minutes, "output-dir": str(workdir / "runs"),
                                   "run-name": "fleet-load"})
    try:  # each device holds a part of the training set: a fleet larger than it stops here, not in the run
        check_partitions(data_spec(cfg))
    except ConfigError as err:
        parser.error(f"--devices {args.devices}: {err}")
    home = workdir / "home"
    env = flower_env(home)
    with hostile_client.server(workdir, with_edge=not args.no_edge, nodes=args.devices, database=args.database,
                               fleet_size=args.devices, link_rate=args.link_rate) as server:
        write_connection(home, CONNECTION, server.link_port, server.ca)
        registered_s = register(home, server.certs, args.devices)
        print(f"{args.devices} device keys registered in {registered_s:.1f} s", flush=True)
        serverapp = server.procs.keep("superexec-serverapp", superexec(
            ["--root-certificates", str(server.ca)], f"127.0.0.1:{server.link_port}",
            server.certs / "superlink.secret"))
        # the run's time counts from its first step, after every device described itself (up to wait-nodes-s: 1000
        # devices took 5 minutes); the devices leave when the run ends, or by themselves at `until`; the run is
        # given up on as they leave (a fixed bound gave up on 2000 devices' final evaluation)
        grace = GRACE_S + math.ceil(args.devices / EVAL_WAVE) * (args.idle_s + GRACE_S_PER_WAVE)
        run_s = max(RAMP_S, RAMP_S_PER_DEVICE * args.devices) + RUN["wait-nodes-s"] + 60.0 * args.minutes + grace
        until = time.time() + run_s + 60.0 + (RUN["wait-nodes-s"] + RESUME_S + grace if args.resume_steps else 0.0)
        address = f"127.0.0.1:{server.edge_port if server.edge_port else server.link_port}"
        workers = Workers(server, lambda first, count: [
            sys.executable, "-m", "benchmarks.fleet_load", "--worker", str(first), str(count), str(args.devices),
            "--address", address, "--until", str(until), "--workdir", str(workdir), "--idle-s", str(args.idle_s),
            *(["--heartbeat-s", str(args.heartbeat_s)] if args.heartbeat_s is not None else [])],
            {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, args.devices, args.processes)
        logs = [workdir / "devices" / f"devices-{first}.jsonl" for first, _ in workers.parts]
        roots = {"superlink": partial(server.pid, "superlink"),
                 "serverapp": partial(serverapp_pid, lambda: serverapp.proc.pid, server.link_port)}
        if server.edge_port:
            roots["edge"] = partial(server.pid, "edge")
        roots["devices"] = lambda: [p.pid for p in workers.processes()]  # (a dropped process's name has none)
        sampler = Sampler(roots, run / "events.jsonl")
        sampler.start()
        probe = LoopProbe(server.link_port, server.ca, workdir / "superlink-health.jsonl")
        probe.start()
        done, faults = threading.Event(), []
        injector = threading.Thread(target=inject, args=(args.fault, server, workers, run, done, faults), daemon=True)
        injector.start()
        try:
            run_id, status = flwr_run(env, CONNECTION, overrides, timeout=run_s,
                                      log=workdir / "flwr-run.log", unreachable_s=UNREACHABLE_S)
        finally:
            done.set()
            sampler.stop.set()
            probe.stop.set()
            injector.join(120)  # a restart under way finishes before anything stops
        if status != "finished:completed":  # Flower's reason, while its SuperLink still answers
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                status += f" ({run_status(env, CONNECTION, run_id, field='status-details')})"
        failed, resumed = None, None
        try:
            check_completed(run_id, status, run)
        except RuntimeError as err:  # the load's figures are written all the same, and this exits 1
            failed = str(err)
        if not failed:
            summary = json.loads((run / "summary.json").read_text())
            before = len((run / "events.jsonl").read_text().splitlines())
            if args.resume_steps:
                try:
                    resumed = resume(run, args.resume_steps, env, workdir / "flwr-run-resumed.log", grace)
                except Exception as err:  # noqa: BLE001 - as a failed run
                    resumed = {"error": f"{type(err).__name__}: {err}"[:500]}
        workers.stop()  # they would end by themselves at `until`: they leave now
    device = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    result = {**load_figures(device, logs, sampler, registered_s, args),
              **({"failed": failed} if failed else figures(run, summary, before, device, workers.killed, resumed)),
              "faults": faults,
              "superexec-restarts": serverapp.restarts, "superlink-answer-s": probe.figures()}
    (workdir / "figures.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if failed:
        print(f"the run failed: {failed}", file=sys.stderr)
    return 1 if failed or (resumed and "error" in resumed) else 0


if __name__ == "__main__":
    sys.exit(main())
