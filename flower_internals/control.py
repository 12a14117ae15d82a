"""Two of Flower's commands through its Control API from this process: SuperNode keys registered over one connection,
and a run's status. Each of Flower's ``flwr supernode register`` and ``flwr ls`` is a process, ~1 s of CPU (Flower's
CLI imported anew): a local deployment registers one key per node before its nodes start, and a launcher asks for
its run's status once the run's stream ends.

Flower internals it uses (:data:`RELIES_ON`, checked by tests/test_flower_internals.py): what the two commands use,
their reader of a named connection in ``$FLWR_HOME/config.toml``, their Control API client (TLS from the connection,
an account's tokens where the SuperLink asks for them) and error handler, the Control API's requests, Flower's
reading of a key (its curves, its bytes on the wire), and ``flwr ls``'s rows (a run's status text and details).
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
from flwr.cli import utils as cli_utils
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.run_utils import format_runs
from flwr.cli.utils import flwr_cli_exc_handler, init_http_client_from_connection
from flwr.common.serde import run_from_proto
from flwr.proto.control_pb2 import ListRunsRequest, RegisterNodeRequest  # pylint: disable=E0611
from flwr.supercore.control import ControlHttpClient
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, uses_nist_ec_curve

RELIES_ON = ("flwr.cli.flower_config:read_superlink_connection",
             "flwr.cli.utils:init_http_client_from_connection",
             "flwr.cli.utils:flwr_cli_exc_handler",
             "flwr.cli.utils:log_superlink_connection",
             "flwr.proto.control_pb2:RegisterNodeRequest",
             "flwr.proto.control_pb2:ListRunsRequest",
             "flwr.common.serde:run_from_proto",
             "flwr.cli.run_utils:format_runs",
             "flwr.supercore.control:ControlHttpClient",
             "flwr.supercore.primitives.asymmetric:public_key_to_bytes",
             "flwr.supercore.primitives.asymmetric:uses_nist_ec_curve")

_CLI = threading.Lock()  # Flower's CLI reads its home from the environment: one client made at a time here


@contextlib.contextmanager
def _flwr_cli(home: Path | None) -> Iterator[None]:
    """Flower's CLI set up to make one client: `home` as its FLWR_HOME (None: as it is), and its "Using SuperLink"
    line unsaid (a command prints it once; a launcher that asks for its run's status again would repeat it)."""
    with _CLI:
        before, said = os.environ.get("FLWR_HOME"), cli_utils.log_superlink_connection
        if home is not None:
            os.environ["FLWR_HOME"] = str(home)
        cli_utils.log_superlink_connection = lambda connection: None
        try:
            yield
        finally:
            cli_utils.log_superlink_connection = said
            if before is None:
                os.environ.pop("FLWR_HOME", None)
            else:
                os.environ["FLWR_HOME"] = before


@contextlib.contextmanager
def _control(flwr_home: Path | None, connection: str, failing: str) -> Iterator[ControlHttpClient]:
    """A Control API client for `connection` of `flwr_home`'s configuration (None: this process's home), as Flower's
    commands make one, closed after; Flower's own words for a missing connection, a transport or an API error, as its
    commands say them, in a RuntimeError that starts with `failing`."""
    try:
        with _flwr_cli(flwr_home):
            client = init_http_client_from_connection(read_superlink_connection(connection))
        try:
            with flwr_cli_exc_handler():
                yield client
        finally:
            client.close()
    except click.ClickException as err:
        raise RuntimeError(f"{failing}: {err.format_message()}") from err


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


def register_keys(flwr_home: Path | None, connection: str, public_keys: Sequence[Path]) -> list[int]:
    """``flwr supernode register KEY CONNECTION`` for each of `public_keys` (every key read first), with
    `flwr_home`'s configuration (None: this process's home), over one Control API client; returns their node ids.
    Raises RuntimeError naming the key that could not be read or that the SuperLink did not register."""
    keys = [public_key(path) for path in public_keys]
    with _control(flwr_home, connection, f"cannot register {', '.join(map(str, public_keys))}") as client:
        ids = [client.RegisterNode(RegisterNodeRequest(public_key=key)).node_id for key in keys]
    if unregistered := [str(path) for path, node_id in zip(public_keys, ids) if not node_id]:
        raise RuntimeError(f"the SuperLink did not register {', '.join(unregistered)}")
    return ids


def run_status(flwr_home: Path | None, connection: str, run_id: int) -> tuple[str, str]:
    """What ``flwr ls CONNECTION --run-id RUN_ID --format json`` says of the run as its ``status`` and
    ``status-details`` (e.g. ``finished:completed``, ``N/A``), with `flwr_home`'s configuration (None: this process's
    home). RuntimeError when the SuperLink does not answer or knows no such run."""
    with _control(flwr_home, connection, f"cannot read the status of run {run_id}") as client:
        response = client.ListRuns(ListRunsRequest(run_id=run_id))
    rows = format_runs([run_from_proto(proto) for proto in response.run_dict.values()], response.now)
    if not rows:
        raise RuntimeError(f"cannot read the status of run {run_id}: the SuperLink knows no such run")
    return rows[0].status_text, rows[0].details
