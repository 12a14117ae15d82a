"""Certificates and SuperNode keys for a secured deployment (TLS + SuperNode authentication).

    hybridfl certs DIR [--name superlink --name localhost ...] [--nodes N]

writes into DIR:
  ca.crt, ca.key                  a private certificate authority (10 years)
  server.crt, server.key          the SuperLink's certificate, signed by the CA, with a SAN per --name
                                  (DNS names, or IP addresses), and always localhost and 127.0.0.1: the
                                  edge proxy and the operator reach the SuperLink on the server's loopback
  edge.crt, edge.key              the edge proxy's own certificate (the devices' port), for the same names,
                                  with a key of its own: the edge never holds the SuperLink's key
  supernode-I, supernode-I.pub    for I < N: SuperNode I's authentication key pair (ECDSA P-384, OpenSSH
                                  format, as ``ssh-keygen -t ecdsa -b 384 -N ""`` writes it)

  superlink.secret                the SuperExec shared secret of the SuperLink's Runtime API: the SuperLink and the
                                  ServerApp's SuperExec hold it, nobody else
  supernode-I.secret              ... of SuperNode I's Runtime API: SuperNode I and its ClientApp's SuperExec

SuperLink: ``--ssl-ca-certfile ca.crt --ssl-certfile server.crt --ssl-keyfile server.key
--enable-supernode-auth``; SuperNode I: ``--root-certificates ca.crt --auth-supernode-private-key supernode-I``,
after ``flwr supernode register supernode-I.pub`` (see docs/tutorials/deployment.md). Each Runtime API (``--isolation
process``) and the SuperExec that serves it: ``--superexec-auth-secret-file`` with its secret. Files that exist are
kept, so a second call adds nodes without changing the CA, the keys already registered or the secrets in use.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("superlink", "edge")  # docker/compose.yml's names for the SuperLink and the devices' port
LOOPBACK = ("localhost", "127.0.0.1")  # on every certificate: the edge and the operator's `flwr` on the server
VALID = datetime.timedelta(days=3650)


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to a new file `path` that only its owner can ever read: created with mode 0600 (whatever the
    umask), never readable by others in between; an existing file is refused rather than reused."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey, fmt: serialization.PrivateFormat) -> None:
    write_private(path, key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path} is not an elliptic-curve key; move it away to have a new CA made")
    return key


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
                 issuer_key: ec.EllipticCurvePrivateKey, names: tuple[str, ...] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    ca = issuer is None
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = (builder.add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path, names: tuple[str, ...] = DEFAULT_NAMES, nodes: int = 0) -> Path:
    """Create (or complete) the CA, the SuperLink's and the edge's certificates for `names` (and :data:`LOOPBACK`)
    and `nodes` SuperNode key pairs."""
    names = (*names, *(n for n in LOOPBACK if n not in names))
    directory.mkdir(parents=True, exist_ok=True)
    ca_crt, ca_key = directory / "ca.crt", directory / "ca.key"
    if not ca_crt.exists():
        key = ec.generate_private_key(ec.SECP384R1())
        _write_key(ca_key, key, serialization.PrivateFormat.TraditionalOpenSSL)
        ca_crt.write_bytes(_certificate("hybridfl CA", key, None, key).public_bytes(serialization.Encoding.PEM))
    issuer_key = _load_key(ca_key)
    issuer = x509.load_pem_x509_certificate(ca_crt.read_bytes()).subject
    for stem in ("server", "edge"):  # one key each: the edge's host never holds the SuperLink's
        if not (directory / f"{stem}.crt").exists():
            key = ec.generate_private_key(ec.SECP384R1())
            _write_key(directory / f"{stem}.key", key, serialization.PrivateFormat.TraditionalOpenSSL)
            cert = _certificate(names[0], key, issuer, issuer_key, names)
            (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for i in range(nodes):
        node_key(directory, f"supernode-{i}")
    make_secrets(directory, nodes)
    return directory


def make_secrets(directory: Path, nodes: int) -> dict[str, Path]:
    """The SuperExec shared secrets, one per trust boundary: ``superlink`` and ``supernode-I`` for I < `nodes`
    (kept where they exist). Returns {boundary: path}."""
    directory.mkdir(parents=True, exist_ok=True)
    return {name: runtime_secret(directory, name) for name in ("superlink", *(f"supernode-{i}" for i in range(nodes)))}


def runtime_secret(directory: Path, name: str) -> Path:
    """`name`.secret: 32 random bytes as hex (Flower reads the file's exact bytes), readable by its owner only."""
    path = directory / f"{name}.secret"
    if not path.exists():
        write_private(path, secrets.token_hex(32).encode())
    return path


def node_key(directory: Path, name: str) -> Path:
    """SuperNode `name`'s key pair (`name`, `name`.pub) in OpenSSH format; kept if it exists. Returns the
    private key's path."""
    private = directory / name
    if not private.exists():
        key = ec.generate_private_key(ec.SECP384R1())
        _write_key(private, key, serialization.PrivateFormat.OpenSSH)
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        (directory / f"{name}.pub").write_bytes(public + f" {name}\n".encode())
    return private
