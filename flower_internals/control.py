"""SuperNode keys registered through Flower's Control API from this process, over one connection: Flower's
``flwr supernode register`` is a process per key, ~1 s of CPU each (Flower's CLI imported anew), and a local
deployment registers one key per node before its nodes start.

Flower internals it uses (:data:`RELIES_ON`, checked by tests/test_flower_internals.py): what ``flwr supernode
register`` uses, its reader of a named connection in ``$FLWR_HOME/config.toml``, its Control API client (TLS from the
connection, an account's tokens where the SuperLink asks for them) and its error handler, the Control API's
request, and Flower's reading of a key (its curves, its bytes on the wire).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import click
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.utils import flwr_cli_exc_handler, init_http_client_from_connection
from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, uses_nist_ec_curve

RELIES_ON = ("flwr.cli.flower_config:read_superlink_connection",
             "flwr.cli.utils:init_http_client_from_connection",
             "flwr.cli.utils:flwr_cli_exc_handler",
             "flwr.proto.control_pb2:RegisterNodeRequest",
             "flwr.supercore.primitives.asymmetric:public_key_to_bytes",
             "flwr.supercore.primitives.asymmetric:uses_nist_ec_curve")

_HOME = threading.Lock()  # Flower's CLI reads its home from the environment: one home at a time in this process


@contextlib.contextmanager
def _flwr_home(home: Path) -> Iterator[None]:
    with _HOME:
        before = os.environ.get("FLWR_HOME")
        os.environ["FLWR_HOME"] = str(home)
        try:
            yield
        finally:
            if before is None:
                del os.environ["FLWR_HOME"]
            else:
                os.environ["FLWR_HOME"] = before


def public_key(path: Path) -> bytes:
    """The key in `path` as ``flwr supernode register`` reads it (an OpenSSH EC public key on a NIST curve) and
    sends it; RuntimeError naming the file otherwise (Flower's loader exits the process instead)."""
    try:
        key = serialization.load_ssh_public_key(path.read_bytes())
    except (OSError, ValueError, UnsupportedAlgorithm) as err:
        raise RuntimeError(f"cannot register {path}: {err}") from err
    if not isinstance(key, ec.EllipticCurvePublicKey) or not uses_nist_ec_curve(key):
        raise RuntimeError(f"cannot register {path}: not an EC public key on a NIST curve")
    return public_key_to_bytes(key)


def register_keys(flwr_home: Path, connection: str, public_keys: Sequence[Path]) -> list[int]:
    """``flwr supernode register KEY CONNECTION`` for each of `public_keys` (every key read first), with
    `flwr_home`'s configuration, over one Control API client; returns their node ids. Raises RuntimeError naming the
    key that could not be read or that the SuperLink did not register."""
    keys = [public_key(path) for path in public_keys]
    try:  # Flower's own words for a missing connection, a transport or an API error, as its command says them
        with _flwr_home(flwr_home):
            client = init_http_client_from_connection(read_superlink_connection(connection))
        try:
            with flwr_cli_exc_handler():
                ids = [client.RegisterNode(RegisterNodeRequest(public_key=key)).node_id for key in keys]
        finally:
            client.close()
    except click.ClickException as err:
        raise RuntimeError(f"cannot register {', '.join(map(str, public_keys))}: {err.format_message()}") from err
    if unregistered := [str(path) for path, node_id in zip(public_keys, ids) if not node_id]:
        raise RuntimeError(f"the SuperLink did not register {', '.join(unregistered)}")
    return ids
