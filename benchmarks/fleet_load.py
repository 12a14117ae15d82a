"""A thousand devices on one SuperLink (issue 69): a fleet load generator, the load it holds, what it costs.

    python -m benchmarks.fleet_load --devices N --minutes M [--processes P] [--concurrency C] [--database]
                                    [--no-edge] [--workdir DIR]

Starts on loopback a SuperLink with the compose file's security (TLS with a private CA, SuperNode authentication,
process isolation; Flower's in-memory state, or SQLite with ``--database``), the edge in front of it (nginx,
hybridfl/edge, sized for N devices), registers N device keys through the Control API, and runs hybridfl's ServerApp
(``flwr run``, its SuperExec) with FedBuff on the wall clock for M minutes (``time-budget-s``) while N devices, in P
processes of this module, answer it.

Each device is a real Fleet API client: Flower 1.42's own transport (``http_request_response``: HTTPS through the
edge, its own registered key signing every request, its heartbeat thread), and Flower's SuperNode's pacing (a pull
every 3 s while idle, at once after a reply: ``flower-supernode``'s loop, the load a stock fleet makes). A message
is answered by hybridfl's own ClientApp, in the device's process (no SuperExec or process per message: the load is
the protocol, not the device's runtime): the papers' CNN on scikit-learn's digits, trained for real. A device's loop
ends by itself at the end of the run's time (and a grace), every wait in it is bounded.

Printed (and written to <workdir>/figures.json): updates accepted per second, the ServerApp's reply→dispatch latency
(p50, p99: the runtime's own, summary.json), the devices' pull latency (p50, p99 of every Fleet ``PullMessages``),
CPU (mean, % of one core) and peak RSS of the SuperLink, the ServerApp and the edge, and the devices' replies against
the run's outcomes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from cryptography.hazmat.primitives import serialization
from flwr.app import Context, RecordDict
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.supernode.register import try_load_public_key
from flwr.cli.utils import init_http_client_from_connection
from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611
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
from hybridfl.deploy_local import superexec
from hybridfl.job import prepare
from hybridfl.processes import check_completed, flower_env, flwr_run, write_connection
from tools import hostile_client

CONNECTION = "fleet-load"
IDLE_S = 3.0  # flower-supernode's wait after a pull that found nothing
RAMP_S = 30.0  # the devices start spread over this long, at least (a fleet does not connect in one instant) ...
RAMP_S_PER_DEVICE = 0.1  # ... and at most 10 a second: 1000 at once left activations unanswered for 30 s
RECONNECT_S = 10.0  # a device whose connection failed tries again after this long
GRACE_S = 120.0  # devices keep answering this long past the run's time: its last round and evaluation
SAMPLE_S = 1.0
STOP = threading.Event()  # a worker's devices leave (their nodes deactivated) once it is set: SIGTERM
# hybridfl's ClientApp keeps its task (data, model) per process between messages (client_app/work.py), as a device
# does: a process's devices run it one at a time
CLIENT_APP = threading.Lock()
# FedBuff on the wall clock, as the digits preset, for a fleet: every device one partition of digits, C updates
# in flight, a step every C/2 arrivals
RUN = {"preset": "fedbuff-digits", "clock": "wall", "delay-sigma": 0.0, "partitioner": "iid", "local-epochs": 1,
       "num-rounds": 10**9, "eval-every": 50, "reply-timeout-s": 120.0, "wait-nodes-s": 600.0,
       "max-failed-fraction": 0.5}


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


def device(i: int, n: int, address: str, ca: bytes, key: Path, until: float, record: Record) -> None:
    """Device `i` of `n` (partition i), the holder of `key`: connected (again, after :data:`RECONNECT_S`, whenever
    its connection fails) and answering messages until `until`."""
    private = serialization.load_ssh_private_key(key.read_bytes(), None)
    keys = (private, private.public_key())
    while time.time() < until and not STOP.is_set():
        try:
            serve(i, n, address, ca, keys, until, record)
            reason = "the connection ended (Flower logged why)"  # its context swallows an error in the loop
        except Exception as err:  # noqa: BLE001 - a device that lost the SuperLink tries again, counted
            reason = f"{type(err).__name__}: {err}"[:300]
        if time.time() < until and not STOP.is_set():
            record.event(device=i, event="disconnected", reason=reason)
            STOP.wait(RECONNECT_S)


def serve(i: int, n: int, address: str, ca: bytes, keys: tuple[Any, Any], until: float, record: Record) -> None:
    """One connection of device `i`: Flower's SuperNode loop, its ClientApp run here."""
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
                STOP.wait(max(0.0, min(IDLE_S, until - time.time())))
                continue
            message, tree = got
            run_id, msg_id = message.metadata.run_id, message.metadata.message_id
            try:
                contents = pull_objects([t.object_id for t in iterate_object_tree(tree)],
                                        partial(pull_object, run_id), max_time=60.0)
                message = inflate_object_from_contents(msg_id, contents)
                message.metadata.__dict__["_message_id"] = msg_id
                confirm(run_id, msg_id)
                context.run_id = run_id
                with CLIENT_APP:
                    started = time.monotonic()
                    reply = app(message, context)
                reply.metadata.__dict__["_message_id"] = reply.object_id
                with no_object_id_recompute():
                    objects = get_all_nested_objects(reply)
                    to_push, session = send(reply, get_object_tree(reply), time.monotonic() - started)
                    push_object_contents_from_iterable(
                        ((o, objects[o].deflate()) for o in objects if o in to_push),
                        partial(push_object, run_id, session))
                record.event(device=i, event="replied", kind=message.metadata.message_type, message=msg_id,
                             reply=reply.metadata.message_id, error=reply.has_error(),
                             seconds=round(time.monotonic() - started, 4))
            except Exception as err:  # noqa: BLE001 - a device's failure is counted, the device goes on
                record.event(device=i, event="failed", kind=message.metadata.message_type, message=msg_id,
                             reason=f"{type(err).__name__}: {err}"[:300])


def worker(first: int, count: int, n: int, address: str, certs: Path, until: float, log: Path) -> None:
    """Devices `first` .. `first + count - 1` in this process, one thread each, started over :data:`RAMP_S`."""
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    # Flower's connection ends the whole process when it cannot activate its node (flwr_exit): one device's
    # failure here, which `device` counts and retries
    fleet_http_connection.flwr_exit = _unreachable
    record = Record(log)
    ca = (certs / "ca.crt").read_bytes()
    threads, ramp = [], max(RAMP_S, RAMP_S_PER_DEVICE * n)
    for k, i in enumerate(range(first, first + count)):
        t = threading.Thread(target=device, args=(i, n, address, ca, certs / f"supernode-{i}", until, record),
                             name=f"device-{i}", daemon=True)
        t.start()
        threads.append(t)
        STOP.wait(ramp / count if k < count - 1 else 0.0)
    for t in threads:
        t.join(max(0.0, until - time.time()) + 30.0)
    record.close()


# -- the server side --------------------------------------------------------------------------------------------

def register(home: Path, certs: Path, n: int) -> float:
    """Register the public keys of devices 0 .. n-1 through the Control API (Flower's own client, one connection:
    ``flwr supernode register`` is a process per key); returns the seconds it took."""
    started = time.monotonic()
    os.environ["FLWR_HOME"] = str(home)
    client = init_http_client_from_connection(read_superlink_connection(CONNECTION))
    try:
        for i in range(n):
            reply = client.RegisterNode(RegisterNodeRequest(public_key=try_load_public_key(certs /
                                                                                          f"supernode-{i}.pub")))
            if not reply.node_id:
                raise RuntimeError(f"the SuperLink did not register device {i}'s key")
    finally:
        client.close()
    return time.monotonic() - started


class Sampler(threading.Thread):
    """CPU time and RSS of named process trees, every :data:`SAMPLE_S`: mean CPU (% of one core) and peak RSS."""

    def __init__(self, roots: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.roots, self.stop = roots, threading.Event()
        self.cpu: dict[str, list[float]] = {k: [] for k in roots}
        self.rss: dict[str, float] = dict.fromkeys(roots, 0.0)

    def tree(self, pid: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def run(self) -> None:
        last: dict[str, tuple[float, float]] = {}
        while not self.stop.wait(SAMPLE_S):
            for name, pid in self.roots.items():
                cpu = rss = 0.0
                for proc in self.tree(pid):
                    try:
                        times, mem = proc.cpu_times(), proc.memory_info()
                    except psutil.NoSuchProcess:
                        continue
                    cpu += times.user + times.system + times.children_user + times.children_system
                    rss += mem.rss
                now = time.monotonic()
                if name in last:
                    self.cpu[name].append(100 * (cpu - last[name][0]) / (now - last[name][1]))
                last[name] = (cpu, now)
                self.rss[name] = max(self.rss[name], rss / 2**20)

    def figures(self) -> dict[str, dict[str, float]]:
        return {name: {"cpu-mean-%": round(float(np.mean(v)), 1) if v else 0.0,
                       "rss-peak-mib": round(self.rss[name], 1)} for name, v in self.cpu.items()}


def pcts(values: np.ndarray) -> dict[str, float]:
    if not values.size:
        return {}
    return {"p50": round(float(np.percentile(values, 50)), 4), "p99": round(float(np.percentile(values, 99)), 4),
            "count": int(values.size)}


def figures(run: Path, logs: list[Path], sampler: Sampler, registered_s: float, args: argparse.Namespace
            ) -> dict[str, Any]:
    """What item 2 of issue 69 asks, from the run's own files and the devices' logs."""
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    device = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    pulls = np.concatenate([np.frombuffer(log.with_suffix(".pulls.npy").read_bytes(), dtype=np.float32)
                            for log in logs if log.with_suffix(".pulls.npy").exists()] or [np.zeros(0)])
    outcomes: dict[str, int] = {}
    for e in events:
        outcomes[e["outcome"]] = outcomes.get(e["outcome"], 0) + 1
    replies = [d for d in device if d["event"] == "replied"]
    return {
        "devices": args.devices, "processes": args.processes, "concurrency": args.concurrency,
        "state": "sqlite" if args.database else "in-memory", "edge": not args.no_edge, "minutes": args.minutes,
        "connected": len({d["device"] for d in device if d["event"] == "connected"}),
        "register-s": round(registered_s, 1), "train-seconds": round(summary["train-seconds"], 1),
        "accepted-per-s": round(outcomes.get("accepted", 0) / summary["train-seconds"], 3),
        "outcomes": outcomes, "final-test-accuracy": summary["final-test-accuracy"],
        "reply-to-dispatch-s": {k: round(v, 4) if isinstance(v, float) else v
                                for k, v in summary["reply-to-dispatch-s"].items()},
        "pull-s": pcts(pulls),
        "device-replies": {"train": sum(r["kind"] == "train" for r in replies),
                           "other": sum(r["kind"] != "train" for r in replies),
                           "errors": sum(r["error"] for r in replies),
                           "failed": sum(d["event"] == "failed" for d in device),
                           "disconnections": sum(d["event"] == "disconnected" for d in device)},
        "processes-cost": sampler.figures(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--processes", type=int, default=4, help="device processes (each one torch thread)")
    parser.add_argument("--concurrency", type=int, default=20, help="updates in flight (the wall clock's)")
    parser.add_argument("--database", action="store_true", help="the SuperLink's state in SQLite, not in memory")
    parser.add_argument("--no-edge", action="store_true", help="devices straight to the SuperLink")
    parser.add_argument("--workdir", type=Path, default=None, help="default: outputs/fleet-load/<time>")
    parser.add_argument("--worker", nargs=3, type=int, metavar=("FIRST", "COUNT", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        first, count, n = args.worker
        worker(first, count, n, args.address, args.workdir / "certs", args.until,
               args.workdir / "devices" / f"devices-{first}.jsonl")
        return 0
    if args.devices < 2 or args.processes < 1 or args.concurrency < 1 or args.minutes <= 0:
        parser.error("--devices ≥ 2, --processes ≥ 1, --concurrency ≥ 1, --minutes > 0")
    workdir = (args.workdir or Path("outputs") / "fleet-load" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "devices").mkdir(exist_ok=True)
    overrides, run, _ = prepare({**RUN, "num-clients": args.devices, "clients-per-round": max(1, args.concurrency // 2),
                                 "buffer-size": max(1, args.concurrency // 2), "concurrency": args.concurrency,
                                 "time-budget-s": 60.0 * args.minutes, "output-dir": str(workdir / "runs"),
                                 "run-name": "fleet-load"})
    home = workdir / "home"
    env = flower_env(home)
    with hostile_client.server(workdir, with_edge=not args.no_edge, nodes=args.devices, database=args.database,
                               fleet_size=args.devices) as server:
        write_connection(home, CONNECTION, server.link_port, server.ca)
        registered_s = register(home, server.certs, args.devices)
        print(f"{args.devices} device keys registered in {registered_s:.1f} s", flush=True)
        serverapp = server.procs.start("superexec-serverapp", superexec(["--root-certificates", str(server.ca)],
                                                                        f"127.0.0.1:{server.link_port}",
                                                                        server.certs / "superlink.secret"))
        until = time.time() + max(RAMP_S, RAMP_S_PER_DEVICE * args.devices) + 60.0 * args.minutes + GRACE_S + 60.0
        address = f"127.0.0.1:{server.edge_port if server.edge_port else server.link_port}"
        per = -(-args.devices // args.processes)
        logs = []
        for first in range(0, args.devices, per):
            count = min(per, args.devices - first)
            server.procs.start(f"devices-{first}", [
                sys.executable, "-m", "benchmarks.fleet_load", "--worker", str(first), str(count), str(args.devices),
                "--address", address, "--until", str(until), "--workdir", str(workdir)], {**env, "PYTHONPATH": str(
                    Path(__file__).resolve().parents[1])})
            logs.append(workdir / "devices" / f"devices-{first}.jsonl")
        roots = {"superlink": server.link_pid, "serverapp": serverapp.pid}
        if server.edge_port:
            roots["edge"] = next(p.pid for name, p in server.procs.procs if name == "edge")
        sampler = Sampler(roots)
        sampler.start()
        run_id, status = flwr_run(env, CONNECTION, overrides, timeout=60.0 * args.minutes + 1800.0,
                                  log=workdir / "flwr-run.log")
        sampler.stop.set()
        check_completed(run_id, status, run)
        devices = [proc for name, proc in server.procs.procs if name.startswith("devices-")]
        for proc in devices:  # they would end by themselves at `until`: they leave now, and write their logs
            proc.send_signal(signal.SIGTERM)
        for proc in devices:
            proc.wait(90)
    result = figures(run, logs, sampler, registered_s, args)
    (workdir / "figures.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
