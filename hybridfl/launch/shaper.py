"""A user-space network link shaper: a TCP relay that puts a device's path through a slow, narrow, lossy link.

    python -m hybridfl.launch.shaper --route 127.0.0.1:LISTEN=127.0.0.1:TARGET[,latency_s=S][,up_bytes_per_s=B]
                              [,down_bytes_per_s=B][,drop=P][,rto_s=S][,seed=N] [--route ...]

A SuperNode connects to the relay's port on 127.0.0.1 instead of the SuperLink's; the relay forwards every byte to
the SuperLink and back, each direction through a :class:`Link`: a one-way latency (a pipe delay: bytes keep flowing,
so a transfer costs the latency once, not once per chunk), a rate per direction (a token bucket) and a loss rate.
It is a byte relay: TLS passes through untouched. It runs in user space because this kernel has no ``sch_netem``
(``tc qdisc ... netem`` is what one would use otherwise), and it listens on loopback only.

What ``drop`` models: the relay carries TCP, so a lost packet is never lost data; TCP retransmits it after a
retransmission timeout, and the stream stalls meanwhile. The byte stream of each direction is cut into segments of
:data:`SEGMENT` bytes (an Ethernet MSS); each is lost with probability ``drop`` (drawn from a generator seeded per
``seed``, connection and direction, so a run is reproducible whatever sizes the reads come in), and each loss holds
that direction's stream, the lost bytes and everything behind them, for ``rto_s``. What it does not model: fast
retransmit (recovery in about one round trip for most losses in a real stream), congestion window collapse after a
loss, reordering, duplicates or corruption.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import math
import random
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SEGMENT = 1448  # bytes: a TCP segment on Ethernet (MTU 1500 less IP and TCP headers with timestamps); unit of loss
CHUNK = 64 * 1024  # bytes read at a time where the rate is unlimited
IN_FLIGHT = 4 * 1024 * 1024  # bytes held per direction at most: beyond, a fast sender waits instead of filling memory
MIN_BURST = 16 * 1024  # bytes a token bucket holds at least (and never less than 50 ms at its rate)
COUNTERS = ("connections", "bytes_up", "bytes_down", "drops_up", "drops_down")  # per route; drops: segments lost


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {allowed}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Link:
    """One device's network path; the latency, loss and RTO apply to each direction, each rate to its own."""

    latency_s: float = 0.0  # one-way delay added to every byte, each direction
    up_bytes_per_s: float = 0.0  # device -> server; 0 = unlimited
    down_bytes_per_s: float = 0.0  # server -> device; 0 = unlimited
    drop: float = 0.0  # probability that a segment is lost (and retransmitted after rto_s)
    rto_s: float = 0.2  # what a loss costs: Linux's minimum retransmission timeout is 200 ms (TCP_RTO_MIN)
    seed: int = 0  # seeds the loss draws, per connection and direction

    def __post_init__(self) -> None:
        for name in ("latency_s", "up_bytes_per_s", "down_bytes_per_s", "rto_s"):
            value = getattr(self, name)
            _check(name, value, _number(value) and value >= 0, "a finite number >= 0")
        _check("drop", self.drop, _number(self.drop) and 0 <= self.drop < 1, "a number in [0, 1)")
        _check("seed", self.seed, isinstance(self.seed, int) and not isinstance(self.seed, bool), "an integer")

    def describe(self) -> str:
        rate = lambda r: f"{r:g} B/s" if r else "unlimited"
        return (f"latency {self.latency_s:g} s, up {rate(self.up_bytes_per_s)}, down {rate(self.down_bytes_per_s)}, "
                f"drop {self.drop:g} (rto {self.rto_s:g} s, seed {self.seed})")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name (even "localhost", which may bind two sockets on two ports): refused
        return False


@dataclass(frozen=True)
class Route:
    """Connections to ``listen_host:listen_port`` (0: a free port) go to ``target_host:target_port`` via ``link``."""

    target_port: int
    link: Link = field(default_factory=Link)
    listen_port: int = 0
    target_host: str = "127.0.0.1"
    listen_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _check("listen_host", self.listen_host, _loopback(self.listen_host),
               "a loopback IP address (127.0.0.0/8 or ::1): the shaper serves this machine only")
        _check("listen_port", self.listen_port, isinstance(self.listen_port, int) and 0 <= self.listen_port < 65536,
               "a port in 0..65535 (0: a free one)")
        _check("target_port", self.target_port, isinstance(self.target_port, int) and 0 < self.target_port < 65536,
               "a port in 1..65535")
        _check("link", self.link, isinstance(self.link, Link), "a Link")


class _Direction:
    """The schedule of one direction of one connection: when each chunk read may be written on the other side."""

    def __init__(self, rate: float, link: Link, rng: random.Random) -> None:
        self.rate, self.link, self.rng = rate, link, rng
        burst = max(MIN_BURST, rate * 0.05)
        self.burst_s = burst / rate if rate else 0.0
        self.read_size = min(CHUNK, int(burst)) if rate else CHUNK  # chunks no larger than a burst: smooth pacing
        self.free_at = 0.0  # when the link has sent everything so far (the token bucket, as a time: GCRA)
        self.released = 0.0  # the latest release time given: order is kept
        self.offset = 0  # bytes seen, to cut the stream into segments whatever the reads' sizes

    def schedule(self, now: float, size: int) -> tuple[float, float, int]:
        """(departure, release, losses) of `size` bytes read at `now`: the reader waits until the departure (the
        rate's back-pressure), the writer until the release (departure + latency: a pipe, not a sleep per chunk)."""
        losses = 0
        if self.link.drop:
            # one draw per segment that starts in this chunk
            first, end = -(-self.offset // SEGMENT), -(-(self.offset + size) // SEGMENT)
            losses = sum(self.rng.random() < self.link.drop for _ in range(end - first))
        self.offset += size
        stall = losses * self.link.rto_s
        # a loss holds the link: everything behind the lost bytes moves by the RTO (the bucket's clock too)
        self.free_at = max(self.free_at, now) + stall + (size / self.rate if self.rate else 0.0)
        depart = max(now + stall, self.free_at - self.burst_s)
        self.released = max(self.released, depart + self.link.latency_s)
        return depart, self.released, losses


class Shaper:
    """Relays several routes on one asyncio loop in a background thread. ``start()`` returns the listening ports (in
    the order of the routes), ``stop()`` closes every server and connection; as a context manager, both."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        if not self.routes:
            raise ValueError("routes: at least one is needed")
        self.ports: list[int] = []
        self._counters = [dict.fromkeys(COUNTERS, 0) for _ in self.routes]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: Exception | None = None
        self._servers: list[asyncio.Server] = []
        self._handlers: set[asyncio.Task] = set()

    def __enter__(self) -> Shaper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> list[int]:
        if self._loop is not None:
            raise RuntimeError("a Shaper starts once")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="shaper", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        return list(self.ports)

    def stop(self) -> None:
        """Close the servers and every connection; idempotent."""
        if self._thread is None or self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None

    def stats(self) -> dict[int, dict[str, int]]:
        """Per listening port: connections accepted, bytes relayed up and down, segments lost up and down."""
        return {port: dict(counters) for port, counters in zip(self.ports, self._counters)}

    # in the loop's thread

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._open())
        except Exception as error:  # noqa: BLE001 - e.g. a port in use: start() raises it in its caller's thread
            self._error = error
            loop.run_until_complete(self._close())
            loop.close()
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        loop.close()

    async def _open(self) -> None:
        for index, route in enumerate(self.routes):
            handler = lambda reader, writer, index=index: self._connection(index, reader, writer)
            server = await asyncio.start_server(handler, route.listen_host, route.listen_port)
            self._servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _connection(self, index: int, client_reader: asyncio.StreamReader,
                          client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._relay(index, client_reader, client_writer)
        except asyncio.CancelledError:  # stop(): end quietly (Python 3.11 logs a start_server handler ended so)
            pass
        finally:
            self._handlers.discard(task)

    async def _relay(self, index: int, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        route, counters = self.routes[index], self._counters[index]
        number = counters["connections"]
        counters["connections"] += 1
        server_writer = None
        try:
            server_reader, server_writer = await asyncio.open_connection(route.target_host, route.target_port)
            link = route.link
            up = _Direction(link.up_bytes_per_s, link, random.Random(f"{link.seed}:{number}:up"))
            down = _Direction(link.down_bytes_per_s, link, random.Random(f"{link.seed}:{number}:down"))
            async with asyncio.TaskGroup() as group:
                self._pipe(group, client_reader, server_writer, up, counters, "up")
                self._pipe(group, server_reader, client_writer, down, counters, "down")
        except* OSError:  # a side reset or refused: the connection ends, the relay goes on
            pass
        finally:
            for writer in (client_writer, server_writer):
                if writer is not None:
                    writer.close()

    @staticmethod
    def _pipe(group: asyncio.TaskGroup, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              direction: _Direction, counters: dict[str, int], name: str) -> None:
        """One direction: a reader that stamps each chunk with its release time, a writer that keeps to them."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        room = asyncio.Event()  # set while fewer than IN_FLIGHT bytes are queued (a bound in bytes, not in chunks:
        room.set()  # reads come in any size, and the pipe must hold a whole bandwidth-delay product of them)
        held = 0
        loop = asyncio.get_running_loop()

        async def read() -> None:
            nonlocal held
            while data := await reader.read(direction.read_size):
                depart, release, losses = direction.schedule(loop.time(), len(data))
                counters[f"drops_{name}"] += losses
                queue.put_nowait((release, data))
                held += len(data)
                if held >= IN_FLIGHT:
                    room.clear()
                # the link takes no more until this chunk has left: the sender feels the rate (TCP's back-pressure)
                await asyncio.sleep(depart - loop.time())
                await room.wait()
            queue.put_nowait(None)

        async def write() -> None:
            nonlocal held
            while (item := await queue.get()) is not None:
                release, data = item
                await asyncio.sleep(release - loop.time())
                counters[f"bytes_{name}"] += len(data)  # before the bytes can arrive: stats() never lags them
                writer.write(data)
                await writer.drain()
                held -= len(data)
                if held < IN_FLIGHT:
                    room.set()
            if writer.can_write_eof():  # a half-close passes through: the other direction may go on
                writer.write_eof()

        group.create_task(read())
        group.create_task(write())


# the command line


def _endpoint(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what} {text!r}: must be HOST:PORT")
    return host.strip("[]"), int(port)


LINK_FIELDS = tuple(f.name for f in dataclasses.fields(Link))


def parse_route(text: str) -> Route:
    """``LISTEN_HOST:PORT=TARGET_HOST:PORT[,field=value...]``, the fields those of :class:`Link`."""
    endpoints, *options = text.split(",")
    listen, sep, target = endpoints.partition("=")
    if not sep:
        raise ValueError(f"route {text!r}: must be LISTEN_HOST:PORT=TARGET_HOST:PORT[,field=value...]")
    (listen_host, listen_port), (target_host, target_port) = _endpoint(listen, "listen"), _endpoint(target, "target")
    values: dict[str, float | int] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if name not in LINK_FIELDS or not sep:
            raise ValueError(f"{option!r}: must be field=value, a field one of {', '.join(LINK_FIELDS)}")
        if name in values:
            raise ValueError(f"{name}: given twice")
        try:
            values[name] = int(value) if name == "seed" else float(value)
        except ValueError:
            kind = "an integer" if name == "seed" else "a number"
            raise ValueError(f"{name}={value!r}: must be {kind}") from None
    return Route(target_port, Link(**values), listen_port, target_host, listen_host)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridfl.launch.shaper", description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", action="append", required=True, metavar="L_HOST:PORT=T_HOST:PORT[,field=value]",
                        help=f"a route (repeatable); fields: {', '.join(LINK_FIELDS)}")
    args = parser.parse_args(argv)
    try:
        routes = [parse_route(text) for text in args.route]
    except ValueError as error:
        parser.error(str(error))  # exits 2
    # SIGTERM and SIGINT wait for sigwait() here: blocked before the loop's thread starts, which inherits the mask
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    shaper = Shaper(routes)
    try:
        ports = shaper.start()
    except OSError as error:
        print(f"shaper: {error}", file=sys.stderr)
        return 1
    for route, port in zip(routes, ports):
        print(f"shaper: {_address(route.listen_host, port)} -> {_address(route.target_host, route.target_port)} "
              f"{route.link.describe()}", flush=True)
    signal.sigwait(signals)
    shaper.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
