"""A stranger on the devices' port, holding only the public ``ca.crt``: oversized uploads and stalled ones (issue 67),
against a SuperLink started with docker/compose.yml's security flags, directly or through the edge
(hybridfl/launch/edge).

Flower 1.42 reads and parses a request's whole body before it checks the node's signature, so an unauthenticated
upload costs the SuperLink memory; a stalled one holds a connection. tests/test_edge.py and benchmarks/edge_limits.py
run these attacks on loopback: the attacker speaks from :data:`ATTACKER` (another loopback address than the
devices', so that the edge's per-client limits tell them apart), every wait is bounded.
"""

from __future__ import annotations

import re
import select
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from hybridfl.launch import edge
from hybridfl.launch.deploy_local import runtime_api
from hybridfl.launch.pki import make_pki
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, wait_healthy

ATTACKER = "127.0.0.2"
MIB = 1 << 20
# A valid protobuf body of any size: one field Flower's messages do not have (number 1000, bytes), which the parser
# keeps as an unknown field; its length prefix is written before the zeros stream
UNKNOWN_FIELD = (1000 << 3) | 2


@dataclass
class Server:
    """A SuperLink with the compose file's flags (TLS, SuperNode authentication, ``--database``, process isolation
    with its secret) on 127.0.0.1:`link_port`, and, unless started without, the edge on 127.0.0.1:`edge_port`."""

    procs: ProcessGroup
    certs: Path
    link_port: int
    edge_port: int | None
    commands: dict[str, tuple[list[str], dict[str, str] | None]]  # how "superlink" and "edge" were started

    @property
    def ca(self) -> Path:
        return self.certs / "ca.crt"

    def pid(self, name: str) -> int:
        """The pid of `name`'s latest process (a restart starts another under the same name)."""
        return [p.pid for n, p in self.procs.procs if n == name][-1]

    @property
    def link_pid(self) -> int:
        return self.pid("superlink")

    def restart(self, name: str, pause_s: float = 2.0) -> None:
        """Kill `name` ("superlink" or "edge") with SIGKILL, as a crash would, and start it again with the same
        command after `pause_s` (the SuperLink resumes from its database; without one its runs are lost)."""
        self.procs.kill(name)
        time.sleep(pause_s)
        cmd, env = self.commands[name]
        proc = self.procs.start(name, cmd, env)
        wait_healthy(self.link_port if name == "superlink" else self.edge_port, proc, 90, self.ca)


@contextmanager
def server(workdir: Path, with_edge: bool = True, nodes: int = 0, database: bool = True,
           **sizes: int) -> Iterator[Server]:
    """Start a :class:`Server` in `workdir` (certificates for `nodes` SuperNodes, logs, state: SQLite, or Flower's
    in-memory state without `database`), the edge rendered by :func:`hybridfl.launch.edge.write` with `sizes`
    (``fleet_size``, ``max_body_mib``); stop it all on the way out."""
    certs = make_pki(workdir / "certs", nodes=nodes)
    env = flower_env(workdir / "home")
    link_port = free_port()
    with ProcessGroup(workdir / "logs", env) as procs:
        commands: dict[str, tuple[list[str], dict[str, str] | None]] = {"superlink": ([
            "flower-superlink", "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.crt"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth",
            *runtime_api(certs / "superlink.secret"), *(["--database", str(workdir / "superlink.db")] if database
                                                          else []),
            "--host", "127.0.0.1", "--port", str(link_port), "--disable-runtime-dependency-installation"], None)}
        link = procs.start("superlink", *commands["superlink"])
        wait_healthy(link_port, link, 90, certs / "ca.crt")
        edge_port = None
        if with_edge:
            edge_port = free_port()
            conf = edge.write(workdir / "edge", certs, f"127.0.0.1:{link_port}", f"127.0.0.1:{edge_port}", **sizes)
            commands["edge"] = (edge.command(conf), {**env, "PATH": f"{env['PATH']}:/usr/sbin:/sbin"})
            nginx = procs.start("edge", *commands["edge"])
            wait_healthy(edge_port, nginx, 30, certs / "ca.crt")
        yield Server(procs, certs, link_port, edge_port, commands)


def rss_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now (``VmRSS``) and at its peak so far (``VmHWM``), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M)[1]) / 1024 for key in ("VmRSS", "VmHWM")}


def connect(port: int, ca: Path, source: str = ATTACKER, timeout: float = 10.0) -> ssl.SSLSocket:
    """A TLS connection from `source` to 127.0.0.1:`port`, the server verified against `ca` as ``localhost``."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    try:
        return ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname="localhost")
    except BaseException:
        raw.close()
        raise


def _head(path: str, length: int | None) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/protobuf\r\n{framing}\r\n\r\n"
            .encode())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _read(sock: ssl.SSLSocket, wait: float) -> str | None:
    """What the server said on `sock` within `wait` seconds: the status code of its answer, ``closed`` (closed or
    reset without one), or None (nothing yet: a TLS 1.3 session ticket makes a socket readable with no answer)."""
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if sock.pending() == 0 and not select.select([sock], [], [], max(0.0, left))[0]:
            return None
        timeout = sock.gettimeout()
        sock.setblocking(False)
        try:
            data = sock.recv(4096)
        except ssl.SSLWantReadError:
            data = None
        except (OSError, ssl.SSLError):
            return "closed"
        finally:
            sock.settimeout(timeout)
        if data is not None:
            return m[1].decode() if (m := re.match(rb"HTTP/1\.[01] (\d{3})", data)) else "closed"
        if left <= 0:
            return None


def get(port: int, ca: Path, path: str, source: str = ATTACKER, timeout: float = 30.0) -> str:
    """GET `path` from `source`: the answer's status code, or ``closed``."""
    with connect(port, ca, source, timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        return _read(sock, timeout) or "timeout"


def upload(port: int, ca: Path, path: str, size_mib: int, chunked: bool, timeout: float = 120.0,
           source: str = ATTACKER) -> str:
    """POST a valid protobuf body of `size_mib` MiB to `path` from `source` (with a Content-Length, or chunked),
    unauthenticated; stop sending as soon as the server answers. Returns the answer's status code, or ``closed``."""
    prefix = _varint(UNKNOWN_FIELD) + _varint(size_mib * MIB)
    block = bytes(MIB)
    with connect(port, ca, source, timeout) as sock:
        deadline = time.monotonic() + timeout
        try:
            sock.sendall(_head(path, None if chunked else len(prefix) + size_mib * MIB))
            for part in (prefix, *(block for _ in range(size_mib))):
                if (said := _read(sock, 0)) is not None or time.monotonic() > deadline:
                    return said or "timeout"  # answered (refused) before the whole body: the rest is never sent
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except (OSError, ssl.SSLError):
            pass  # the server closed the connection mid-upload: the answer, if any, is still readable
        return _read(sock, max(1.0, deadline - time.monotonic())) or "timeout"


def stall(port: int, ca: Path, count: int, path: str = "/v1/fleet/push-object", headers: bool = True
          ) -> list[ssl.SSLSocket]:
    """`count` uploads from :data:`ATTACKER` that stop: with `headers`, whole headers announcing 1 MiB and one byte
    of it (a slow body); without, half a request line (slow headers). Returns the connections opened (those
    refused at once are closed by the server; :func:`fates` tells)."""
    socks = []
    for _ in range(count):
        try:
            sock = connect(port, ca)
            sock.sendall(_head(path, MIB) + b"\x00" if headers else b"POST /v1/fl")
        except (OSError, ssl.SSLError):
            continue  # refused at connect or handshake: nothing held
        socks.append(sock)
    return socks


def fates(socks: list[ssl.SSLSocket], wait: float = 1.0) -> dict[str, int]:
    """How many of `socks` the server answered (by status code), closed, or still holds open without a word
    (``held``), looked at for up to `wait` seconds in all."""
    out: dict[str, int] = {}
    deadline = time.monotonic() + wait
    for sock in socks:
        fate = _read(sock, max(0.0, deadline - time.monotonic())) or "held"
        out[fate] = out.get(fate, 0) + 1
    return out


def close(socks: list[ssl.SSLSocket]) -> None:
    for sock in socks:
        with suppress(OSError):
            sock.close()
