"""The edge proxy's configuration (nginx): on the devices' port, only Flower's Fleet API and ``/health``.

The files beside this module are docker/compose.yml's (the SuperLink at ``superlink:9093``, the certificates in
``/app/certs/``, the devices' port ``0.0.0.0:8000``); :func:`write` renders them for a server of one's own
(``hybridfl edge``, docs/tutorials/deployment.md).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# What the compose file's copy says, and what a server of one's own replaces it with
CERTS, SUPERLINK, LISTEN = "/app/certs/", "superlink:9093", "0.0.0.0:8000"
SSL_NAME = "proxy_ssl_name superlink;"


def write(directory: Path, certs: Path, superlink: str = "127.0.0.1:9093", listen: str = LISTEN,
          plain_http: bool = False, name: str = "localhost") -> Path:
    """``nginx.conf`` and its ``listen.conf`` (TLS with `certs`' server.crt and server.key, or plain HTTP) in
    `directory`, forwarding the Fleet API to the SuperLink at `superlink` (host:port); over TLS the SuperLink's
    certificate is verified against `certs`/ca.crt for the DNS name `name` (nginx checks DNS names only, not IP
    addresses; `hybridfl certs` always names localhost). Returns the nginx.conf path."""
    directory.mkdir(parents=True, exist_ok=True)
    for source, target in (("nginx.conf", "nginx.conf"), ("plain-http.conf" if plain_http else "tls.conf",
                                                          "listen.conf")):
        text = files(__name__).joinpath(source).read_text()
        for token, value in ((CERTS, f"{certs.resolve()}/"), (SUPERLINK, superlink), (LISTEN, listen),
                             (SSL_NAME, f"proxy_ssl_name {name};")):
            text = text.replace(token, value)
        (directory / target).write_text(text)
    return directory / "nginx.conf"


def command(conf: Path) -> list[str]:
    """The nginx command line that runs `conf` in the foreground, its pid and temporary files beside it."""
    return ["nginx", "-p", f"{conf.parent.resolve()}/", "-e", "stderr", "-c", str(conf.resolve()), "-g", "daemon off;"]
