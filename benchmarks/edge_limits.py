"""The edge under a hostile client (issue 67): the SuperLink's memory under an upload attack, and a device's requests
under a stalled-upload attack, through the edge and straight at the SuperLink, side by side in one run.

    python -m benchmarks.edge_limits [--stalls 600] [--fleet-size 1000] [--requests 10]

One SuperLink with docker/compose.yml's security flags (TLS, SuperNode authentication, ``--database``, process
isolation with its secret) on loopback, the edge (hybridfl/launch/edge, nginx, rendered with ``--fleet-size``) in front
of it; the attacker holds only ca.crt and speaks from 127.0.0.2 (tools/hostile_client.py):

- uploads: unauthenticated ``POST /v1/fleet/push-messages`` bodies of 64 and 256 MiB (one with a Content-Length,
  one chunked), then three 256 MiB ones at once; first through the edge, then at the SuperLink's own port (the
  SuperLink keeps what it took: the edge's rows come first, the SuperLink's last). The SuperLink's RSS (``VmRSS``)
  after each and its peak (``VmHWM``); and, through the edge, 50 unauthenticated 7 MiB push-object bodies, within
  the limit (what the edge lets through);
- stalls, in between: ``--stalls`` uploads that send their headers and one byte of a 1 MiB body, then nothing,
  against the edge, the edge as it was before issue 67 (:func:`previous_edge`) and the SuperLink's own port;
  meanwhile a device (127.0.0.1) asks ``--requests`` times for /health and sends a 5 MiB push-object (a device's
  largest request, unsigned here: the SuperLink's 401 shows it got through): its answers and median seconds, how
  many of the stalls the server holds, how many connections the SuperLink has open and its RSS.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from hybridfl.launch import edge
from hybridfl.launch.processes import free_port, wait_healthy
from tools import hostile_client as attacker
from tools.hostile_client import Server

ROUTE = "/v1/fleet/push-messages"


def uploads(server: Server, port: int) -> list[dict[str, str]]:
    """The upload attack at `port`: one row per step, the answers and the SuperLink's memory after it."""
    rows = [{"step": "before", **mib(server)}]
    for size, chunked in ((64, False), (256, False), (256, True)):
        answer = attacker.upload(port, server.ca, ROUTE, size, chunked)
        rows.append({"step": f"{size} MiB{' chunked' if chunked else ''}", "answer": answer, **mib(server)})
    rows.append({"step": "3 x 256 MiB at once", "answer": at_once(server, port, ROUTE, 256, 3, 3), **mib(server)})
    return rows


def at_once(server: Server, port: int, route: str, size: int, count: int, parallel: int) -> str:
    """`count` uploads of `size` MiB to `route`, `parallel` at a time: their answers, counted."""
    with ThreadPoolExecutor(parallel) as pool:
        answers = list(pool.map(lambda _: attacker.upload(port, server.ca, route, size, False), range(count)))
    return " ".join(f"{a}x{answers.count(a)}" for a in sorted(set(answers)))


def mib(server: Server) -> dict[str, str]:
    rss = attacker.rss_mib(server.link_pid)
    return {"rss": f"{rss['VmRSS']:.0f}", "peak": f"{rss['VmHWM']:.0f}"}


def device(server: Server, port: int, requests: int) -> dict[str, str]:
    """A device's requests at `port` from 127.0.0.1: /health and a 5 MiB push-object, `requests` times each."""
    answers: dict[str, int] = {}
    seconds = []
    for _ in range(requests):
        for ask in (lambda: attacker.get(port, server.ca, "/health", source="127.0.0.1"),
                    lambda: attacker.upload(port, server.ca, "/v1/fleet/push-object", 5, False, source="127.0.0.1",
                                            timeout=30)):
            start = time.monotonic()
            try:
                answer = ask()
            except OSError as err:  # refused or timed out at connect: what the attack aims at
                answer = type(err).__name__
            seconds.append(time.monotonic() - start)
            answers[answer] = answers.get(answer, 0) + 1
    return {"device's answers": " ".join(f"{k}x{v}" for k, v in sorted(answers.items())),
            "median s": f"{statistics.median(seconds):.3f}"}


def stalls(server: Server, port: int, count: int, requests: int) -> dict[str, str]:
    """The stalled-upload attack at `port`, the device's requests during it."""
    start = time.monotonic()
    socks = attacker.stall(port, server.ca, count)
    try:
        opened = time.monotonic() - start
        fates = attacker.fates(socks, 2.0)
        link = psutil.Process(server.link_pid)
        open_at_link = sum(1 for c in link.net_connections("tcp")
                           if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == server.link_port)
        row = {"stalls (opened in s)": f"{' '.join(f'{k}:{v}' for k, v in sorted(fates.items()))} ({opened:.0f})",
               "SuperLink connections": str(open_at_link), "SuperLink rss": mib(server)["rss"],
               **device(server, port, requests)}
    finally:
        attacker.close(socks)
    time.sleep(2)  # the servers let go of the closed connections before the next row
    return row


def previous_edge(server: Server, workdir: Path) -> int:
    """The edge as it was before issue 67 (commit f21b9b0), started beside the current one: the same routes, one
    worker of 1024 connections, no body limit, bodies streamed to the SuperLink as they come, no per-client limit,
    nginx's default timeouts (60 s), a new connection to the SuperLink per request."""
    port = free_port()
    conf = edge.write(workdir, server.certs, f"127.0.0.1:{server.link_port}", f"127.0.0.1:{port}")
    text = conf.read_text()
    for pattern, value in ((r"worker_processes auto;", "worker_processes 1;"),
                           (r"worker_connections \d+;", "worker_connections 1024;"),
                           (r"client_max_body_size \d+m;", "client_max_body_size 0;"),
                           (r"proxy_request_buffering on;", "proxy_request_buffering off;"),
                           (r"\n\s*limit_(conn|req) .*;", ""),
                           (r"\n\s*(client_(header|body)_timeout|send_timeout|keepalive(_timeout)?) [^;]*;", "")):
        text, found = re.subn(pattern, value, text)
        assert found, pattern
    conf.write_text(text)
    nginx = server.procs.start("previous-edge", edge.command(conf),
                               {**os.environ, "PATH": f"{os.environ['PATH']}:/usr/sbin:/sbin"})
    wait_healthy(port, nginx, 30, server.ca)
    return port


def table(rows: list[dict[str, str]]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join([*lines, *("| " + " | ".join(row.get(k, "") for k in keys) + " |" for row in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stalls", type=int, default=600, help="stalled uploads the attacker opens at once")
    parser.add_argument("--fleet-size", type=int, default=edge.FLEET_SIZE, help="the edge's --fleet-size")
    parser.add_argument("--requests", type=int, default=10, help="a device's requests of each kind during the stalls")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, attacker.server(Path(tmp), fleet_size=args.fleet_size) as server:
        print(f"edge: --fleet-size {args.fleet_size} (per client: {edge.CONNS_PER_DEVICE * args.fleet_size} "
              f"connections), body limits {edge.MAX_BODY_MIB} MiB (push-object) and 1 MiB", flush=True)
        upload_rows = [{"to": "edge", **row} for row in uploads(server, server.edge_port)]
        before = {"to": "(none yet)", "SuperLink rss": mib(server)["rss"]}
        stalled = [before, {"to": "edge", **stalls(server, server.edge_port, args.stalls, args.requests)},
                   {"to": "edge before issue 67", **stalls(server, previous_edge(server, Path(tmp) / "previous"),
                                                           args.stalls, args.requests)},
                   {"to": "SuperLink", **stalls(server, server.link_port, args.stalls, args.requests)}]
        within = {"to": "edge", "step": "50 x 7 MiB push-object, 8 at once (within its limit)",
                  "answer": at_once(server, server.edge_port, "/v1/fleet/push-object", 7, 50, 8), **mib(server)}
        upload_rows += [within, *({"to": "SuperLink", **row} for row in uploads(server, server.link_port))]
    print(f"\nUnauthenticated uploads to {ROUTE} (SuperLink RSS and peak, MiB):\n{table(upload_rows)}")
    print(f"\n{args.stalls} stalled uploads from {attacker.ATTACKER}; a device's {args.requests} x (/health, 5 MiB "
          f"push-object) meanwhile:\n{table(stalled)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
