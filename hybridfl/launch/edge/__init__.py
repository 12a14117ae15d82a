"""The edge proxy's configuration (nginx): on the devices' port, only Flower's Fleet API and ``/health``, within
limits that one hostile client cannot exhaust (docs/security.md "The edge's limits, and how to size them").

The files beside this module are docker/compose.yml's (the SuperLink through docker/link.conf's unix socket, the
certificates in ``/app/certs/``, the devices' port ``0.0.0.0:8000``, the limits for :data:`FLEET_SIZE` devices,
:data:`MAX_BODY_MIB` and :data:`LINK_RATE` asks for work a second to the SuperLink); :func:`write` renders them for a
server of one's own (``hybridfl edge``, docs/tutorials/deployment.md).
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

# What the compose file's copy says, and what a server of one's own replaces it with
CERTS, SUPERLINK, LISTEN = "/app/certs/", "unix:/run/hybridfl-link/link.sock", "0.0.0.0:8000"
SSL_NAME = "proxy_ssl_name superlink;"

# The compose copy's sizing: `hybridfl edge`'s defaults
FLEET_SIZE = 1000
MAX_BODY_MIB = 8
# The least body limit a device's largest request passes: one 5 MiB array chunk (Flower's
# FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE) in a push-object request, plus its protobuf framing
MIN_BODY_MIB = 6
# Per device, from Flower 1.42's SuperNode: requests in flight at once (2 object pushes or pulls,
# FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES/PULLS, and its heartbeat thread); a sustained request rate (an idle node
# asks every 3 s and beats every 30 s: 0.37/s; an update adds a pull and a push per object and client_app/supernode.py's
# seven quick asks after a reply); a burst (every device starting one update at once)
CONNS_PER_DEVICE, RATE_PER_DEVICE, BURST_PER_DEVICE = 3, 2, 64
MIN_WORKER_CONNECTIONS = 1024
# Asks for work (pulls of messages, activations) a second the edge passes to the SuperLink from all devices together;
# what completes work under way, and heartbeats, pass: Flower 1.42's one event loop answered about 85 requests a
# second per core of this 2-core machine with the devices beside it (BENCHMARKS "A thousand devices"); past it the
# loop's queue grows and the ServerApp's heartbeat waits in it
LINK_RATE = 60


def sizing(fleet_size: int = FLEET_SIZE, max_body_mib: int = MAX_BODY_MIB, link_rate: int = LINK_RATE
           ) -> dict[str, tuple[str, int]]:
    """nginx.conf's sized directives for `fleet_size` devices (all of them possibly behind one address), a
    push-object body limit of `max_body_mib` MiB and `link_rate` asks for work a second to the SuperLink in all: {the
    shipped line's pattern: (its line for these sizes, how many times the shipped file has it)}."""
    connections = max(MIN_WORKER_CONNECTIONS, 2 * CONNS_PER_DEVICE * fleet_size)  # a client and an upstream one each
    return {r"worker_rlimit_nofile \d+;": (f"worker_rlimit_nofile {2 * connections};", 1),
            r"worker_connections \d+;": (f"worker_connections {connections};", 1),
            r"zone=per_client_rate:10m rate=\d+r/s;": (
                f"zone=per_client_rate:10m rate={RATE_PER_DEVICE * fleet_size}r/s;", 1),
            r"limit_conn per_client_conns \d+;": (f"limit_conn per_client_conns {CONNS_PER_DEVICE * fleet_size};", 1),
            r"burst=\d+ nodelay;": (f"burst={BURST_PER_DEVICE * fleet_size} nodelay;", 3),
            # a second's worth waits at the edge, no more
            r"zone=link_rate:1m rate=\d+r/s;": (f"zone=link_rate:1m rate={link_rate}r/s;", 1),
            r"zone=link_rate burst=\d+;": (f"zone=link_rate burst={link_rate};", 2),
            r"client_max_body_size \d+m;(?=  # sized)": (f"client_max_body_size {max_body_mib}m;", 1),
            r"client_body_buffer_size \d+m;(?=  # sized)": (f"client_body_buffer_size {max_body_mib}m;", 1)}


def write(directory: Path, certs: Path, superlink: str = "127.0.0.1:9093", listen: str = LISTEN,
          plain_http: bool = False, name: str = "localhost", fleet_size: int = FLEET_SIZE,
          max_body_mib: int = MAX_BODY_MIB, link_rate: int = LINK_RATE) -> Path:
    """``nginx.conf`` and its ``listen.conf`` (TLS with `certs`' edge.crt and edge.key, or plain HTTP) in
    `directory`, forwarding the Fleet API to the SuperLink at `superlink` (host:port), its limits sized by
    :func:`sizing`; over TLS the SuperLink's certificate is verified against `certs`/ca.crt for the DNS name `name`
    (nginx checks DNS names only, not IP addresses; `hybridfl certs` always names localhost). Returns the
    nginx.conf path."""
    if fleet_size < 1:
        raise ValueError(f"--fleet-size {fleet_size}: at least 1 device")
    if link_rate < 1:
        raise ValueError(f"--link-rate {link_rate}: at least 1 request a second")
    if max_body_mib < MIN_BODY_MIB:
        raise ValueError(f"--max-body-mib {max_body_mib}: at least {MIN_BODY_MIB} (a device's push-object request "
                         "carries up to one 5 MiB array chunk of Flower's, and its framing)")
    directory.mkdir(parents=True, exist_ok=True)
    for source, target in (("nginx.conf", "nginx.conf"), ("plain-http.conf" if plain_http else "tls.conf",
                                                          "listen.conf")):
        text = files(__name__).joinpath(source).read_text()
        for token, value in ((CERTS, f"{certs.resolve()}/"), (SUPERLINK, superlink), (LISTEN, listen),
                             (SSL_NAME, f"proxy_ssl_name {name};")):
            text = text.replace(token, value)
        if source == "nginx.conf":
            for pattern, (line, lines) in sizing(fleet_size, max_body_mib, link_rate).items():
                text, found = re.subn(pattern, line, text)
                if found != lines:  # the shipped file and this module disagree: fail here, not with a wrong limit
                    raise RuntimeError(f"{source}: {found} lines match {pattern!r}, expected {lines}")
        (directory / target).write_text(text)
    return directory / "nginx.conf"


def command(conf: Path) -> list[str]:
    """The nginx command line that runs `conf` in the foreground, its pid and temporary files beside it."""
    return ["nginx", "-p", f"{conf.parent.resolve()}/", "-e", "stderr", "-c", str(conf.resolve()), "-g", "daemon off;"]
