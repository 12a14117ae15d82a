"""The suite keeps to loopback (tests/conftest.py, tests/netns.py): its one interface is loopback, every other address
is unreachable, and Ray, as each Flower simulation starts it, takes 127.0.0.1 as its node's address."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest
from netns import loopback_only

# where it cannot be made, the session warned at its start (and CI's failed)
pytestmark = pytest.mark.skipif(not loopback_only(), reason="the suite runs outside a loopback-only network namespace")


def test_the_suite_has_loopback_only_and_no_route_elsewhere() -> None:
    """One interface, lo, up; any other address fails at once with no route, so nothing leaves the machine."""
    assert [name for _, name in socket.if_nameindex()] == ["lo"]
    with pytest.raises(OSError) as refused:  # the documentation range: no route, not a timeout
        socket.create_connection(("192.0.2.1", 9), timeout=5)
    assert refused.value.errno == errno.ENETUNREACH
    with socket.create_server(("127.0.0.1", 0)) as server:
        socket.create_connection(server.getsockname(), timeout=5).close()


def test_a_process_the_suite_starts_gets_127_0_0_1_as_its_rays_node_address() -> None:
    """What a Flower simulation's ray.init() binds: the machine's interface address outside the namespace."""
    probe = "import ray.util; print(ray.util.get_node_ip_address())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "127.0.0.1"
