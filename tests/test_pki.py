"""hybridfl/launch/pki.py: a CA, a SuperLink certificate it signed for the given names, SuperNode keys in the
format ``flower-supernode --auth-supernode-private-key`` reads; kept on a second call."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hybridfl.cli import main
from hybridfl.launch.pki import make_pki, make_secrets


def test_the_server_certificate_is_signed_by_the_ca_for_every_name(tmp_path: Path) -> None:
    make_pki(tmp_path, ("superlink", "localhost", "127.0.0.1"), nodes=2)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)  # raises unless the CA signed it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    key = serialization.load_pem_private_key((tmp_path / "server.key").read_bytes(), password=None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    assert (tmp_path / "server.key").stat().st_mode & 0o077 == 0


def test_supernode_keys_are_openssh_ecdsa_pairs_and_kept_on_a_second_call(tmp_path: Path) -> None:
    assert main(["certs", str(tmp_path), "--nodes", "1"]) == 0
    private = serialization.load_ssh_private_key((tmp_path / "supernode-0").read_bytes(), password=None)
    public = serialization.load_ssh_public_key((tmp_path / "supernode-0.pub").read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert public.public_numbers() == private.public_key().public_numbers()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    make_pki(tmp_path, nodes=2)  # adds supernode-1, changes nothing that exists
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"supernode-1", "supernode-1.pub", "supernode-1.secret"}


def test_each_trust_boundary_gets_its_own_private_secret_kept_on_a_second_call(tmp_path: Path) -> None:
    """The SuperLink's Runtime API and each SuperNode's: 32 random bytes as hex (Flower reads the file's bytes),
    readable by the owner only, distinct, and never replaced once made (a running pair shares it)."""
    secrets = make_secrets(tmp_path, nodes=2)
    assert set(secrets) == {"superlink", "supernode-0", "supernode-1"}
    values = {name: path.read_text() for name, path in secrets.items()}
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in values.values()) and len(set(values.values())) == 3
    assert all(path.stat().st_mode & 0o077 == 0 for path in secrets.values())
    again = make_secrets(tmp_path, nodes=3)
    assert {name: again[name].read_text() for name in values} == values and "supernode-2" in again


def test_no_private_file_is_readable_by_others_at_any_moment_under_a_permissive_umask(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """Every private file is created 0600 (umask 0 would make a plain write 0666): with chmod doing nothing, a
    file written first and restricted after would be left readable by everyone."""
    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)
    monkeypatch.setattr(os, "chmod", lambda path, mode, **kw: None)
    old = os.umask(0)
    try:
        make_pki(tmp_path, nodes=2)
    finally:
        os.umask(old)
    private = {"ca.key", "server.key", "edge.key", "supernode-0", "supernode-1", "superlink.secret",
               "supernode-0.secret", "supernode-1.secret"}
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert {name: modes[name] for name in private} == dict.fromkeys(private, 0o600)
    assert all(modes[name] & 0o044 for name in set(modes) - private)  # certificates and public keys stay public


def test_the_certificate_always_names_the_servers_loopback(tmp_path: Path) -> None:
    """The edge proxy and the operator reach the SuperLink on the server's loopback: localhost and 127.0.0.1 are on
    its certificate whatever names are given."""
    make_pki(tmp_path, ("fl.example.org",))
    san = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
